//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: the tables of names (dtype strings, reasons, error classes) that
//! the Python side relies on, and the hash helpers.

use ds4::format::reason_name;
use ds4::hash::{common_prefix_len, sha1, sha1_prefixes};
use ds4::{Class, Dtype, Error};

// ---- names the Python side relies on ----

#[test]
fn dtype_strings_map_both_ways() {
    let table = [
        (Dtype::U8, "|u1", 1u64),
        (Dtype::I8, "|i1", 1),
        (Dtype::U16, "<u2", 2),
        (Dtype::I16, "<i2", 2),
        (Dtype::U32, "<u4", 4),
        (Dtype::I32, "<i4", 4),
        (Dtype::U64, "<u8", 8),
        (Dtype::I64, "<i8", 8),
        (Dtype::F16, "<f2", 2),
        (Dtype::F32, "<f4", 4),
        (Dtype::F64, "<f8", 8),
    ];
    for (d, s, size) in table {
        assert_eq!(d.numpy(), s, "{d:?}");
        assert_eq!(d.itemsize(), size, "{d:?}");
        assert_eq!(Dtype::from_numpy(s), Some(d), "{s}");
        // The same without a byte-order prefix, and with numpy's '=' (native).
        let bare = &s[1..];
        assert_eq!(Dtype::from_numpy(bare), Some(d), "{bare}");
        assert_eq!(Dtype::from_numpy(&format!("={bare}")), Some(d), "={bare}");
        assert_eq!(Dtype::from_code(d as u8), Some(d));
    }
    // numpy's one-character codes for bytes.
    assert_eq!(Dtype::from_numpy("B"), Some(Dtype::U8));
    assert_eq!(Dtype::from_numpy("b"), Some(Dtype::I8));
    // Big-endian, complex, bool, unknown or empty: not a ds4 dtype.
    for s in [
        ">u2", ">f4", "<c8", "|b1", "?", "f16", "u16", "<U4", "", "<", "float32",
    ] {
        assert_eq!(Dtype::from_numpy(s), None, "{s:?}");
    }
}

#[test]
fn reason_names() {
    let names = [
        "unknown",
        "cold",
        "continued",
        "evict",
        "shutdown",
        "agent-system",
        "agent-session",
        "named",
        "frontier",
    ];
    for (r, name) in names.iter().enumerate() {
        assert_eq!(reason_name(u8::try_from(r).unwrap()), *name, "reason {r}");
    }
    for r in [9u8, 10, 100, 255] {
        assert_eq!(reason_name(r), "unknown", "reason {r}");
    }
}

#[test]
fn class_names() {
    // Recovery (Python) dispatches on these strings.
    let cases = [
        (
            Error::BadMagic { found: *b"GGU" },
            Class::Corrupt,
            "corrupt",
        ),
        (
            Error::UnsupportedVersion { found: 9 },
            Class::Incompatible,
            "incompatible",
        ),
        (
            Error::NotPrefix {
                len: 2,
                prompt_len: 1,
            },
            Class::Mismatch,
            "mismatch",
        ),
        (
            Error::Io(std::io::Error::from_raw_os_error(libc::EACCES)),
            Class::Io,
            "io",
        ),
    ];
    for (e, class, name) in cases {
        assert_eq!(e.class(), class, "{e}");
        assert_eq!(e.class().as_str(), name, "{e}");
    }
}

// ---- hashing helpers ----

#[test]
fn sha1_prefixes_gives_one_answer_per_length() {
    let text: Vec<u8> = (0..300u32)
        .map(|i| u8::try_from(i * 13 % 256).unwrap())
        .collect();
    assert!(sha1_prefixes(&text, &[]).is_empty());
    // Unsorted, repeated, zero, the whole text and past the end.
    let lens = [200usize, 0, 64, 64, 300, 1, 301, 63, 1000, 65];
    let got = sha1_prefixes(&text, &lens);
    assert_eq!(got.len(), lens.len());
    for (l, g) in lens.iter().zip(&got) {
        if *l > text.len() {
            assert_eq!(*g, None, "len {l}");
        } else {
            assert_eq!(*g, Some(sha1(&text[..*l])), "len {l}");
        }
    }
    assert_eq!(sha1_prefixes(b"", &[0, 1]), vec![Some(sha1(b"")), None]);
}

#[test]
fn common_prefix_len_finds_the_first_difference_anywhere() {
    let a: Vec<u8> = (0..40u8).map(|i| b'a' + i % 26).collect();
    for i in 0..a.len() {
        let mut b = a.clone();
        b[i] ^= 0x20;
        assert_eq!(common_prefix_len(&a, &b), i, "difference at {i}");
        assert_eq!(common_prefix_len(&b, &a), i, "difference at {i}");
    }
    // A difference in the first 8-byte word, the rest equal.
    assert_eq!(
        common_prefix_len(b"abcdefgh12345678", b"abXdefgh12345678"),
        2
    );
    for n in 0..=a.len() {
        assert_eq!(common_prefix_len(&a[..n], &a), n);
        assert_eq!(common_prefix_len(&a, &a[..n]), n);
    }
}
