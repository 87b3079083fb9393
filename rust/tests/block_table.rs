//! KV block names and a manifest's block table (docs/FORMAT.md §7): the
//! chain (any earlier token changes every later name; the namespace and the
//! ABI change the root), the table's encoding and every malformed table,
//! and §7.5's test vectors read from the document itself. The names are
//! recomputed with the `blake3` crate directly and the checksums with an
//! XXH3 independent of the crate's (`twox-hash`), so the document is
//! checked against the construction, not against the code's own functions.

use ds4::blocks::write_block;
use ds4::format::block::{self, BlockName};
use ds4::format::block_table::{Record, Table, MAX_TABLE_BLOCKS};
use ds4::{Class, Error};
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::Path;

const ABI: &str = "test-abi";

fn bt(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

fn names(ns: &[u8], tokens: &[u32], size: u32) -> Vec<BlockName> {
    let root = block::root(ABI, ns).unwrap();
    block::names(&root, tokens, bt(size), ABI).unwrap()
}

#[test]
fn changing_a_token_changes_its_blocks_name_and_every_later_one() {
    let tokens: Vec<u32> = (100..140).collect();
    let base = names(b"", &tokens, 8);
    assert_eq!(base.len(), 5);
    for k in [0usize, 7, 8, 20, 39] {
        let mut t = tokens.clone();
        t[k] += 1;
        let other = names(b"", &t, 8);
        let first = k / 8;
        assert_eq!(
            other[..first],
            base[..first],
            "token {k}: earlier blocks keep their names"
        );
        for i in first..5 {
            assert_ne!(other[i], base[i], "token {k}: block {i} must change");
        }
    }
    // only full blocks are named; the tail does not change them
    assert_eq!(names(b"", &tokens[..39], 8), base[..4]);
    assert_eq!(names(b"", &tokens[..7], 8), Vec::<BlockName>::new());
    // the chain: block i's parent is block i-1's name
    let root = block::root(ABI, b"").unwrap();
    assert_eq!(base[0], block::name(&root, &tokens[..8], ABI).unwrap());
    assert_eq!(
        base[3],
        block::name(&base[2], &tokens[24..32], ABI).unwrap()
    );
}

#[test]
fn the_namespace_and_the_abi_change_the_root_and_every_name() {
    let tokens: Vec<u32> = (0..16).collect();
    let a = names(b"", &tokens, 4);
    let b = names(b"\xff\x00ns:alice\xff\x00", &tokens, 4);
    assert_ne!(
        block::root(ABI, b"").unwrap(),
        block::root(ABI, b"x").unwrap()
    );
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    assert_ne!(
        block::root(ABI, b"").unwrap(),
        block::root("test-abj", b"").unwrap()
    );
    // the ABI's length is framed: ("ab", "c") and ("a", "bc") differ
    assert_ne!(
        block::root("ab", b"c").unwrap(),
        block::root("a", b"bc").unwrap()
    );
    let big = "x".repeat(ds4::format::MAX_ABI + 1);
    assert!(block::root(&big, b"").is_err());
}

fn sample(n: usize) -> Table {
    Table {
        block_tokens: 16,
        records: (0..n)
            .map(|i| Record {
                name: [u8::try_from(i % 256).unwrap(); 32],
                n_tokens: 16,
                payload_len: 1000 + i as u64,
                checksum: 0x0123_4567_89ab_cdef ^ i as u64,
            })
            .collect(),
    }
}

fn table_err(b: &[u8]) -> Error {
    let e = Table::decode(b).unwrap_err();
    assert_eq!(
        (e.code(), e.stage(), e.class()),
        ("block_table", "payload", Class::Corrupt),
        "{e}"
    );
    assert_eq!(e.block(), Some(""));
    e
}

#[test]
fn a_table_round_trips() {
    for n in [0, 1, 5] {
        let t = sample(n);
        let b = t.encode().unwrap();
        assert_eq!(b.len(), 16 + 56 * n);
        assert_eq!(Table::decode(&b).unwrap(), t);
        assert_eq!(t.tokens(), 16 * n as u64);
    }
}

#[test]
fn malformed_tables_are_block_table() {
    let good = sample(3).encode().unwrap();
    table_err(&good[..good.len() - 1]);
    table_err(&[good.as_slice(), &[0]].concat());
    table_err(&good[..10]);
    table_err(&[]);
    let cases: [(usize, u8); 6] = [
        (0, b'X'),         // magic
        (4, 2),            // version
        (8, 4),            // count 3 -> 4: the length no longer matches
        (12, 0),           // block_tokens 0 (16 -> 0)
        (16 + 36, 1),      // record 0's reserved field
        (16 + 56 + 32, 0), // record 1's n_tokens 16 -> 0
    ];
    for (at, v) in cases {
        let mut b = good.clone();
        b[at] = v;
        let e = table_err(&b);
        assert!(!e.to_string().is_empty(), "{at}");
    }
    // more records than a table may hold: refused before the length
    let mut b = good.clone();
    b[8..12].copy_from_slice(&(u32::try_from(MAX_TABLE_BLOCKS).unwrap() + 1).to_le_bytes());
    assert!(table_err(&b).to_string().contains("more than"));
    // a record declaring more than a block may hold
    let mut b = good.clone();
    b[16 + 40..16 + 48].copy_from_slice(&((1u64 << 30) + 1).to_le_bytes());
    table_err(&b);
}

#[test]
fn the_encoder_refuses_what_the_decoder_would() {
    let mut t = sample(1);
    t.block_tokens = 0;
    assert_eq!(t.encode().unwrap_err().code(), "block_table");
    let mut t = sample(1);
    t.records[0].n_tokens = 0;
    assert_eq!(t.encode().unwrap_err().code(), "block_table");
}

// ---- §7.5's test vectors -------------------------------------------------

fn format_md() -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/FORMAT.md");
    std::fs::read_to_string(p).unwrap()
}

/// The fenced block between `<!-- vector:{id} -->` and `<!-- /vector -->`.
fn vector(doc: &str, id: &str) -> String {
    let start = format!("<!-- vector:{id} -->");
    let (_, rest) = doc.split_once(&start).expect("vector marker");
    let (body, _) = rest.split_once("<!-- /vector -->").expect("closed");
    let body = body.trim().strip_prefix("```text").expect("fence");
    body.strip_suffix("```").expect("fence").trim().to_owned()
}

/// An `xxd` dump's bytes (the ASCII column ignored).
fn xxd(dump: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for line in dump.lines() {
        let (off, rest) = line.split_once(": ").expect("xxd line");
        assert_eq!(usize::from_str_radix(off, 16).unwrap(), out.len());
        let cols: String = rest
            .chars()
            .take(39)
            .filter(|c| !c.is_whitespace())
            .collect();
        out.extend(hex::decode(cols).unwrap());
    }
    out
}

fn fields(doc: &str) -> BTreeMap<String, String> {
    vector(doc, "block:fields")
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(" = ").expect("key = value");
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

fn derive(context: &str, input: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new_derive_key(context);
    h.update(input);
    *h.finalize().as_bytes()
}

fn framed_abi(abi: &str) -> Vec<u8> {
    [
        &u32::try_from(abi.len()).unwrap().to_le_bytes()[..],
        abi.as_bytes(),
    ]
    .concat()
}

fn indep_name(parent: &[u8; 32], tokens: &[u32], abi: &str) -> [u8; 32] {
    let mut m = parent.to_vec();
    m.extend_from_slice(&u32::try_from(tokens.len()).unwrap().to_le_bytes());
    for t in tokens {
        m.extend_from_slice(&t.to_le_bytes());
    }
    m.extend(framed_abi(abi));
    derive("ds4 block name v1", &m)
}

fn u64_hex(s: &str) -> u64 {
    u64::from_str_radix(s.strip_prefix("0x").unwrap(), 16).unwrap()
}

#[test]
fn the_documented_names_and_checksums() {
    let doc = format_md();
    let f = fields(&doc);
    let known = [
        "abi",
        "root",
        "root ns",
        "name 0",
        "name 1",
        "abi tag",
        "payload checksum",
        "header checksum",
        "keyed header checksum",
        "block key",
        "mac",
    ];
    assert!(f.keys().all(|k| known.contains(&k.as_str())), "{f:?}");
    assert_eq!(f.len(), known.len());
    let abi = f["abi"].as_str();
    let ns = b"\xff\x00ns:alice\xff\x00";
    let root = derive("ds4 block root v1", &framed_abi(abi));
    let root_ns = derive(
        "ds4 block root v1",
        &[framed_abi(abi), ns.to_vec()].concat(),
    );
    assert_eq!(hex::encode(root), f["root"]);
    assert_eq!(hex::encode(root_ns), f["root ns"]);
    assert_eq!(block::root(abi, b"").unwrap(), root);
    assert_eq!(block::root(abi, ns).unwrap(), root_ns);
    let n0 = indep_name(&root, &[1, 2, 3, 4], abi);
    let n1 = indep_name(&n0, &[5, 6, 7, 8], abi);
    assert_eq!(hex::encode(n0), f["name 0"]);
    assert_eq!(hex::encode(n1), f["name 1"]);
    assert_eq!(
        block::names(&root, &[1, 2, 3, 4, 5, 6, 7, 8, 9], bt(4), abi).unwrap(),
        [n0, n1]
    );
    assert_eq!(hex::encode(ds4::name::model_tag(abi)), f["abi tag"]);

    // the file without a key: the documented dump, byte for byte
    let payload: Vec<u8> = (1..=8).collect();
    let file = xxd(&vector(&doc, "block:file"));
    assert_eq!(file[128..], payload[..]);
    assert_eq!(
        twox_hash::XxHash3_64::oneshot(&payload),
        u64_hex(&f["payload checksum"])
    );
    assert_eq!(
        twox_hash::XxHash3_64::oneshot(&file[..120]),
        u64_hex(&f["header checksum"])
    );
    assert_eq!(file[120..128], u64_hex(&f["header checksum"]).to_le_bytes());
    let d = tempfile::tempdir().unwrap();
    let w = write_block(d.path(), &n0, 4, abi, &payload, None).unwrap();
    assert_eq!(w.checksum, u64_hex(&f["payload checksum"]));
    assert_eq!(std::fs::read(&w.path).unwrap(), file);

    // with the key 00 01 .. 1f: flags 1, the keyed header checksum, the MAC
    let key: [u8; 32] = std::array::from_fn(|i| u8::try_from(i).unwrap());
    let block_key = derive("ds4 block authentication key v1", &key);
    assert_eq!(hex::encode(block_key), f["block key"]);
    let mut head = file[..128].to_vec();
    head[4] = 1;
    let sum = twox_hash::XxHash3_64::oneshot(&head[..120]);
    assert_eq!(sum, u64_hex(&f["keyed header checksum"]));
    head[120..].copy_from_slice(&sum.to_le_bytes());
    let mut mac = blake3::Hasher::new_keyed(&block_key);
    mac.update(&head[..120]);
    mac.update(&payload);
    assert_eq!(mac.finalize().to_hex().as_str(), f["mac"]);
    std::fs::remove_file(&w.path).unwrap();
    write_block(d.path(), &n0, 4, abi, &payload, Some(&key)).unwrap();
    let keyed = std::fs::read(&w.path).unwrap();
    assert_eq!(
        keyed,
        [head, payload.clone(), hex::decode(&f["mac"]).unwrap()].concat()
    );

    // the table of the two blocks
    let table = Table {
        block_tokens: 4,
        records: [n0, n1]
            .iter()
            .map(|n| Record {
                name: *n,
                n_tokens: 4,
                payload_len: 8,
                checksum: u64_hex(&f["payload checksum"]),
            })
            .collect(),
    };
    let documented = xxd(&vector(&doc, "block:table"));
    assert_eq!(table.encode().unwrap(), documented);
    assert_eq!(Table::decode(&documented).unwrap(), table);
}
