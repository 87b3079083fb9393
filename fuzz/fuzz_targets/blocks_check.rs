//! The checks of the `blocks` fuzz target. Arbitrary bytes as a block
//! file's header, as a block table, and as a block file on disk (named
//! after the name its header bytes would hold): nothing may panic, a header
//! that parses satisfies the format's invariants and is what the encoder
//! writes, a table that decodes encodes back to the same bytes, and the
//! header-only read and the full check of the file agree.
#![allow(
    clippy::cast_possible_truncation,
    reason = "fuzz inputs are small: lengths fit usize"
)]

use ds4::blocks::{read_block_header, verify_block};
use ds4::format::block::{self, BLOCK_HEADER, MAX_BLOCK_PAYLOAD};
use ds4::format::block_table::{Table, TABLE_HEAD, TABLE_RECORD};
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| crate::scratch::dir("blocks"))
}

fn raw_parsers(data: &[u8]) {
    let len = data.len() as u64;
    if let Ok(h) = block::parse_header(data, len, "") {
        assert_eq!(h.file_len(), len);
        assert!(h.n_tokens > 0 && h.payload_len <= MAX_BLOCK_PAYLOAD);
        let again = block::encode_header(
            &h.name,
            h.n_tokens,
            &h.abi_tag,
            h.payload_len,
            h.checksum,
            h.authenticated,
        );
        assert_eq!(again[..], data[..BLOCK_HEADER]);
    }
    if let Ok(t) = Table::decode(data) {
        assert_eq!(data.len(), TABLE_HEAD + TABLE_RECORD * t.records.len());
        assert!(t.block_tokens > 0);
        assert_eq!(t.encode().unwrap(), data);
    }
}

fn file(data: &[u8]) {
    let name: [u8; 32] = data
        .get(8..40)
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; 32]);
    let p = scratch().join(block::file_name(&name));
    std::fs::write(&p, data).unwrap();
    let head = read_block_header(&p);
    let full = verify_block(&p, None, None);
    match (&head, &full) {
        (Ok(h), Ok(v)) => {
            assert_eq!(h, v);
            if !h.authenticated {
                let e = verify_block(&p, None, Some(&[0; 32])).unwrap_err();
                assert_eq!(e.code(), "block_mac_missing");
            }
        }
        // the name is the header's: only the payload can fail past the header
        (Ok(_), Err(e)) => assert_eq!(e.code(), "block_checksum", "{e}"),
        (Err(a), Err(b)) => assert_eq!(a.code(), b.code()),
        (Err(a), Ok(_)) => panic!("the header fails alone ({a}) but the full check passes"),
    }
    if let Err(e) = &full {
        assert_eq!((e.stage(), e.class()), ("block", ds4::Class::Corrupt));
    }
    std::fs::remove_file(&p).unwrap();
}

pub fn check(data: &[u8]) {
    raw_parsers(data);
    file(data);
}
