//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode. Plus: no allocation from untrusted sizes, and
//! `touch` (mutable fields outside the checksum, no lost updates).

mod common;

use common::*;
use ds4::format::{MAX_ABI, MAX_META, MAX_TENSORS};
use ds4::{open, touch, Class, Error, VerifyOptions};
#[path = "common/peak_alloc.rs"]
mod peak_alloc;
use peak_alloc::peak_alloc;

fn opts() -> VerifyOptions<'static> {
    VerifyOptions::default()
}

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

// ---- sanity: the independent encoder and the writer agree; the file opens ----

#[test]
fn independent_encoder_matches_writer_and_opens() {
    let d = dir();
    let lg = logits();
    let meta = ds4::WriteMeta {
        reason: 1,
        tokens: TOKENS,
        ctx: CTX,
        created: CREATED,
        abi: ABI.into(),
        ..Default::default()
    };
    let t = [
        ds4::TensorSrc {
            name: "logits",
            dtype: ds4::Dtype::F32,
            shape: &[4],
            data: &lg,
        },
        ds4::TensorSrc {
            name: "blob",
            dtype: ds4::Dtype::U8,
            shape: &[3],
            data: b"xyz",
        },
    ];
    let p = d.path().join(name_for(TEXT));
    ds4::write_checkpoint(&p, &meta, TEXT, &t).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), default_file());
    let ck = open_both(
        &p,
        &VerifyOptions {
            expected_abi: Some(ABI),
            prompt: Some(b"Hello, errors! and more"),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(ck.text, TEXT);
    assert_eq!(ck.header.tensors.len(), 2);
}

// ---- stage open ----

#[test]
fn not_regular_file_directory() {
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    std::fs::create_dir(&p).unwrap();
    let e = expect_err(&p, &opts(), "not_regular_file", "open", Class::Corrupt);
    assert!(matches!(e, Error::NotRegularFile { what: "directory" }));
}

#[test]
fn not_regular_file_symlink() {
    let d = dir();
    let target = d.path().join("target.bin");
    std::fs::write(&target, default_file()).unwrap();
    let p = d.path().join(name_for(TEXT));
    std::os::unix::fs::symlink(&target, &p).unwrap();
    let e = expect_err(&p, &opts(), "not_regular_file", "open", Class::Corrupt);
    assert!(matches!(e, Error::NotRegularFile { what: "symlink" }));
    // touch refuses it too, and the target is untouched.
    assert_eq!(touch(&p, 1).unwrap_err().code(), "not_regular_file");
    assert_eq!(std::fs::read(&target).unwrap(), default_file());
}

#[test]
fn not_regular_file_fifo() {
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // Must not block on the FIFO.
    let e = expect_err(&p, &opts(), "not_regular_file", "open", Class::Corrupt);
    assert!(matches!(
        e,
        Error::NotRegularFile {
            what: "special file"
        }
    ));
}

#[test]
fn bad_name() {
    let d = dir();
    let sha = ds4::hash::sha1_hex(TEXT);
    for name in [
        "foo.kv".to_owned(),
        format!("{}.kv", &sha[..39]),
        format!("{sha}0.kv"),
        format!("{sha}.kvx"),
        sha.clone(),
        format!("{}g.kv", &sha[..39]),
    ] {
        let p = d.path().join(&name);
        std::fs::write(&p, default_file()).unwrap();
        let e = expect_err(&p, &opts(), "bad_name", "open", Class::Mismatch);
        assert!(matches!(e, Error::BadName { .. }), "{name}");
        // The bytes are fine: without the name check it opens.
        open_both(
            &p,
            &VerifyOptions {
                check_name: false,
                ..opts()
            },
        )
        .unwrap();
    }
}

#[test]
fn io_error_for_missing_file() {
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let e = expect_err(&p, &opts(), "io", "open", Class::Io);
    assert!(matches!(e, Error::Io(_)));
}

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

// ---- stage text ----

#[test]
fn text_sha1_mismatch() {
    let d = dir();
    let f = default_file();
    let to = text_offset(&f);
    for i in [0, TEXT.len() - 1] {
        let mut g = f.clone();
        g[to + i] ^= 0x20;
        let p = put(d.path(), TEXT, &g);
        let e = expect_err(&p, &opts(), "text_sha1_mismatch", "text", Class::Corrupt);
        assert!(matches!(e, Error::TextHashMismatch { .. }));
    }
}

#[test]
fn name_mismatch() {
    let d = dir();
    let p = put(d.path(), b"some other text", &default_file());
    let e = expect_err(&p, &opts(), "name_mismatch", "text", Class::Corrupt);
    assert!(matches!(e, Error::NameMismatch { .. }));
    // v1 files have no text hash in the header: the name is their check.
    let v1 = v1_file(TEXT, 2, 0, &dsv4_payload(2), b"");
    let p = put(d.path(), b"some other text", &v1);
    expect_err(&p, &opts(), "name_mismatch", "text", Class::Corrupt);
}

#[test]
fn a_per_model_name_is_checked_against_the_abi() {
    use ds4::name::FileId;
    let d = dir();
    let digest = ds4::hash::sha1(TEXT);
    // its own ABI's tag: opens; the name parses back to the same id
    let own = FileId::for_abi(digest, ABI).name(0);
    let p = d.path().join(&own);
    std::fs::write(&p, default_file()).unwrap();
    open(&p, &opts()).unwrap();
    assert_eq!(FileId::parse(&own), Some(FileId::for_abi(digest, ABI)));
    // another model's tag on this file: never loaded, and kept
    // (incompatible, as another engine's file is), whatever the session
    let p = d
        .path()
        .join(FileId::for_abi(digest, "another model").name(0));
    std::fs::write(&p, default_file()).unwrap();
    let e = expect_err(&p, &opts(), "abi_mismatch", "header", Class::Incompatible);
    assert!(matches!(e, Error::AbiMismatch { ref found, .. } if found == ABI));
    let own_abi = VerifyOptions {
        expected_abi: Some(ABI),
        ..opts()
    };
    expect_err(&p, &own_abi, "abi_mismatch", "header", Class::Incompatible);
    let e = ds4::index::read_entry(&p).unwrap_err();
    assert_eq!(e.class(), Class::Incompatible);
}

#[test]
fn not_prefix() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    for prompt in [
        &b"Hello, errors"[..],
        b"",
        b"Hello, Errors! and more",
        b"xHello, errors!",
    ] {
        let e = expect_err(
            &p,
            &VerifyOptions {
                prompt: Some(prompt),
                ..opts()
            },
            "not_prefix",
            "text",
            Class::Mismatch,
        );
        assert!(
            matches!(e, Error::NotPrefix { len: 14, prompt_len } if prompt_len == prompt.len() as u64)
        );
    }
    open_both(
        &p,
        &VerifyOptions {
            prompt: Some(TEXT),
            ..opts()
        },
    )
    .unwrap();
}

/// The `SHAttered` identical-prefix SHA-1 collision (Stevens et al., 2017):
/// two different 320-byte messages with the same SHA-1 state, so any common
/// suffix keeps them colliding. With a real collision, `prefix_collision` is
/// reachable end to end: the file's text hashes like the prompt's prefix
/// (so a hash-only lookup would pick it) but the bytes differ.
const SHATTERED_PREFIX: &str = "255044462d312e330a25e2e3cfd30a0a0a312030206f626a0a3c3c2f57696474682032203020522f4865696768742033203020522f547970652034203020522f537562747970652035203020522f46696c7465722036203020522f436f6c6f7253706163652037203020522f4c656e6774682038203020522f42697473506572436f6d706f6e656e7420383e3e0a73747265616d0affd8fffe00245348412d3120697320646561642121212121852fec092339759c39b1a1c63c4c97e1fffe01";
const SHATTERED_1: &str = "7f46dc93a6b67e013b029aaa1db2560b45ca67d688c7f84b8c4c791fe02b3df614f86db1690901c56b45c1530afedfb76038e972722fe7ad728f0e4904e046c230570fe9d41398abe12ef5bc942be33542a4802d98b5d70f2a332ec37fac3514e74ddc0f2cc1a874cd0c78305a21566461309789606bd0bf3f98cda8044629a1";
const SHATTERED_2: &str = "7346dc9166b67e118f029ab621b2560ff9ca67cca8c7f85ba84c79030c2b3de218f86db3a90901d5df45c14f26fedfb3dc38e96ac22fe7bd728f0e45bce046d23c570feb141398bb552ef5a0a82be331fea48037b8b5d71f0e332edf93ac3500eb4ddc0decc1a864790c782c76215660dd309791d06bd0af3f98cda4bc4629b1";

#[test]
fn prefix_collision_with_a_real_sha1_collision() {
    let a = hex::decode(format!("{SHATTERED_PREFIX}{SHATTERED_1}")).unwrap();
    let b = hex::decode(format!("{SHATTERED_PREFIX}{SHATTERED_2}")).unwrap();
    assert_eq!(a.len(), 320);
    assert_ne!(a, b);
    assert_eq!(
        ds4::hash::sha1(&a),
        ds4::hash::sha1(&b),
        "this SHA-1 implementation detects collisions?"
    );
    let d = dir();
    let f = assemble(
        &encode_meta(ABI.as_bytes(), &default_tensors()),
        &a,
        &default_payload(),
    );
    let p = put(d.path(), &a, &f);
    let mut prompt = b.clone();
    prompt.extend_from_slice(b" and the rest of the prompt");
    let e = expect_err(
        &p,
        &VerifyOptions {
            prompt: Some(&prompt),
            ..opts()
        },
        "prefix_collision",
        "text",
        Class::Corrupt,
    );
    let first_diff = a.iter().zip(&b).position(|(x, y)| x != y).unwrap() as u64;
    assert!(
        matches!(e, Error::PrefixCollision { len: 320, at } if at == first_diff),
        "{e}"
    );
    // The honest prompt still matches.
    let mut good = a.clone();
    good.extend_from_slice(b"...");
    open_both(
        &p,
        &VerifyOptions {
            prompt: Some(&good),
            ..opts()
        },
    )
    .unwrap();
}

// ---- stage payload ----

fn table_case(tensors: &[RawTensor<'_>], payload: &[u8]) -> Vec<u8> {
    assemble(&encode_meta(ABI.as_bytes(), tensors), TEXT, payload)
}

/// The default file with a zero-byte tensor of `dtype` and `shape` first.
fn zero_byte_tensor_case(dtype: u8, shape: Vec<u64>) -> Vec<u8> {
    let mut t = default_tensors();
    t.insert(
        0,
        RawTensor {
            name: b"empty",
            dtype,
            shape,
            offset: 0,
            nbytes: 0,
        },
    );
    table_case(&t, &default_payload())
}

#[test]
fn zero_byte_tensors_open_exactly_when_an_array_can_describe_them() {
    let d = dir();
    // u8 [0, 2^63 - 1] and [0, 2^62]: numpy makes these views.
    for shape in [vec![0, u64::MAX >> 1], vec![0, 1 << 62], vec![0]] {
        let p = put(d.path(), TEXT, &zero_byte_tensor_case(0, shape.clone()));
        open_both(&p, &opts()).unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    }
    // One more byte, or a wider item, and numpy refuses: so does the table.
    for (dtype, shape) in [
        (0, vec![0, 1 << 63]),
        (9, vec![0, 1 << 61]),
        (0, vec![3, 0, 1 << 62]),
    ] {
        let p = put(d.path(), TEXT, &zero_byte_tensor_case(dtype, shape.clone()));
        let e = expect_err(&p, &opts(), "tensor_table", "payload", Class::Corrupt);
        assert!(
            matches!(&e, Error::TensorTable(m) if m.contains("beyond what an array can describe")),
            "{shape:?}: {e}"
        );
    }
}

#[test]
fn tensor_table() {
    let d = dir();
    let payload = default_payload();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();

    let mut t = default_tensors();
    t[1].offset = 32;
    cases.push(("misaligned offset", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].offset = 0;
    cases.push(("overlapping", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].offset = 128;
    let mut p2 = payload[..64].to_vec();
    p2.resize(128, 0);
    p2.extend_from_slice(b"xyz");
    cases.push(("gap", table_case(&t, &p2)));
    let mut t = default_tensors();
    t[0].nbytes = 15;
    cases.push(("size mismatch", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[0].shape = vec![1 << 62, 8];
    cases.push(("shape overflow", table_case(&t, &payload)));
    // Zero bytes, so every byte count agrees; numpy still cannot make a view.
    cases.push((
        "zero-byte shape [0, 2^63]",
        zero_byte_tensor_case(0, vec![0, 1 << 63]),
    ));
    cases.push((
        "zero-byte shape [2^62, 2, 0]",
        zero_byte_tensor_case(0, vec![1 << 62, 2, 0]),
    ));
    cases.push((
        "zero-byte f32 shape [0, 2^62]",
        zero_byte_tensor_case(9, vec![0, 1 << 62]),
    ));
    let mut t = default_tensors();
    t[1].name = b"logits";
    cases.push(("duplicate names", table_case(&t, &payload)));
    let mut t = default_tensors();
    t[1].name = b"";
    cases.push(("empty name", table_case(&t, &payload)));
    let mut p3 = payload.clone();
    p3.extend_from_slice(&[0; 5]);
    cases.push((
        "ends before payload end",
        table_case(&default_tensors(), &p3),
    ));
    cases.push(("no tensors, non-empty payload", table_case(&[], &payload)));
    cases.push((
        "ends past payload end",
        table_case(&default_tensors(), &payload[..66]),
    ));
    let mut t = default_tensors();
    t[1].shape = vec![u64::MAX - 10];
    t[1].nbytes = u64::MAX - 10;
    cases.push(("offset + nbytes overflows", table_case(&t, &payload)));

    for (what, f) in cases {
        let p = put(d.path(), TEXT, &f);
        // The header stage accepts these: the table is a payload-stage check.
        open_both(
            &p,
            &VerifyOptions {
                load_payload: false,
                ..opts()
            },
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = expect_err(&p, &opts(), "tensor_table", "payload", Class::Corrupt);
        assert!(matches!(e, Error::TensorTable(_)), "{what}: {e}");
    }
}

#[test]
fn payload_checksum() {
    let d = dir();
    let f = default_file();
    let po = payload_offset(&f);
    // A tensor byte, inter-tensor padding, the last byte.
    for at in [po, po + 15, po + 16, po + 63, f.len() - 1] {
        let mut g = f.clone();
        g[at] ^= 0x80;
        let p = put(d.path(), TEXT, &g);
        let e = expect_err(&p, &opts(), "payload_checksum", "payload", Class::Corrupt);
        assert!(matches!(e, Error::PayloadChecksum { .. }), "{at}");
        // Opt-out of the checksum: the header-stage checks still pass.
        open_both(
            &p,
            &VerifyOptions {
                verify_checksum: false,
                ..opts()
            },
        )
        .unwrap();
    }
}

#[test]
fn bad_v1_payload() {
    let d = dir();
    let good = dsv4_payload(2);
    let mut cases: Vec<(&str, Vec<u8>, u32)> = vec![
        ("short payload", good[..51].to_vec(), 2),
        ("empty payload", Vec::new(), 2),
    ];
    let mut p = good.clone();
    p[0] = b'X';
    cases.push(("bad magic", p, 2));
    let mut p = good.clone();
    set_u32(&mut p, 4, 2);
    cases.push(("version 2", p, 2));
    cases.push(("token count differs", good.clone(), 3));
    for (what, payload, tokens) in cases {
        let f = v1_file(TEXT, tokens, 0, &payload, b"");
        let p = put(d.path(), TEXT, &f);
        let e = expect_err(&p, &opts(), "bad_v1_payload", "payload", Class::Corrupt);
        assert!(matches!(e, Error::BadV1Payload(_)), "{what}: {e}");
        // Header-only open succeeds (DSV4 decoded best effort).
        let ck = open_both(
            &p,
            &VerifyOptions {
                load_payload: false,
                ..opts()
            },
        )
        .unwrap();
        assert!(ck.dsv4.is_none(), "{what}");
    }
    let f = v1_file(TEXT, 2, 0, &good, b"");
    let p = put(d.path(), TEXT, &f);
    let ck = open_both(&p, &opts()).unwrap();
    assert_eq!(ck.dsv4.unwrap()[7], 2);
    assert_eq!(ck.payload().unwrap(), &good[..]);
}

// ---- touch ----

#[test]
fn touch_updates_mutable_fields_without_breaking_the_checksum() {
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    assert_eq!(touch(&p, 1_800_000_000).unwrap(), 1);
    assert_eq!(touch(&p, 1_800_000_123).unwrap(), 2);
    let g = std::fs::read(&p).unwrap();
    assert_eq!(g.len(), f.len());
    for (i, (a, b)) in f.iter().zip(&g).enumerate() {
        if a != b {
            assert!(
                (12..16).contains(&i) || (32..40).contains(&i),
                "touch changed byte {i}"
            );
        }
    }
    let ck = open_both(&p, &opts()).unwrap();
    assert_eq!(ck.header.hits, 2);
    assert_eq!(ck.header.last_used, 1_800_000_123);
    assert_eq!(ck.header.created, CREATED);
    // v1 files are touched the same way.
    let v1 = v1_file(TEXT, 2, 0, &dsv4_payload(2), b"");
    let d2 = dir();
    let p = put(d2.path(), TEXT, &v1);
    assert_eq!(touch(&p, 5).unwrap(), 1);
    let ck = open_both(&p, &opts()).unwrap();
    assert_eq!((ck.header.hits, ck.header.last_used), (1, 5));
}

#[test]
fn touch_rejects_what_is_not_a_checkpoint() {
    let d = dir();
    let p = put(d.path(), TEXT, b"KV");
    assert_eq!(touch(&p, 1).unwrap_err().code(), "too_short");
    let p = put(d.path(), TEXT, b"KVC\x02 but only a few bytes");
    assert_eq!(touch(&p, 1).unwrap_err().code(), "too_short");
    let p = put(
        d.path(),
        TEXT,
        b"GGUF0000000000000000000000000000000000000000000000",
    );
    assert_eq!(touch(&p, 1).unwrap_err().code(), "bad_magic");
    let mut f = default_file();
    f[3] = 9;
    let p = put(d.path(), TEXT, &f);
    assert_eq!(touch(&p, 1).unwrap_err().code(), "unsupported_version");
    assert_eq!(
        std::fs::read(&p).unwrap(),
        f,
        "a refused touch must not write"
    );
}

#[test]
fn concurrent_touch_loses_no_hits() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let p = &p;
            s.spawn(move || {
                for i in 0..100u64 {
                    touch(p, 2_000_000_000 + t * 1000 + i).unwrap();
                }
            });
        }
    });
    let ck = open_both(&p, &opts()).unwrap();
    assert_eq!(ck.header.hits, 800);
    assert!(ck.header.last_used >= 2_000_000_000);
}

// ---- write_checkpoint: a failed write leaves no temp file ----
//
// The writer (rust/format/writer.rs) validates its input before it creates
// the temp file `.<name>.tmp.<pid>.<unique>`; after that, what can fail is
// I/O: a write (disk full, file size limit), the length check, fsync, the
// rename onto the final name and the directory fsync. The tests below reach
// two of these through the public API: a write that hits RLIMIT_FSIZE and a
// rename onto a directory.

fn write_meta() -> ds4::WriteMeta {
    ds4::WriteMeta {
        reason: 1,
        tokens: TOKENS,
        ctx: CTX,
        created: CREATED,
        abi: ABI.into(),
        ..Default::default()
    }
}

/// The names in `dir`, sorted.
fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Asserts that `dir` holds no writer temp file (`.<name>.tmp.<pid>.<hex>`).
#[track_caller]
fn assert_no_temp_file(dir: &std::path::Path) {
    let names = listing(dir);
    let temps: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with('.') && n.contains(".kv.tmp."))
        .collect();
    assert!(temps.is_empty(), "temp files left behind: {temps:?}");
}

#[test]
fn rejected_input_creates_no_file() {
    // The declared size does not match the data: refused before any file exists.
    let d = dir();
    let p = d.path().join(name_for(TEXT));
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: ds4::Dtype::F32,
        shape: &[4],
        data: b"too short",
    }];
    let e = ds4::write_checkpoint(&p, &write_meta(), TEXT, &t).unwrap_err();
    assert!(matches!(e, Error::TensorTable(_)), "{e:?}");
    assert_eq!(listing(d.path()), Vec::<String>::new());
}

#[test]
fn failed_rename_removes_the_temp_file() {
    // The destination is a directory: the temp file is created, written and
    // fsynced, then rename(2) fails with EISDIR. The temp file must go and
    // the directory (with its content) must stay.
    let d = dir();
    let dest = d.path().join(name_for(TEXT));
    std::fs::create_dir(&dest).unwrap();
    std::fs::write(dest.join("keep"), b"keep me").unwrap();
    let lg = logits();
    let t = [ds4::TensorSrc {
        name: "logits",
        dtype: ds4::Dtype::F32,
        shape: &[4],
        data: &lg,
    }];
    let e = ds4::write_checkpoint(&dest, &write_meta(), TEXT, &t).unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.raw_os_error() == Some(libc::EISDIR)),
        "{e:?}"
    );
    assert_eq!((e.code(), e.class()), ("io", Class::Io));
    assert_no_temp_file(d.path());
    assert_eq!(listing(d.path()), [name_for(TEXT)]);
    assert!(dest.is_dir());
    assert_eq!(std::fs::read(dest.join("keep")).unwrap(), b"keep me");
}

/// Set in the child process of `failed_write_removes_the_temp_file_and_keeps_the_old_file`.
const FSIZE_CHILD: &str = "DS4_TEST_FSIZE_CHILD_DIR";
const FSIZE_LIMIT: u64 = 4096;

#[test]
fn failed_write_removes_the_temp_file_and_keeps_the_old_file() {
    if let Some(d) = std::env::var_os(FSIZE_CHILD) {
        return fsize_child(std::path::Path::new(&d));
    }
    // A good checkpoint is already at the destination.
    let d = dir();
    let dest = d.path().join(name_for(TEXT));
    let good = default_file();
    std::fs::write(&dest, &good).unwrap();
    // RLIMIT_FSIZE is per process, so the failing write runs in a child: this
    // test binary again, running only this test.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "failed_write_removes_the_temp_file_and_keeps_the_old_file",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FSIZE_CHILD, d.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("fsize child: write failed with EFBIG"),
        "the child did not run the write: {stdout}"
    );
    // Checked again here, outside the limited process.
    assert_no_temp_file(d.path());
    assert_eq!(listing(d.path()), [name_for(TEXT)]);
    assert_eq!(std::fs::read(&dest).unwrap(), good, "the old file changed");
    open_both(&dest, &opts()).unwrap();
}

/// In the child: with a 4 KiB file size limit (and SIGXFSZ ignored, so the
/// write fails with EFBIG instead of killing the process), rewrite the
/// destination with a 64 KiB payload. The temp file exists and holds the
/// first 4 KiB when the write fails.
fn fsize_child(d: &std::path::Path) {
    let dest = d.join(name_for(TEXT));
    let good = std::fs::read(&dest).unwrap();
    assert!((good.len() as u64) < FSIZE_LIMIT);
    // SAFETY: plain libc calls with valid arguments; this process runs only
    // this test (--exact, one thread).
    unsafe {
        assert_ne!(libc::signal(libc::SIGXFSZ, libc::SIG_IGN), libc::SIG_ERR);
        let lim = libc::rlimit {
            rlim_cur: FSIZE_LIMIT,
            rlim_max: FSIZE_LIMIT,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &raw const lim), 0);
    }
    let big = vec![7u8; 64 * 1024];
    let t = [ds4::TensorSrc {
        name: "blob",
        dtype: ds4::Dtype::U8,
        shape: &[big.len() as u64],
        data: &big,
    }];
    let e = ds4::write_checkpoint(&dest, &write_meta(), TEXT, &t).unwrap_err();
    assert!(
        matches!(&e, Error::Io(io) if io.raw_os_error() == Some(libc::EFBIG)),
        "{e:?}"
    );
    assert_eq!((e.code(), e.class()), ("io", Class::Io));
    assert_no_temp_file(d);
    assert_eq!(std::fs::read(&dest).unwrap(), good);
    println!("fsize child: write failed with EFBIG");
}
