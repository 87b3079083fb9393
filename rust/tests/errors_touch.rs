//! One test per `ds4::Error` variant that bytes on disk can produce, each from
//! constructed bytes, checking `code()`, `stage()` and `class()`, in both the
//! mmap and the pread mode, one file per stage: `errors_open.rs`,
//! `errors_header.rs`, `errors_text.rs`, `errors_payload.rs`. Plus `touch`
//! (`errors_touch.rs`) and failed writes (`errors_write.rs`).
//!
//! Here: `touch` (mutable fields outside the checksum, no lost updates).

mod common;

use common::*;
use ds4::touch;

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
