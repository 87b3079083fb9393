//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: the header stage, corrupt and incompatible, and no allocation from
//! untrusted sizes.

mod common;

use common::*;
use ds4::format::{MAX_ABI, MAX_META, MAX_TENSORS};
use ds4::{open, Class, Error, VerifyOptions};
#[path = "common/peak_alloc.rs"]
mod peak_alloc;
use peak_alloc::peak_alloc;

// ---- stage header: corrupt ----

#[test]
fn too_short() {
    let d = dir();
    let f = default_file();
    for (len, need) in [(0usize, 4u64), (1, 4), (3, 4), (4, 96), (50, 96), (95, 96)] {
        let p = put(d.path(), TEXT, &f[..len]);
        let e = expect_err(&p, &opts(), "too_short", "header", Class::Corrupt);
        assert!(
            matches!(e, Error::TooShort { need: n, have } if n == need && have == len as u64),
            "{len}: {e}"
        );
    }
    // v1: 52 bytes needed.
    let v1 = v1_file(TEXT, 2, 0, &dsv4_payload(2), b"");
    let p = put(d.path(), TEXT, &v1[..51]);
    let e = expect_err(&p, &opts(), "too_short", "header", Class::Corrupt);
    assert!(matches!(e, Error::TooShort { need: 52, have: 51 }));
}

#[test]
fn bad_magic() {
    let d = dir();
    for (i, b) in [(0usize, b'k'), (1, 0), (2, b'D')] {
        let mut f = default_file();
        f[i] = b;
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "bad_magic", "header", Class::Corrupt);
        assert!(matches!(e, Error::BadMagic { .. }));
    }
    let p = put(d.path(), TEXT, b"GGUF and other things");
    expect_err(&p, &opts(), "bad_magic", "header", Class::Corrupt);
}

#[test]
fn unsupported_version_is_incompatible() {
    let d = dir();
    for v in [0u8, 4, 255] {
        let mut f = default_file();
        f[3] = v;
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(
            &p,
            &opts(),
            "unsupported_version",
            "header",
            Class::Incompatible,
        );
        assert!(matches!(e, Error::UnsupportedVersion { found } if found == v));
    }
    // Even a 4-byte file of an unknown version: kept, not removed.
    let p = put(d.path(), TEXT, b"KVC\x07");
    expect_err(
        &p,
        &opts(),
        "unsupported_version",
        "header",
        Class::Incompatible,
    );
}

#[test]
fn header_checksum() {
    let d = dir();
    // An immutable fixed field, a metadata byte, the stored checksum itself,
    // the stored text hash and the stored payload checksum.
    for at in [4usize, 5, 6, 8, 16, 24, 40, 56, 75, 80, 88, 96, 100] {
        let mut f = default_file();
        f[at] ^= 0x01;
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "header_checksum", "header", Class::Corrupt);
        assert!(matches!(e, Error::HeaderChecksum { .. }), "byte {at}: {e}");
    }
    // The checksum function matches the stored one on a good file.
    let f = default_file();
    let meta = text_offset(&f) - 96;
    assert_eq!(
        ds4::format::v2::header_checksum(&f[..96], &f[96..96 + meta]),
        u64::from_le_bytes(f[88..96].try_into().unwrap())
    );
}

#[test]
fn reserved_nonzero_needs_valid_checksum() {
    let d = dir();
    for at in [7usize, 52, 53, 54, 55, 76, 77, 78, 79] {
        let mut f = default_file();
        f[at] = 0x5a;
        // Without re-sealing, the checksum catches it first.
        let p = put(d.path(), TEXT, &f);
        expect_err(&p, &opts(), "header_checksum", "header", Class::Corrupt);
        reseal(&mut f);
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "reserved_nonzero", "header", Class::Corrupt);
        assert!(
            matches!(e, Error::ReservedNonZero { offset, value: 0x5a } if offset == at as u64),
            "{e}"
        );
    }
}

#[test]
fn size_overflow() {
    let d = dir();
    // payload_offset (192) + payload_bytes overflows u64.
    for pb in [u64::MAX, u64::MAX - 100, u64::MAX - 191] {
        let mut f = default_file();
        set_u64(&mut f, 40, pb);
        reseal(&mut f);
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "size_overflow", "header", Class::Corrupt);
        assert!(matches!(e, Error::SizeOverflow));
    }
    // One less fits in u64: an honest (huge) size, so the file is truncated.
    let mut f = default_file();
    set_u64(&mut f, 40, u64::MAX - 192);
    reseal(&mut f);
    let p = put(d.path(), TEXT, &f);
    expect_err(&p, &opts(), "truncated", "header", Class::Corrupt);
    // v1: 52 + text_bytes + payload_bytes overflows.
    let mut v1 = v1_file(TEXT, 2, 0, &dsv4_payload(2), b"");
    set_u64(&mut v1, 40, u64::MAX - 10);
    let p = put(d.path(), TEXT, &v1);
    expect_err(&p, &opts(), "size_overflow", "header", Class::Corrupt);
}

#[test]
fn header_too_large_metadata() {
    let d = dir();
    // meta_bytes > MAX_META is refused before the checksum and before any read.
    for meta in [MAX_META + 1, u64::from(u32::MAX)] {
        let mut f = default_file();
        set_u32(&mut f, 20, u32::try_from(meta).unwrap());
        let p = put(d.path(), TEXT, &f);
        let (r, peak) = peak_alloc(|| open(&p, &opts()));
        let e = r.unwrap_err();
        assert_eq!(
            (e.code(), e.stage(), e.class()),
            ("header_too_large", "header", Class::Corrupt)
        );
        assert!(matches!(
            e,
            Error::HeaderTooLarge {
                what: "metadata",
                ..
            }
        ));
        assert!(
            peak < 64 * 1024,
            "allocated {peak} bytes for a refused header"
        );
        expect_err(&p, &opts(), "header_too_large", "header", Class::Corrupt);
    }
}

#[test]
fn header_too_large_abi_and_tensor_count() {
    let d = dir();
    // An ABI string longer than MAX_ABI (a well-formed, checksummed file).
    let abi = vec![b'a'; MAX_ABI + 1];
    let f = assemble(
        &encode_meta(&abi, &default_tensors()),
        TEXT,
        &default_payload(),
    );
    let p = put(d.path(), TEXT, &f);
    let e = expect_err(&p, &opts(), "header_too_large", "header", Class::Corrupt);
    assert!(matches!(
        e,
        Error::HeaderTooLarge {
            what: "ABI string",
            ..
        }
    ));
    // A tensor count above MAX_TENSORS.
    let mut meta = Vec::new();
    meta.extend_from_slice(&0u16.to_le_bytes());
    meta.extend_from_slice(&u16::try_from(MAX_TENSORS + 1).unwrap().to_le_bytes());
    let f = assemble(&meta, TEXT, b"");
    let p = put(d.path(), TEXT, &f);
    let e = expect_err(&p, &opts(), "header_too_large", "header", Class::Corrupt);
    assert!(matches!(
        e,
        Error::HeaderTooLarge {
            what: "tensor table",
            ..
        }
    ));
}

#[test]
fn bad_metadata() {
    let d = dir();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut t = default_tensors();
    t[1].dtype = 11;
    cases.push(("unknown dtype", encode_meta(ABI.as_bytes(), &t)));
    let mut t = default_tensors();
    t[0].shape = vec![1; 9];
    cases.push(("ndim 9", encode_meta(ABI.as_bytes(), &t)));
    cases.push((
        "ABI not UTF-8",
        encode_meta(b"\xff\xfe", &default_tensors()),
    ));
    let mut t = default_tensors();
    t[1].name = b"\xc3\x28";
    cases.push(("name not UTF-8", encode_meta(ABI.as_bytes(), &t)));
    let mut m = encode_meta(ABI.as_bytes(), &default_tensors());
    m.push(0);
    cases.push(("unused byte", m));
    let mut m = encode_meta(ABI.as_bytes(), &default_tensors());
    m.truncate(m.len() - 3);
    cases.push(("ends inside nbytes", m));
    cases.push(("empty metadata", Vec::new()));
    cases.push(("abi length past the end", vec![0xff, 0x00, b'a']));
    let mut m = encode_meta(b"", &[]);
    m[2] = 1; // one tensor announced, none present
    cases.push(("missing tensor entry", m));
    for (what, meta) in cases {
        let f = assemble(&meta, TEXT, &default_payload());
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "bad_metadata", "header", Class::Corrupt);
        assert!(matches!(e, Error::BadMetadata(_)), "{what}: {e}");
    }
}

#[test]
fn truncated() {
    let d = dir();
    let f = default_file();
    let po = payload_offset(&f);
    // Cut in the payload, in the padding, in the text, in the metadata.
    for len in [f.len() - 1, po + 10, po, po - 5, text_offset(&f) + 2, 97] {
        let p = put(d.path(), TEXT, &f[..len]);
        let e = expect_err(&p, &opts(), "truncated", "header", Class::Corrupt);
        assert!(
            matches!(e, Error::Truncated { actual, .. } if actual == len as u64),
            "{len}: {e}"
        );
    }
    // v1 truncated (ext bit set or not).
    for flags in [0u8, 1] {
        let v1 = v1_file(TEXT, 2, flags, &dsv4_payload(2), b"");
        let p = put(d.path(), TEXT, &v1[..v1.len() - 1]);
        expect_err(&p, &opts(), "truncated", "header", Class::Corrupt);
    }
}

#[test]
fn truncated_huge_payload_claim_is_quick_and_allocates_nothing() {
    let d = dir();
    let mut f = default_file();
    set_u64(&mut f, 40, 1 << 60);
    reseal(&mut f);
    let p = put(d.path(), TEXT, &f);
    for mmap in [true, false] {
        let t0 = std::time::Instant::now();
        let (r, peak) = peak_alloc(|| open(&p, &VerifyOptions { mmap, ..opts() }));
        let e = r.unwrap_err();
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        assert!(
            matches!(e, Error::Truncated { expected, actual } if expected > 1 << 60 && actual == f.len() as u64),
            "{e}"
        );
        assert!(peak < 64 * 1024, "allocated {peak} bytes");
    }
    // Same for a 4 GiB text claim.
    let mut f = default_file();
    set_u32(&mut f, 48, u32::MAX);
    reseal(&mut f);
    let p = put(d.path(), TEXT, &f);
    let (r, peak) = peak_alloc(|| open(&p, &opts()));
    assert_eq!(r.unwrap_err().code(), "truncated");
    assert!(peak < 64 * 1024, "allocated {peak} bytes");
    // And a v1 file claiming 2^60 payload bytes.
    let mut v1 = v1_file(TEXT, 2, 1, &dsv4_payload(2), b"");
    set_u64(&mut v1, 40, 1 << 60);
    let p = put(d.path(), TEXT, &v1);
    let (r, peak) = peak_alloc(|| open(&p, &opts()));
    assert_eq!(r.unwrap_err().code(), "truncated");
    assert!(peak < 64 * 1024, "allocated {peak} bytes");
}

#[test]
fn trailing_bytes() {
    let d = dir();
    for extra in [1usize, 63, 64, 4096] {
        let mut f = default_file();
        f.resize(f.len() + extra, 0);
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "trailing_bytes", "header", Class::Corrupt);
        assert!(matches!(e, Error::TrailingBytes { extra: x, .. } if x == extra as u64));
    }
    // v1: bytes after the payload are trailer room, ext bit 0 or not, as
    // ds4's reader has it (`st_size >= 52 + text + payload`).
    let v1 = v1_file(TEXT, 2, 0, &dsv4_payload(2), b"KTM\x01\0\0\0\0");
    let p = put(d.path(), TEXT, &v1);
    assert_eq!(open_both(&p, &opts()).unwrap().header.trailer_bytes, 8);
    let v1 = v1_file(TEXT, 2, 1, &dsv4_payload(2), b"KTM\x01\0\0\0\0");
    let p = put(d.path(), TEXT, &v1);
    assert_eq!(open_both(&p, &opts()).unwrap().header.trailer_bytes, 8);
}

#[test]
fn bad_padding() {
    let d = dir();
    let f = default_file();
    let text_end = text_offset(&f) + TEXT.len();
    let po = payload_offset(&f);
    assert!(po > text_end);
    for at in [text_end, po - 1] {
        let mut g = f.clone();
        g[at] = 1;
        let p = put(d.path(), TEXT, &g);
        let e = expect_err(&p, &opts(), "bad_padding", "header", Class::Corrupt);
        assert!(matches!(e, Error::BadPadding { offset } if offset == at as u64));
    }
}

// ---- stage header: incompatible ----

#[test]
fn abi_mismatch() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let e = expect_err(
        &p,
        &VerifyOptions {
            expected_abi: Some("other/1"),
            ..opts()
        },
        "abi_mismatch",
        "header",
        Class::Incompatible,
    );
    assert!(matches!(e, Error::AbiMismatch { ref found, .. } if found == ABI));
    // Checked before the text: a file with a corrupt text is still only incompatible.
    let mut f = default_file();
    let to = text_offset(&f);
    f[to] ^= 1;
    let p = put(d.path(), TEXT, &f);
    expect_err(
        &p,
        &VerifyOptions {
            expected_abi: Some("other/1"),
            ..opts()
        },
        "abi_mismatch",
        "header",
        Class::Incompatible,
    );
    expect_err(
        &p,
        &VerifyOptions {
            expected_abi: Some(ABI),
            ..opts()
        },
        "text_sha1_mismatch",
        "text",
        Class::Corrupt,
    );
}

#[test]
fn quant_mismatch() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let e = expect_err(
        &p,
        &VerifyOptions {
            quant_bits: Some(4),
            ..opts()
        },
        "quant_mismatch",
        "header",
        Class::Incompatible,
    );
    assert!(matches!(
        e,
        Error::QuantMismatch {
            found: 0,
            expected: 4
        }
    ));
    open_both(
        &p,
        &VerifyOptions {
            quant_bits: Some(0),
            ..opts()
        },
    )
    .unwrap();
}

#[test]
fn ctx_too_small() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let e = expect_err(
        &p,
        &VerifyOptions {
            ctx: Some(2),
            ..opts()
        },
        "ctx_too_small",
        "header",
        Class::Incompatible,
    );
    assert!(matches!(e, Error::CtxTooSmall { tokens: 3, ctx: 2 }));
    open_both(
        &p,
        &VerifyOptions {
            ctx: Some(3),
            ..opts()
        },
    )
    .unwrap();
}
