//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: the text stage (the text's hash, the name, the prompt, a real
//! SHA-1 collision).

mod common;

use common::*;
use ds4::{open, Class, Error, VerifyOptions};

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
