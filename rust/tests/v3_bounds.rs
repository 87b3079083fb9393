//! v3 decoding in bounded memory (FORMAT.md §1.10, "What a reader holds"):
//! the declared raw size refused against the caller's bound before any
//! allocation; the stored payload never copied whole (one frame at a time);
//! with a key, nothing decompressed before the MAC matches; a sparse
//! (zeroed) or short file refused by what it really holds.

mod common;

use common::{expect_err, reseal, set_u64, xxh3_64};
use ds4::decode::RawBound;
use ds4::format::mac::derive_key;
use ds4::{open, Class, Dtype, TensorSrc, VerifyOptions, WriteMeta};
use ds4::{write_checkpoint, Compression, WriteOptions};
#[path = "common/peak_alloc.rs"]
mod peak_alloc;
use peak_alloc::peak_alloc;
use std::path::{Path, PathBuf};

const TOKENS: u32 = 3;

/// Noise (incompressible: stored about as large as raw), `n` bytes.
fn noise(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// A v3 file of `raw` payload bytes in frames of `span`; its path.
fn write_v3(dir: &Path, raw: usize, span: u32, key: Option<&[u8; 32]>) -> PathBuf {
    let text = format!("bounds {raw} {span} {}", key.is_some()).into_bytes();
    let blob = noise(raw);
    let shape = [raw as u64];
    let t = [TensorSrc {
        name: "blob",
        dtype: Dtype::U8,
        shape: &shape,
        data: &blob,
    }];
    let meta = WriteMeta {
        quant_bits: 0,
        reason: 1,
        flags: 0,
        tokens: TOKENS,
        ctx: 4096,
        created: 1_700_000_000,
        abi: "test/1".into(),
    };
    let p = dir.join(format!("{}.kv", ds4::hash::sha1_hex(&text)));
    let c = Compression {
        level: 1,
        shuffle: false,
        span,
    };
    write_checkpoint(
        &p,
        &meta,
        &text,
        &t,
        &WriteOptions {
            auth_key: key,
            drop_cache: false,
            compression: Some(c),
        },
    )
    .unwrap();
    p
}

fn header_only(p: &Path) -> ds4::Checkpoint {
    let o = VerifyOptions {
        load_payload: false,
        ..VerifyOptions::default()
    };
    open(p, &o).unwrap()
}

#[test]
fn a_declared_raw_size_over_the_bound_is_refused_before_any_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let raw = 3 << 20;
    let p = write_v3(dir.path(), raw, 1 << 20, None);
    let ck = header_only(&p);
    assert!(ck.header.codec.is_some(), "written as v3");
    let declared = ck.header.raw_payload_bytes;
    // a state of 3 tokens: 1 MiB fixed + 512 KiB a token = 2.5 MiB < 3 MiB
    let tight = RawBound {
        fixed: 1 << 20,
        per_token: 512 << 10,
        most: u64::MAX,
    };
    assert_eq!(tight.limit(TOKENS), (5 << 20) / 2);
    let o = VerifyOptions {
        max_raw: Some(tight),
        ..VerifyOptions::default()
    };
    let (r, peak) = peak_alloc(|| {
        open(
            &p,
            &VerifyOptions {
                mmap: false,
                ..o.clone()
            },
        )
    });
    let e = r.unwrap_err();
    assert_eq!(
        (e.code(), e.stage(), e.class()),
        ("frame_table", "header", Class::Corrupt)
    );
    assert!(
        e.to_string().contains(&format!("{declared} raw bytes")),
        "{e}"
    );
    assert!(peak < 64 << 10, "{peak} bytes allocated before the refusal");
    expect_err(&p, &o, "frame_table", "header", Class::Corrupt);
    // the store's cap alone refuses it too
    let capped = RawBound {
        fixed: u64::MAX,
        per_token: 0,
        most: declared - 1,
    };
    let o = VerifyOptions {
        max_raw: Some(capped),
        ..VerifyOptions::default()
    };
    expect_err(&p, &o, "frame_table", "header", Class::Corrupt);
    // a bound the file fits loads it, byte-exact
    let fits = RawBound {
        fixed: 0,
        per_token: declared.div_ceil(u64::from(TOKENS)),
        most: declared,
    };
    let o = VerifyOptions {
        max_raw: Some(fits),
        ..VerifyOptions::default()
    };
    let ck = common::open_both(&p, &o).unwrap();
    assert_eq!(ck.payload().unwrap().len(), raw);
}

#[test]
fn the_stored_payload_is_never_copied_whole() {
    // 24 frames of 64 KiB: a load allocates one frame's stored bytes at a
    // time, never the 1.5 MiB of them (the raw buffer is an anonymous map)
    let dir = tempfile::tempdir().unwrap();
    let key = derive_key(b"a bounds test secret, not for use");
    for k in [None, Some(&key)] {
        let p = write_v3(dir.path(), 24 << 16, 1 << 16, k);
        let stored = usize::try_from(header_only(&p).header.payload_bytes).unwrap();
        assert!(stored > 20 << 16, "{stored}");
        for mmap in [true, false] {
            let o = VerifyOptions {
                mmap,
                auth_key: k,
                ..VerifyOptions::default()
            };
            let (r, peak) = peak_alloc(|| open(&p, &o));
            let ck = r.unwrap();
            assert_eq!(ck.payload().unwrap(), &noise(24 << 16)[..]);
            assert!(
                peak < (1 << 16) + (16 << 10),
                "largest allocation {peak} (stored {stored})"
            );
        }
    }
}

/// `f` with its stored payload zeroed (what a sparse file reads) and its
/// payload checksum resealed over the zeros.
fn zero_payload(p: &Path, keyed: bool) {
    let ck = header_only(p);
    let off = usize::try_from(ck.header.payload_offset).unwrap();
    let end = off + usize::try_from(ck.header.payload_bytes).unwrap();
    let mut f = std::fs::read(p).unwrap();
    f[off..end].fill(0);
    let sum = xxh3_64(&f[off..end]);
    set_u64(&mut f, 80, sum);
    reseal(&mut f);
    // the file's length stays; its payload becomes a hole
    std::fs::write(p, &f[..off]).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    file.set_len(end as u64).unwrap();
    if keyed {
        use std::os::unix::fs::FileExt;
        file.write_all_at(&f[end..], end as u64).unwrap();
    }
}

#[test]
fn a_sparse_payload_fails_at_its_first_frame_or_its_mac_in_bounded_memory() {
    // raw under the anonymous-map size: the raw buffer is an allocation the
    // tracker sees, so "nothing decoded before the MAC" shows as its absence
    let dir = tempfile::tempdir().unwrap();
    let key = derive_key(b"a bounds test secret, not for use");
    let raw = 900 << 10;
    for k in [None, Some(&key)] {
        let p = write_v3(dir.path(), raw, 1 << 12, k);
        zero_payload(&p, k.is_some());
        let o = VerifyOptions {
            auth_key: k,
            ..VerifyOptions::default()
        };
        let (code, msg) = if k.is_some() {
            ("mac_mismatch", None)
        } else {
            ("bad_frame", Some("frame 0 "))
        };
        for mmap in [true, false] {
            let (r, peak) = peak_alloc(|| open(&p, &VerifyOptions { mmap, ..o.clone() }));
            let e = r.unwrap_err();
            assert_eq!((e.code(), e.class()), (code, Class::Corrupt), "{e}");
            if let Some(m) = msg {
                assert!(e.to_string().contains(m), "{e}");
            }
            if k.is_some() {
                assert!(
                    peak < raw,
                    "{peak}: the raw buffer was allocated before the MAC matched"
                );
            }
            assert!(peak <= raw + (64 << 10), "{peak}");
        }
    }
}

#[test]
fn a_good_key_loads_and_a_flipped_stored_byte_decodes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let key = derive_key(b"a bounds test secret, not for use");
    let raw = 900 << 10;
    let p = write_v3(dir.path(), raw, 1 << 12, Some(&key));
    let o = VerifyOptions {
        auth_key: Some(&key),
        ..VerifyOptions::default()
    };
    let (r, peak) = peak_alloc(|| open(&p, &o));
    assert_eq!(r.unwrap().payload().unwrap(), &noise(raw)[..]);
    assert!(peak >= raw, "{peak}");
    let ck = header_only(&p);
    let off = usize::try_from(ck.header.payload_offset).unwrap();
    let end = off + usize::try_from(ck.header.payload_bytes).unwrap();
    let mut f = std::fs::read(&p).unwrap();
    f[end - 5] ^= 1; // the last frame
    let sum = xxh3_64(&f[off..end]);
    set_u64(&mut f, 80, sum);
    reseal(&mut f);
    std::fs::write(&p, &f).unwrap();
    let (r, peak) = peak_alloc(|| open(&p, &o));
    assert_eq!(r.unwrap_err().code(), "mac_mismatch");
    assert!(peak < raw, "{peak}");
}

#[test]
fn a_short_v3_file_is_refused_before_its_payload_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let p = write_v3(dir.path(), 3 << 20, 1 << 20, None);
    let len = std::fs::metadata(&p).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    file.set_len(len - 1).unwrap();
    let (r, peak) = peak_alloc(|| open(&p, &VerifyOptions::default()));
    let e = r.unwrap_err();
    assert_eq!(
        (e.code(), e.stage(), e.class()),
        ("truncated", "header", Class::Corrupt)
    );
    assert!(peak < 64 << 10, "{peak}");
}
