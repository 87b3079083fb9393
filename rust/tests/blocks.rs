//! KV block files (docs/FORMAT.md §7): the round trip with and without a
//! key, every refusal code of a block against its table record, parallel
//! verification, and the first failing block reported whatever the
//! threads' timing. The table and the names are in `block_table.rs`.

use ds4::blocks::{open_blocks, read_block_header, verify_block, write_block, Failure};
use ds4::format::block::{self, BlockName, BLOCK_HEADER};
use ds4::format::block_table::{Record, Table};
use ds4::{Class, Error};
use std::num::NonZeroU32;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const ABI: &str = "test-abi";
const KEY: [u8; 32] = [7; 32];
const BT: u32 = 4;

/// Block `i`'s payload: `len` bytes derived from `i`.
fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| u8::try_from((k * 31 + i * 7) % 251).unwrap())
        .collect()
}

/// `n` chained blocks of `BT` tokens written to `dir` (block `i` of
/// `64 + 8 i` bytes), the table naming them and their payloads joined.
fn store(dir: &Path, n: usize, key: Option<&[u8; 32]>) -> (Table, Vec<u8>) {
    let tokens: Vec<u32> = (0..u32::try_from(n).unwrap() * BT).collect();
    let root = block::root(ABI, b"").unwrap();
    let names = block::names(&root, &tokens, NonZeroU32::new(BT).unwrap(), ABI).unwrap();
    let mut records = Vec::new();
    let mut joined = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let p = payload(i, 64 + 8 * i);
        let w = write_block(dir, name, BT, ABI, &p, key).unwrap();
        assert_eq!(w.path, dir.join(block::file_name(name)));
        records.push(Record {
            name: *name,
            n_tokens: BT,
            payload_len: p.len() as u64,
            checksum: w.checksum,
        });
        joined.extend_from_slice(&p);
    }
    let table = Table {
        block_tokens: BT,
        records,
    };
    (table, joined)
}

fn path_of(dir: &Path, name: &BlockName) -> PathBuf {
    dir.join(block::file_name(name))
}

fn hex(name: &BlockName) -> String {
    ds4::hash::to_hex(name)
}

/// The failure's code is `code`, stage block, corrupt, about `index`'s file.
fn expect(r: Result<Vec<u8>, Failure>, code: &str, dir: &Path, t: &Table, index: usize) -> Error {
    let f = r.expect_err(code);
    let name = &t.records[index].name;
    assert_eq!(f.error.code(), code, "{}", f.error);
    assert_eq!(f.error.stage(), "block");
    assert_eq!(f.error.class(), Class::Corrupt);
    assert_eq!(f.error.block(), Some(hex(name).as_str()));
    assert_eq!(f.path.as_deref(), Some(path_of(dir, name).as_path()));
    f.error
}

fn patch(path: &Path, at: usize, f: impl FnOnce(&mut u8)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b[at]);
    std::fs::write(path, b).unwrap();
}

#[test]
fn round_trip_without_a_key() {
    let d = tempfile::tempdir().unwrap();
    let (t, joined) = store(d.path(), 3, None);
    assert_eq!(open_blocks(d.path(), &t, ABI, None, 2).unwrap(), joined);
    for r in &t.records {
        let p = path_of(d.path(), &r.name);
        let h = read_block_header(&p).unwrap();
        assert_eq!(
            (h.name, h.n_tokens, h.payload_len),
            (r.name, BT, r.payload_len)
        );
        assert_eq!(h.checksum, r.checksum);
        assert_eq!(h.abi_tag, ds4::name::model_tag(ABI));
        assert!(!h.authenticated);
        assert_eq!(h.file_len(), std::fs::metadata(&p).unwrap().len());
        assert_eq!(verify_block(&p, Some(ABI), None).unwrap(), h);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    // no temp file is left, nothing else is written
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 3);
}

#[test]
fn round_trip_with_a_key_and_a_trailer_read_without_one() {
    let d = tempfile::tempdir().unwrap();
    let (t, joined) = store(d.path(), 3, Some(&KEY));
    assert_eq!(
        open_blocks(d.path(), &t, ABI, Some(&KEY), 2).unwrap(),
        joined
    );
    // without a key the MAC trailer is accepted (the checksum still checked)
    assert_eq!(open_blocks(d.path(), &t, ABI, None, 1).unwrap(), joined);
    let p = path_of(d.path(), &t.records[1].name);
    let h = verify_block(&p, Some(ABI), Some(&KEY)).unwrap();
    assert!(h.authenticated);
    assert_eq!(
        h.file_len(),
        BLOCK_HEADER as u64 + t.records[1].payload_len + 32
    );
}

#[test]
fn an_empty_table_is_an_empty_payload() {
    let d = tempfile::tempdir().unwrap();
    let t = Table {
        block_tokens: BT,
        records: vec![],
    };
    assert!(open_blocks(d.path(), &t, ABI, Some(&KEY), 4)
        .unwrap()
        .is_empty());
}

#[test]
fn damaged_header_bytes_are_block_corrupt() {
    // magic, version, flags, reserved bytes, n_tokens (under the checksum),
    // the header checksum itself
    for at in [0usize, 3, 4, 6, 40, 45, 100, 121] {
        let d = tempfile::tempdir().unwrap();
        let (t, _) = store(d.path(), 2, None);
        patch(&path_of(d.path(), &t.records[1].name), at, |b| *b ^= 0x10);
        let r = open_blocks(d.path(), &t, ABI, None, 2);
        let e = expect(r, "block_corrupt", d.path(), &t, 1);
        assert!(matches!(e, Error::BlockCorrupt { .. }), "{at}: {e}");
    }
}

#[test]
fn a_resealed_header_that_disagrees_with_its_record_is_block_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, None);
    let p = path_of(d.path(), &t.records[0].name);
    let mut b = std::fs::read(&p).unwrap();
    b[40] = 5; // n_tokens 4 -> 5, the header checksum recomputed
    let sum = block::header_checksum(b[..BLOCK_HEADER].try_into().unwrap());
    b[120..128].copy_from_slice(&sum.to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(read_block_header(&p).is_ok());
    let e = expect(
        open_blocks(d.path(), &t, ABI, None, 1),
        "block_corrupt",
        d.path(),
        &t,
        0,
    );
    assert!(e.to_string().contains("5 tokens"), "{e}");
}

#[test]
fn a_payload_bit_flip_is_block_checksum() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 3, None);
    patch(
        &path_of(d.path(), &t.records[2].name),
        BLOCK_HEADER + 5,
        |b| *b ^= 1,
    );
    expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_checksum",
        d.path(),
        &t,
        2,
    );
    let p = path_of(d.path(), &t.records[2].name);
    assert_eq!(
        verify_block(&p, None, None).unwrap_err().code(),
        "block_checksum"
    );
    assert!(read_block_header(&p).is_ok(), "the header alone is intact");
}

#[test]
fn a_record_of_another_checksum_is_block_checksum() {
    let d = tempfile::tempdir().unwrap();
    let (mut t, _) = store(d.path(), 2, None);
    t.records[1].checksum ^= 1;
    expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_checksum",
        d.path(),
        &t,
        1,
    );
}

#[test]
fn a_mac_bit_flip_and_a_wrong_key_are_block_mac() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, Some(&KEY));
    let r = open_blocks(d.path(), &t, ABI, Some(&[8; 32]), 2);
    expect(r, "block_mac", d.path(), &t, 0);
    let p = path_of(d.path(), &t.records[1].name);
    let len = std::fs::metadata(&p).unwrap().len();
    patch(&p, usize::try_from(len).unwrap() - 1, |b| *b ^= 0x80);
    expect(
        open_blocks(d.path(), &t, ABI, Some(&KEY), 2),
        "block_mac",
        d.path(),
        &t,
        1,
    );
    // a damaged MAC is not looked at without a key
    assert!(open_blocks(d.path(), &t, ABI, None, 2).is_ok());
}

#[test]
fn no_mac_with_a_key_is_block_mac_missing() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, None);
    let r = open_blocks(d.path(), &t, ABI, Some(&KEY), 2);
    expect(r, "block_mac_missing", d.path(), &t, 0);
    let p = path_of(d.path(), &t.records[0].name);
    let e = verify_block(&p, None, Some(&KEY)).unwrap_err();
    assert_eq!(e.code(), "block_mac_missing");
}

#[test]
fn a_block_forged_under_a_real_name_is_refused_with_a_key() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, Some(&KEY));
    // the forger knows the name and the record, not the key: another key
    let r = &t.records[1];
    let forged = payload(1, usize::try_from(r.payload_len).unwrap());
    write_block(d.path(), &r.name, BT, ABI, &forged, Some(&[9; 32])).unwrap();
    expect(
        open_blocks(d.path(), &t, ABI, Some(&KEY), 2),
        "block_mac",
        d.path(),
        &t,
        1,
    );
}

#[test]
fn truncated_and_extended_files_are_block_short() {
    // one byte short, one long, shorter than the header (block 1: 128 + 72)
    for delta in [-1i64, 1, -188] {
        let d = tempfile::tempdir().unwrap();
        let (t, _) = store(d.path(), 2, None);
        let p = path_of(d.path(), &t.records[1].name);
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len.checked_add_signed(delta).unwrap()).unwrap();
        expect(
            open_blocks(d.path(), &t, ABI, None, 2),
            "block_short",
            d.path(),
            &t,
            1,
        );
        assert_eq!(read_block_header(&p).unwrap_err().code(), "block_short");
    }
}

#[test]
fn a_block_renamed_onto_another_name_is_block_name() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 3, None);
    // block 2 is copied under block 1's name: same length, its own header
    let (a, b) = (&t.records[1], &t.records[2]);
    let pb = path_of(d.path(), &b.name);
    let same = payload(9, usize::try_from(a.payload_len).unwrap());
    write_block(d.path(), &b.name, BT, ABI, &same, None).unwrap();
    std::fs::rename(&pb, path_of(d.path(), &a.name)).unwrap();
    let e = expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_name",
        d.path(),
        &t,
        1,
    );
    assert!(e.to_string().contains(&hex(&b.name)), "{e}");
    let e = verify_block(&path_of(d.path(), &a.name), None, None).unwrap_err();
    assert_eq!(e.code(), "block_name");
}

#[test]
fn a_file_of_no_block_name_is_block_name_for_verify_block() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 1, None);
    let p = d.path().join("renamed.kvb");
    std::fs::rename(path_of(d.path(), &t.records[0].name), &p).unwrap();
    let e = verify_block(&p, None, None).unwrap_err();
    assert_eq!(
        (e.code(), e.block()),
        ("block_name", Some(hex(&t.records[0].name).as_str()))
    );
    assert!(read_block_header(&p).is_ok());
}

#[test]
fn another_abi_is_block_abi() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, None);
    expect(
        open_blocks(d.path(), &t, "other-abi", None, 2),
        "block_abi",
        d.path(),
        &t,
        0,
    );
    let p = path_of(d.path(), &t.records[0].name);
    let e = verify_block(&p, Some("other-abi"), None).unwrap_err();
    assert_eq!(e.code(), "block_abi");
    assert!(
        verify_block(&p, None, None).is_ok(),
        "no ABI given, none checked"
    );
}

#[test]
fn a_missing_file_is_block_missing() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 3, None);
    std::fs::remove_file(path_of(d.path(), &t.records[2].name)).unwrap();
    expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_missing",
        d.path(),
        &t,
        2,
    );
    let e = read_block_header(&path_of(d.path(), &t.records[2].name)).unwrap_err();
    assert_eq!(e.code(), "block_missing");
}

#[test]
fn a_symlink_or_a_directory_is_block_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 2, None);
    let (p0, p1) = (
        path_of(d.path(), &t.records[0].name),
        path_of(d.path(), &t.records[1].name),
    );
    // block 1's path becomes a symlink to a copy of its own bytes
    let real = d.path().join("elsewhere");
    std::fs::rename(&p1, &real).unwrap();
    std::os::unix::fs::symlink(&real, &p1).unwrap();
    let e = expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_corrupt",
        d.path(),
        &t,
        1,
    );
    assert!(e.to_string().contains("symlink"), "{e}");
    assert_eq!(
        verify_block(&p1, None, None).unwrap_err().code(),
        "block_corrupt"
    );
    std::fs::remove_file(&p0).unwrap();
    std::fs::create_dir(&p0).unwrap();
    expect(
        open_blocks(d.path(), &t, ABI, None, 2),
        "block_corrupt",
        d.path(),
        &t,
        0,
    );
}

#[test]
fn an_io_error_is_not_a_block_error() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 1, None);
    // the directory holding the block is not a directory
    let notdir = d.path().join(block::file_name(&t.records[0].name));
    let e = open_blocks(&notdir, &t, ABI, None, 1).unwrap_err();
    assert_eq!(e.error.code(), "io", "{}", e.error);
    assert_eq!(e.error.block(), None);
}

#[test]
fn parallel_verification_returns_the_sequential_bytes() {
    let d = tempfile::tempdir().unwrap();
    let (t, joined) = store(d.path(), 13, Some(&KEY));
    let one = open_blocks(d.path(), &t, ABI, Some(&KEY), 1).unwrap();
    assert_eq!(one, joined);
    for threads in [0, 2, 3, 4, 8, 13, 64] {
        let many = open_blocks(d.path(), &t, ABI, Some(&KEY), threads).unwrap();
        assert_eq!(many, one, "{threads} threads");
    }
}

#[test]
fn a_large_block_is_read_in_chunks() {
    let d = tempfile::tempdir().unwrap();
    let name = block::root(ABI, b"big").unwrap();
    let p = payload(3, (3 << 20) + 17);
    let w = write_block(d.path(), &name, 1000, ABI, &p, Some(&KEY)).unwrap();
    let t = Table {
        block_tokens: 1000,
        records: vec![Record {
            name,
            n_tokens: 1000,
            payload_len: p.len() as u64,
            checksum: w.checksum,
        }],
    };
    assert_eq!(open_blocks(d.path(), &t, ABI, Some(&KEY), 2).unwrap(), p);
}

#[test]
fn the_first_failing_block_in_table_order_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let (t, _) = store(d.path(), 16, None);
    // block 9: checksum; block 5: a header byte; block 12: missing
    patch(
        &path_of(d.path(), &t.records[9].name),
        BLOCK_HEADER + 1,
        |b| *b ^= 4,
    );
    patch(&path_of(d.path(), &t.records[5].name), 100, |b| *b = 1);
    std::fs::remove_file(path_of(d.path(), &t.records[12].name)).unwrap();
    for threads in [1, 2, 3, 4, 16] {
        for _ in 0..10 {
            let r = open_blocks(d.path(), &t, ABI, None, threads);
            expect(r, "block_corrupt", d.path(), &t, 5);
        }
    }
    // a failure found by read comes before a later entry's stat failure
    patch(&path_of(d.path(), &t.records[5].name), 100, |b| *b = 0);
    expect(
        open_blocks(d.path(), &t, ABI, None, 4),
        "block_checksum",
        d.path(),
        &t,
        9,
    );
    // and a stat failure before every read failure is the one reported
    std::fs::remove_file(path_of(d.path(), &t.records[2].name)).unwrap();
    expect(
        open_blocks(d.path(), &t, ABI, None, 4),
        "block_missing",
        d.path(),
        &t,
        2,
    );
}

#[test]
fn the_writer_refuses_no_tokens_and_oversized_payloads() {
    let d = tempfile::tempdir().unwrap();
    let name = [1u8; 32];
    assert!(matches!(
        write_block(d.path(), &name, 0, ABI, b"x", None),
        Err(Error::BadMetadata(_))
    ));
    // a missing directory is an I/O error, and leaves nothing behind
    let e = write_block(&d.path().join("no"), &name, 1, ABI, b"x", None).unwrap_err();
    assert!(matches!(e, Error::Io(_)));
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
}
