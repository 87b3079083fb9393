//! Each index record checked against its file at open.

use crate::index::tests::id;
use crate::index::*;
use std::sync::Arc;

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
    crate::format::writer::write_checkpoint(
        &p,
        &meta,
        text,
        &t,
        &crate::format::writer::WriteOptions::default(),
    )
    .unwrap();
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
