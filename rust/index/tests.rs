//! The index's unit tests of entries, namespaces and the lookup, and the
//! helpers its modules' own tests share (`check`, `file`, `prefixes` and
//! `blocks` keep theirs in `<module>/tests.rs`).

use super::*;
use crate::hash;
use crate::name::FileId;
use std::collections::HashSet;
use std::sync::Arc;

/// The id of a text's file in the form every release before the
/// per-model names wrote (`<sha1>.kv`).
pub(super) fn id(text: &[u8]) -> FileId {
    FileId {
        digest: hash::sha1(text),
        model: None,
    }
}

/// `e` under its per-model name (`<sha1>-<tag of its ABI>.kv`).
pub(super) fn tagged(mut e: Entry) -> Entry {
    e.model = Some(crate::name::model_tag(&e.abi));
    e
}

/// An entry of `text` as a header read would give it (a made-up stat key).
pub(super) fn entry(text: &[u8], tokens: u32, abi: &str) -> Entry {
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
