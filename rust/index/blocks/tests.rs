//! The index file's block section: which blocks each manifest names.

use crate::index::tests::{entry, id};
use crate::index::*;
use xxhash_rust::xxh3::xxh3_64;

/// The bytes of an index file with its checksum recomputed (a forgery).
fn resum(mut b: Vec<u8>) -> Vec<u8> {
    let n = b.len() - 8;
    let sum = xxh3_64(&b[..n]);
    b[n..].copy_from_slice(&sum.to_le_bytes());
    b
}

#[test]
fn block_lists_are_kept_per_version_and_persisted() {
    let mut idx = Index::new();
    let (a, b, c) = (
        entry(b"manifest a", 3, "x/1"),
        entry(b"manifest b", 4, "x/1"),
        entry(b"single", 2, "x/1"),
    );
    for e in [&a, &b, &c] {
        idx.insert(e.clone());
    }
    let shared = [[1u8; 32], [2u8; 32]];
    let other = StatKey { ino: 99, ..a.key };
    // only for the version indexed
    assert!(!idx.set_blocks(&a.id(), other, &shared));
    assert_eq!(idx.blocks_of(&a.id()), None);
    assert!(idx.set_blocks(&a.id(), a.key, &shared));
    assert!(
        !idx.set_blocks(&a.id(), a.key, &shared),
        "the same blocks again: no change"
    );
    assert!(idx.set_blocks(&b.id(), b.key, &[[1u8; 32], [2u8; 32], [3u8; 32]]));
    assert!(idx.set_blocks(&c.id(), c.key, &[]));
    assert!(!idx.set_blocks(&id(b"not indexed"), c.key, &[]));
    // a hit's header update keeps them; the file read again drops them
    assert!(idx.set_hit(
        &b.id(),
        1,
        5,
        StatKey {
            mtime_ns: 10,
            ..b.key
        }
    ));
    assert_eq!(idx.blocks_of(&b.id()).unwrap().len(), 3);
    let bytes = encode(&idx, &DirStamp::default());
    let (back, _) = decode(&bytes).unwrap();
    assert_eq!(back.blocks_of(&a.id()).as_deref(), Some(&shared[..]));
    assert_eq!(back.blocks_of(&b.id()).unwrap()[2], [3u8; 32]);
    assert_eq!(back.blocks_of(&c.id()).as_deref(), Some(&[][..]));
    for e in idx.entries() {
        assert_eq!(back.get(&e.id()), Some(e));
    }
    idx.insert(a.clone());
    assert_eq!(
        idx.blocks_of(&a.id()),
        None,
        "a new header read has no blocks"
    );
    idx.keep(b.id(), b.key, 0);
    assert!(idx.remove(&b.id()));
    idx.insert(b.clone());
    assert_eq!(idx.blocks_of(&b.id()), None);
    // every flip and tear of the block section is refused
    for i in 0..bytes.len() {
        assert!(decode(&bytes[..i]).is_err(), "torn at {i}");
        let mut f = bytes.clone();
        f[i] ^= 0x10;
        assert!(decode(&f).is_err(), "flip at {i}");
    }
}

#[test]
fn a_forged_block_section_is_refused() {
    let mut idx = Index::new();
    let a = entry(b"manifest a", 3, "x/1");
    idx.insert(a.clone());
    idx.insert(entry(b"a record without a list", 3, "x/1"));
    idx.set_blocks(&a.id(), a.key, &[[7u8; 32]]);
    let good = encode(&idx, &DirStamp::default());
    // the section: u32 names (1), 32 bytes, u32 lists (1), u32 record, u32 length, u32 name index
    let sec = good.len() - 8 - (4 + 32 + 4 + 12);
    let at = |off: usize, v: u32| {
        let mut b = good.clone();
        b[sec + off..sec + off + 4].copy_from_slice(&v.to_le_bytes());
        resum(b)
    };
    assert!(decode(&resum(good.clone())).is_ok());
    for (off, v, why) in [
        (0, u32::MAX, "block count"),
        (36, 3, "more lists than records"),
        (40, 2, "a record out of bounds"),
        (44, u32::MAX, "a list longer than the file"),
        (48, 1, "a name index out of bounds"),
    ] {
        assert!(decode(&at(off, v)).is_err(), "{why}");
    }
    // one record's list twice
    let mut twice = good[..good.len() - 8].to_vec();
    let n = twice.len();
    twice[n - 12 - 4..n - 12].copy_from_slice(&2u32.to_le_bytes());
    twice.extend_from_slice(&good[sec + 40..sec + 52]);
    twice.extend_from_slice(&[0; 8]);
    assert!(decode(&resum(twice)).is_err());
}
