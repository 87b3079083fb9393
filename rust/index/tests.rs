//! The index's unit tests: entries, lookup and the index file together.

use super::*;
use crate::hash;
use crate::name::FileId;
use std::collections::HashSet;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// The id of a text's file in the form every release before the
/// per-model names wrote (`<sha1>.kv`).
fn id(text: &[u8]) -> FileId {
    FileId {
        digest: hash::sha1(text),
        model: None,
    }
}

/// `e` under its per-model name (`<sha1>-<tag of its ABI>.kv`).
fn tagged(mut e: Entry) -> Entry {
    e.model = Some(crate::name::model_tag(&e.abi));
    e
}

fn entry(text: &[u8], tokens: u32, abi: &str) -> Entry {
    Entry {
        digest: hash::sha1(text),
        model: None,
        version: 2,
        quant_bits: 0,
        reason: 1,
        tokens,
        hits: 0,
        ctx: 4096,
        text_bytes: u32::try_from(text.len()).unwrap(),
        created: 1,
        last_used: 2,
        abi: Arc::from(abi),
        namespace: namespace_of(text).map(Arc::from),
        tail: tail_of(text, text.len()),
        key: StatKey {
            ino: 7,
            size: 100 + text.len() as u64,
            mtime_ns: 9,
        },
        case: 0,
        blocks: None,
    }
}

#[test]
fn namespace_usage_sums_each_namespace() {
    let mut idx = Index::new();
    assert!(idx.namespace_usage().is_empty());
    let texts: [&[u8]; 5] = [
        b"plain one",
        b"plain two!",
        b"\xff\x00ns:alice\xff\x00hello",
        b"\xff\x00ns:alice\xff\x00bye",
        b"\xff\x00ns:alice/salt-1\xff\x00hi",
    ];
    for text in texts {
        idx.insert(entry(text, 10, "a"));
    }
    let size = |i: usize| 100 + texts[i].len() as u64;
    let got = idx.namespace_usage();
    assert_eq!(
        got,
        vec![
            (None, size(0) + size(1), 2),
            (Some(Arc::from("alice")), size(2) + size(3), 2),
            (Some(Arc::from("alice/salt-1")), size(4), 1),
        ]
    );
    assert_eq!(got.iter().map(|u| u.1).sum::<u64>(), idx.total_bytes());
}

#[test]
fn tails() {
    assert_eq!(tail_of(b"", 0), 0);
    assert_eq!(tail_of(b"ab", 2), u64::from_le_bytes(*b"ab\0\0\0\0\0\0"));
    assert_eq!(tail_of(b"0123456789", 10), u64::from_le_bytes(*b"23456789"));
    assert_eq!(tail_of(b"0123456789", 9), u64::from_le_bytes(*b"12345678"));
}

#[test]
fn lookup_longest_first_with_filters() {
    let p: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
    let mut idx = Index::new();
    for (n, tok, abi) in [
        (5, 10, "a"),
        (100, 10, "a"),
        (400, 3, "a"),
        (500, 10, "b"),
        (1000, 10, "a"),
    ] {
        idx.insert(entry(&p[..n], tok, abi));
    }
    idx.insert(entry(b"another text entirely", 10, "a"));
    let mut other = p[..700].to_vec();
    other[0] ^= 1; // same tail, another text: hashed, not a hit
    idx.insert(entry(&other, 10, "a"));
    let q = Query {
        min_tokens: 5,
        abi: Some("a"),
        ctx: None,
    };
    let got: Vec<u32> = idx.lookup(&p, &q).iter().map(|e| e.text_bytes).collect();
    assert_eq!(got, [1000, 100, 5]);
    let got: Vec<u32> = idx
        .lookup(&p[..999], &Query::default())
        .iter()
        .map(|e| e.text_bytes)
        .collect();
    assert_eq!(got, [500, 400, 100, 5]);
    idx.remove(&id(&p[..100]));
    let q = Query {
        ctx: Some(11),
        ..Query::default()
    };
    let got: Vec<u32> = idx.lookup(&p, &q).iter().map(|e| e.text_bytes).collect();
    assert_eq!(got, [1000, 500, 400, 5]);
}

#[test]
fn namespaces_of_key_texts() {
    assert_eq!(namespace_of(b"plain text"), None);
    assert_eq!(
        namespace_of(b"\xff\x00ns:alice\xff\x00hello"),
        Some("alice")
    );
    assert_eq!(
        namespace_of(b"\xff\x00ns:alice/salt-0123\xff\x00"),
        Some("alice/salt-0123")
    );
    // not whole, empty, a space, too long: not a preamble
    assert_eq!(namespace_of(b"\xff\x00ns:alice"), None);
    assert_eq!(namespace_of(b"\xff\x00ns:\xff\x00x"), None);
    assert_eq!(namespace_of(b"\xff\x00ns:a b\xff\x00x"), None);
    let mut long = b"\xff\x00ns:".to_vec();
    long.extend_from_slice(&[b'a'; NS_ID_MAX]);
    long.extend_from_slice(b"\xff\x00");
    assert_eq!(long.len(), NS_READ);
    assert_eq!(namespace_of(&long).map(str::len), Some(NS_ID_MAX));
    long.insert(5, b'a');
    assert_eq!(namespace_of(&long), None);
}

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

fn drain(idx: &mut Index, p: &[u8], q: &Query<'_>) -> Vec<Entry> {
    let mut cur = idx.prefixes(p.len(), q);
    std::iter::from_fn(|| idx.next_prefix(&mut cur, p)).collect()
}

#[test]
fn prefixes_yield_what_lookup_returns_in_its_order() {
    // lengths around the snapshot stride, equal lengths, tail collisions
    // (another text with the prompt's tail), filters
    let p: Vec<u8> = (0..3 * SNAPSHOT_STRIDE + 77)
        .map(|i| u8::try_from((i.wrapping_mul(2_654_435_761) >> 13) % 251).unwrap())
        .collect();
    let mut idx = Index::new();
    let s = SNAPSHOT_STRIDE;
    for (i, n) in [
        0,
        1,
        7,
        8,
        9,
        63,
        64,
        65,
        s - 1,
        s,
        s + 1,
        2 * s,
        2 * s + 5,
        3 * s,
        p.len(),
    ]
    .into_iter()
    .enumerate()
    {
        let tokens = u32::try_from(i).unwrap() + 1;
        idx.insert(entry(&p[..n], tokens, if i % 3 == 0 { "b" } else { "a" }));
        let mut other = p[..n].to_vec();
        if let Some(b) = other.first_mut() {
            *b ^= 0x55; // the same tail and length, another text
            idx.insert(entry(&other, tokens + 100, "a"));
        }
    }
    let mut v1 = entry(&p[..s + 3], 4, "x");
    v1.version = crate::format::VERSION_V1;
    idx.insert(v1);
    for q in [
        Query::default(),
        Query {
            min_tokens: 5,
            abi: Some("a"),
            ctx: Some(14),
        },
        Query {
            abi: Some("none such"),
            ..Query::default()
        },
    ] {
        for cut in [p.len(), p.len() - 1, 2 * s + 4, s, 9, 0] {
            let want = idx.lookup(&p[..cut], &q);
            assert_eq!(drain(&mut idx, &p[..cut], &q), want, "cut {cut} {q:?}");
        }
    }
    assert!(!idx.lookup(&p, &Query::default()).is_empty());
}

#[test]
fn prefixes_stop_at_the_best_match() {
    let p: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 31 % 253) as u8).collect();
    let mut idx = Index::new();
    for n in (1..=1000).map(|i| i * 60) {
        idx.insert(entry(&p[..n], 10, "a"));
    }
    idx.insert(entry(b"not a prefix", 10, "a"));
    let q = Query::default();
    let mut cur = idx.prefixes(p.len(), &q);
    let first = idx.next_prefix(&mut cur, &p).unwrap();
    assert_eq!(first.text_bytes, 60_000);
    // one row visited, the prompt hashed up to the first candidate only
    assert_eq!(cur.remaining(), idx.len() - 1);
    assert!(cur.hashed() <= 60_000 && cur.hashed() + SNAPSHOT_STRIDE > 60_000);
    let second = idx.next_prefix(&mut cur, &p).unwrap();
    assert_eq!(second.text_bytes, 59_940);
    assert_eq!(cur.remaining(), idx.len() - 2);
    // the index changing under the cursor: a removed entry is skipped
    idx.remove(&id(&p[..59_880]));
    assert_eq!(idx.next_prefix(&mut cur, &p).unwrap().text_bytes, 59_820);
}

#[test]
fn longest_considered_by_namespace_and_filters() {
    let mut idx = Index::new();
    let texts: [(&[u8], u32); 6] = [
        (b"\xff\x00ns:al\xff\x00 short", 5),
        (b"\xff\x00ns:al\xff\x00 a longer one", 5),
        (b"\xff\x00ns:al\xff\x00 a longer two", 9),
        (b"\xff\x00ns:al\xff\x00 longest of all texts here", 50),
        (b"\xff\x00ns:bo\xff\x00 another namespace's, long", 5),
        (b"plain default namespace text", 5),
    ];
    for (t, tok) in texts {
        idx.insert(entry(t, tok, "a"));
    }
    let none = HashSet::new();
    let q = Query::default();
    let len = |e: Option<Entry>| e.map(|e| e.text_bytes as usize);
    assert_eq!(
        len(idx.longest(1000, Some("al"), &q, &none)),
        Some(texts[3].0.len())
    );
    let q40 = Query {
        ctx: Some(40),
        ..Query::default()
    };
    // ties of length: most tokens
    assert_eq!(
        idx.longest(1000, Some("al"), &q40, &none).map(|e| e.tokens),
        Some(9)
    );
    assert_eq!(
        len(idx.longest(texts[1].0.len() - 1, Some("al"), &q, &none)),
        Some(texts[0].0.len())
    );
    assert_eq!(
        len(idx.longest(1000, None, &q, &none)),
        Some(texts[5].0.len())
    );
    assert!(idx.longest(1000, Some("nobody"), &q, &none).is_none());
    let mut ex = HashSet::new();
    ex.insert(name_of(&id(texts[3].0), 0));
    ex.insert(name_of(&id(texts[2].0), 0));
    assert_eq!(
        idx.longest(1000, Some("al"), &q, &ex).map(|e| e.tokens),
        Some(5)
    );
    let q6 = Query {
        min_tokens: 6,
        ..Query::default()
    };
    assert_eq!(
        idx.longest(1000, Some("al"), &q6, &ex).map(|e| e.tokens),
        None
    );
}

#[test]
fn one_text_two_models_two_entries_the_query_picks_its_own() {
    // two models whose key texts are the same bytes: one file each
    let mut idx = Index::new();
    let text = b"the same rendered text for both models";
    let (a, b) = (
        tagged(entry(text, 8, "model/a")),
        tagged(entry(text, 8, "model/b")),
    );
    let old = entry(text, 8, "model/a"); // today's release's name for model a
    for e in [&a, &b, &old] {
        idx.insert(e.clone());
    }
    assert_eq!(idx.len(), 3);
    assert_ne!(a.name(), b.name());
    assert!(a.name().starts_with(&hash::to_hex(&a.digest)) && a.name().len() == 60);
    let mut prompt = text.to_vec();
    prompt.extend_from_slice(b" and a suffix");
    for (abi, want) in [
        ("model/a", vec![a.name(), old.name()]),
        ("model/b", vec![b.name()]),
    ] {
        let q = Query {
            abi: Some(abi),
            ..Query::default()
        };
        let mut got: Vec<String> = idx.lookup(&prompt, &q).iter().map(Entry::name).collect();
        got.sort();
        let mut want = want;
        want.sort();
        assert_eq!(got, want, "{abi}");
        let mut cur = idx.prefixes(prompt.len(), &q);
        let mut lazy = Vec::new();
        while let Some(e) = idx.next_prefix(&mut cur, &prompt) {
            lazy.push(e.name());
        }
        lazy.sort();
        assert_eq!(lazy, want, "{abi}");
    }
    // each model's bytes, files and hits
    let usage = idx.abi_usage();
    assert_eq!(usage.len(), 2);
    assert_eq!((&*usage[0].0, usage[0].2), ("model/a", 2));
    assert_eq!((&*usage[1].0, usage[1].2), ("model/b", 1));
    assert_eq!(usage[0].1, a.key.size + old.key.size);
    // removing one model's file leaves the other's
    assert!(idx.remove(&a.id()));
    assert!(idx.get(&b.id()).is_some() && idx.get(&old.id()).is_some());
    // the index file keeps them apart
    let (back, _) = decode(&encode(&idx, &DirStamp::default())).unwrap();
    assert_eq!(back.get(&b.id()), Some(&b));
    assert_eq!(back.get(&old.id()), Some(&old));
    assert_eq!(back.len(), 2);
}

/// A checkpoint of `text` under `abi` written into `dir`, and its entry
/// as a header read gives it.
fn written(dir: &std::path::Path, text: &[u8], abi: &str) -> Entry {
    let meta = crate::format::writer::WriteMeta {
        reason: 1,
        tokens: 7,
        ctx: 4096,
        created: 5,
        abi: abi.into(),
        ..Default::default()
    };
    let t = [crate::format::writer::TensorSrc {
        name: "kv",
        dtype: crate::format::Dtype::U8,
        shape: &[3],
        data: b"xyz",
    }];
    let p = dir.join(id(text).name(0));
    crate::format::writer::write_checkpoint(&p, &meta, text, &t).unwrap();
    read_entry(&p).unwrap()
}

#[test]
fn an_index_record_is_checked_against_its_file() {
    let d = tempfile::tempdir().unwrap();
    let alice = written(
        d.path(),
        b"\xff\x00ns:alice\xff\x00alice's conversation",
        "x/1",
    );
    let bob = written(d.path(), b"\xff\x00ns:bob/salt-00ff\xff\x00bob's", "x/1");
    let plain = written(d.path(), b"no preamble at all", "x/1");
    // a long ABI: the ABI and the text's start lie beyond the first read
    let far = written(
        d.path(),
        b"\xff\x00ns:carol\xff\x00far text",
        &"y".repeat(4000),
    );
    let mut idx = Index::new();
    for e in [&alice, &bob, &plain, &far] {
        idx.insert(e.clone());
    }
    assert_eq!(idx.check_files(d.path(), 2), []); // honest: nothing to re-read
                                                  // forged records, their stat keys intact (what a rewritten index file says)
    let swap = |mut e: Entry, ns: Option<&str>| {
        e.namespace = ns.map(Arc::from);
        e
    };
    let mut forged = Index::new();
    forged.insert(swap(alice.clone(), Some("bob")));
    forged.insert(swap(bob.clone(), None));
    forged.insert(swap(plain.clone(), Some("alice")));
    forged.insert(swap(far.clone(), Some("bob")));
    let mut got = forged.check_files(d.path(), 1);
    got.sort();
    let mut want: Vec<(String, Disagreement)> = [&alice, &bob, &plain, &far]
        .iter()
        .map(|e| (e.name(), Disagreement::Namespace))
        .collect();
    want.sort();
    assert_eq!(got, want);
    // every other fact the open compares
    let base = alice.clone();
    let cases: Vec<(Entry, Disagreement)> = vec![
        (
            Entry {
                tokens: 8,
                ..base.clone()
            },
            Disagreement::Header,
        ),
        (
            Entry {
                last_used: 9,
                ..base.clone()
            },
            Disagreement::Header,
        ),
        (
            Entry {
                text_bytes: base.text_bytes - 1,
                ..base.clone()
            },
            Disagreement::Header,
        ),
        (
            Entry {
                abi: Arc::from("x/2"),
                ..base.clone()
            },
            Disagreement::Header,
        ),
        (
            Entry {
                key: StatKey {
                    size: 1 << 30,
                    ..base.key
                },
                ..base.clone()
            },
            Disagreement::Changed,
        ),
    ];
    for (e, how) in cases {
        assert_eq!(
            check_entry(&d.path().join(e.name()), &e),
            Some(how),
            "{e:?}"
        );
    }
    let far_abi = Entry {
        abi: Arc::from("y".repeat(3999).as_str()),
        ..far.clone()
    };
    assert_eq!(
        check_entry(&d.path().join(far.name()), &far_abi),
        Some(Disagreement::Header)
    );
}

#[test]
fn a_kept_record_of_an_indexable_file_and_a_symlink_disagree() {
    let d = tempfile::tempdir().unwrap();
    let plain = written(d.path(), b"no preamble at all", "x/1");
    let bob = written(d.path(), b"\xff\x00ns:bob\xff\x00bob's", "x/1");
    let mut kept = Index::new();
    kept.keep(plain.id(), plain.key, 0);
    assert_eq!(
        kept.check_files(d.path(), 1),
        [(plain.name(), Disagreement::Kept)]
    );
    let link = d.path().join(bob.name());
    std::fs::rename(&link, d.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(d.path().join("moved"), &link).unwrap();
    assert_eq!(check_entry(&link, &bob), Some(Disagreement::Unreadable));
}

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
