//! The checks of the `parse` fuzz target. Arbitrary bytes through every
//! reader entry point: the raw parsers on the
//! bytes themselves, then the whole pipeline (`ds4::open`) on a file holding
//! them, in mmap and pread mode. Nothing may panic, both modes must agree, a
//! file that opens must satisfy the format's invariants, and `touch` must
//! never turn a good file bad.
#![allow(
    clippy::cast_possible_truncation,
    reason = "fuzz inputs are small: lengths fit usize and u32"
)]

use ds4::format::{self, v1, v2};
use ds4::{open, touch, VerifyOptions};
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::scratch::dir("parse"))
}

fn raw_parsers(data: &[u8]) {
    let len = data.len() as u64;
    let head = &data[..data.len().min(format::V2_FIXED)];
    let _ = v2::sniff(head, len);
    if let Ok(h) = v1::parse_v1(head, len) {
        assert_eq!(h.version, 1);
        assert!(h.payload_offset + h.payload_bytes + h.trailer_bytes == len);
    }
    if let Ok(m) = v2::v2_meta_len(head, len) {
        let meta = &data[96..96 + m as usize];
        if let Ok(h) = v2::parse_v2(head, meta, len) {
            assert_eq!(h.total_len, len);
            assert_eq!(h.payload_offset % format::ALIGN, 0);
            assert_eq!(h.payload_offset + h.payload_bytes, len);
            assert_eq!(h.header_checksum, v2::header_checksum(head, meta));
            // v3: the tensors lie in the raw (decompressed) payload
            if v2::check_tensor_table(&h.tensors, h.raw_payload_bytes).is_ok() {
                for t in &h.tensors {
                    assert_eq!(t.offset % format::ALIGN, 0);
                    assert!(t.offset + t.nbytes <= h.raw_payload_bytes);
                }
            }
        }
    }
    if let Ok((abi, tensors)) = v2::decode_meta(data) {
        assert!(abi.len() <= format::MAX_ABI && tensors.len() <= format::MAX_TENSORS);
        let _ = v2::check_tensor_table(&tensors, len);
    }
    let _ = v1::decode_dsv4(data, data.len() as u32);
    let _ = v2::payload_checksum(data);
}

fn pipeline(data: &[u8]) {
    let p = scratch().join("input.kv");
    std::fs::write(&p, data).unwrap();
    let o = VerifyOptions {
        check_name: false,
        ..Default::default()
    };
    let a = open(
        &p,
        &VerifyOptions {
            mmap: true,
            ..o.clone()
        },
    );
    let b = open(
        &p,
        &VerifyOptions {
            mmap: false,
            ..o.clone()
        },
    );
    match (&a, &b) {
        (Ok(x), Ok(y)) => {
            assert_eq!(x.payload(), y.payload());
            assert_eq!(x.text, y.text);
            let h = &x.header;
            assert_eq!(x.file_len, data.len() as u64);
            assert_eq!(x.text.len() as u64, u64::from(h.text_bytes));
            assert_eq!(x.payload().unwrap().len() as u64, h.raw_payload_bytes);
            if h.version >= 2 {
                let pl = x.payload().unwrap();
                assert!(pl.is_empty() || (pl.as_ptr() as usize) % 64 == 0);
                assert_eq!(h.text_sha1, Some(ds4::hash::sha1(&x.text)));
            } else {
                assert!(x.dsv4.is_some());
            }
        }
        (Err(x), Err(y)) => {
            assert_eq!(x.code(), y.code());
            assert_eq!(x.to_string(), y.to_string());
            let _ = (x.stage(), x.class());
        }
        _ => panic!(
            "mmap and pread disagree: {:?} vs {:?}",
            a.as_ref().err(),
            b.as_ref().err()
        ),
    }
    // Header-only open agrees with the full open up to the payload stage.
    let c = open(
        &p,
        &VerifyOptions {
            load_payload: false,
            ..o.clone()
        },
    );
    if a.is_ok() {
        assert!(c.is_ok());
    }
    if let Err(e) = &c {
        assert_eq!(Some(e.code()), a.as_ref().err().map(ds4::Error::code));
    }
    // touch only changes the mutable fields: a good file stays good.
    if let Ok(before) = a {
        before.release(); // a load gives its lease back; touch writes in place
        let hits = touch(&p, 12345).unwrap();
        let after = open(&p, &o).expect("touch broke a good file");
        assert_eq!(after.header.hits, hits);
        assert_eq!(after.header.last_used, 12345);
        assert_eq!(after.text, before.text);
        assert_eq!(after.payload(), before.payload());
    }
}

/// One input through every check of the target: what the fuzzer runs, and
/// what `cargo test` replays for every seed and crash input
/// (`rust/tests/fuzz_corpus.rs`).
pub fn check(data: &[u8]) {
    raw_parsers(data);
    pipeline(data);
}
