//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: the independent encoder against the writer, and the open stage.

mod common;

use common::*;
use ds4::{touch, Class, Error, VerifyOptions, WriteOptions};

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
    ds4::write_checkpoint(&p, &meta, TEXT, &t, &WriteOptions::default()).unwrap();
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
