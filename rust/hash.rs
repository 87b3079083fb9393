//! SHA-1 (`RustCrypto`'s `sha1`, which picks the CPU's SHA extensions at run
//! time), one-pass multi-prefix hashing, byte-prefix and common-prefix checks.

use sha1::{Digest, Sha1};

pub type Sha1Digest = [u8; 20];

pub fn sha1(data: &[u8]) -> Sha1Digest {
    Sha1::digest(data).into()
}

pub fn to_hex(d: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(d.len() * 2);
    for b in d {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

pub fn sha1_hex(data: &[u8]) -> String {
    to_hex(&sha1(data))
}

/// Parses 40 lowercase hex digits.
pub fn parse_hex_digest(s: &str) -> Option<Sha1Digest> {
    let b = s.as_bytes();
    if b.len() != 40 {
        return None;
    }
    let mut out = [0u8; 20];
    for (i, o) in out.iter_mut().enumerate() {
        let hi = hex_val(b[2 * i])?;
        let lo = hex_val(b[2 * i + 1])?;
        *o = (hi << 4) | lo;
    }
    Some(out)
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// The SHA-1 of `text[..len]` for every `len` in `lengths`, in one pass over
/// `text`: the hasher is fed up to each length in turn and a clone of its
/// state is finalized there. `lengths` need not be sorted or unique; lengths
/// beyond `text.len()` yield `None`. Cost: one SHA-1 of
/// `text[..max(lengths)]` plus one block per length.
pub fn sha1_prefixes(text: &[u8], lengths: &[usize]) -> Vec<Option<Sha1Digest>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]);
    let mut out = vec![None; lengths.len()];
    let mut h = Sha1::new();
    let mut fed = 0usize;
    for i in order {
        let len = lengths[i];
        if len > text.len() {
            break; // sorted: every later length is longer too
        }
        if len > fed {
            h.update(&text[fed..len]);
            fed = len;
        }
        out[i] = Some(h.clone().finalize().into());
    }
    out
}

/// True when `prefix` is a byte prefix of `text`.
pub fn is_byte_prefix(prefix: &[u8], text: &[u8]) -> bool {
    prefix.len() <= text.len() && text[..prefix.len()] == *prefix
}

/// Length of the longest common byte prefix of `a` and `b`.
pub fn common_prefix_len(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    // Compare 8 bytes at a time, then finish byte by byte.
    let mut i = 0;
    while let (Some(x), Some(y)) = (a[i..].first_chunk::<8>(), b[i..].first_chunk::<8>()) {
        if u64::from_ne_bytes(*x) != u64::from_ne_bytes(*y) {
            break;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix_len_u32(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fips_180_vectors() {
        assert_eq!(sha1_hex(b"abc"), "a9993e364706816aba3e25717850c26c9cd0d89d");
        assert_eq!(sha1_hex(b""), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(
            sha1_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "84983e441c3bd26ebaae4aa1f95129e5e54670f1"
        );
        let million_a = vec![b'a'; 1_000_000];
        assert_eq!(
            sha1_hex(&million_a),
            "34aa973cd4c4daa4f61eeb2bdbad27316534016f"
        );
    }

    #[test]
    fn prefixes_match_individual_hashes() {
        let text: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        let lens = [4999usize, 0, 64, 63, 65, 1000, 64, 5000, 5001, 1];
        let got = sha1_prefixes(&text, &lens);
        for (l, g) in lens.iter().zip(got) {
            if *l > text.len() {
                assert!(g.is_none());
            } else {
                assert_eq!(g.unwrap(), sha1(&text[..*l]), "len {l}");
            }
        }
    }

    #[test]
    fn prefix_helpers() {
        assert!(is_byte_prefix(b"", b""));
        assert!(is_byte_prefix(b"ab", b"abc"));
        assert!(!is_byte_prefix(b"abcd", b"abc"));
        assert!(!is_byte_prefix(b"abd", b"abc"));
        assert_eq!(
            common_prefix_len(b"hello world, long text", b"hello world, long tent"),
            20
        );
        assert_eq!(common_prefix_len(b"", b"x"), 0);
        assert_eq!(common_prefix_len(b"same", b"same"), 4);
        assert_eq!(common_prefix_len_u32(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(parse_hex_digest(&sha1_hex(b"x")).unwrap(), sha1(b"x"));
        // Either case, as ds4 reads names; anything else is not a digest.
        assert_eq!(
            parse_hex_digest("A9993E364706816ABA3E25717850C26C9CD0D89D").unwrap(),
            sha1(b"abc")
        );
        assert!(parse_hex_digest("g9993e364706816aba3e25717850c26c9cd0d89d").is_none());
    }
}
