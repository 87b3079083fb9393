//! The lazy lookup's tests: the cursor yields what a lookup returns, and
//! stops at the best match.

use crate::index::tests::{entry, id};
use crate::index::*;

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
