//! The index file's tests: encode and decode, save and load, a listing.

use crate::index::tests::{entry, id, tagged};
use crate::index::*;
use xxhash_rust::xxh3::xxh3_64;

#[test]
fn encode_decode_roundtrip_and_every_flip_detected() {
    let mut idx = Index::new();
    idx.insert(entry(b"one text", 3, "x/1"));
    idx.insert(entry(b"two texts here", 4, "y/2"));
    idx.insert(entry(b"\xff\x00ns:t1\xff\x00a text", 4, "y/2"));
    idx.insert(entry(b"\xff\x00ns:t1\xff\x00another", 4, "y/2"));
    idx.insert(entry(b"\xff\x00ns:t2/salt-1\xff\x00x", 4, "y/2"));
    idx.keep(id(b"kept"), StatKey::default(), 1 << 39);
    idx.keep(tagged(entry(b"kept", 1, "k/1")).id(), StatKey::default(), 0);
    idx.insert(tagged(entry(b"one text", 3, "z/1")));
    let stamp = DirStamp {
        dev: 1,
        ino: 2,
        mtime_ns: 3,
        scanned_ns: 4,
    };
    let b = encode(&idx, &stamp);
    let (back, st) = decode(&b).unwrap();
    assert_eq!(st, stamp);
    assert_eq!(back.len(), 6);
    assert_eq!(back.namespaces.len(), 2);
    assert_eq!(back.kept.len(), 2);
    for e in idx.entries() {
        assert_eq!(back.get(&e.id()), Some(e));
    }
    for i in 0..b.len() {
        assert!(decode(&b[..i]).is_err(), "torn at {i}");
        let mut c = b.clone();
        c[i] ^= 0x40;
        assert!(decode(&c).is_err(), "flip at {i}");
    }
    // a file of the previous version (checksummed as such) is refused:
    // the store rebuilds it from the headers
    let mut old = b[..b.len() - 8].to_vec();
    old[8..12].copy_from_slice(&2u32.to_le_bytes());
    let sum = xxh3_64(&old);
    old.extend_from_slice(&sum.to_le_bytes());
    assert!(decode(&old).is_err());
}

#[test]
fn save_load_listing_and_file_policy() {
    let d = tempfile::tempdir().unwrap();
    let (path, tmp) = (d.path().join(".ds4.index"), d.path().join(".ds4.index.tmp"));
    let mut idx = Index::new();
    let a = entry(b"first text", 3, "x/1");
    let b = entry(b"second text", 4, "x/1");
    idx.insert(a.clone());
    idx.insert(b.clone());
    save(&idx, &DirStamp::default(), &path, &tmp).unwrap();
    assert!(!tmp.exists());
    let (mut back, _) = load(&path).unwrap();
    assert_eq!(back.len(), 2);
    // a listing: `a` is on disk (another inode than indexed), `b` is gone
    let name_a = a.name();
    std::fs::write(d.path().join(&name_a), b"x").unwrap();
    let l = back.sync_listing(d.path()).unwrap();
    assert_eq!(l.changed, [name_a]);
    assert_eq!(l.gone, 1);
    let mut others = l.others;
    others.sort();
    assert_eq!(others, [".ds4.index"]);
    assert!(back.get(&b.id()).is_none() && back.get(&a.id()).is_some());
    // never written through a symlinked temp file, never over a non-file
    std::os::unix::fs::symlink(d.path().join("elsewhere"), &tmp).unwrap();
    assert!(save(&idx, &DirStamp::default(), &path, &tmp).is_err());
    assert!(!d.path().join("elsewhere").exists());
    std::fs::remove_file(&tmp).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    assert!(save(&idx, &DirStamp::default(), &path, &tmp).is_err());
    assert!(path.is_dir() && !tmp.exists());
    assert!(load(&path).is_err());
}
