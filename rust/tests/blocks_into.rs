//! `open_blocks_into` (docs/FORMAT.md §7): each verified block's bytes
//! placed where a state's layout puts its tokens' rows (`ds4.blocks`:
//! a run is `rows` rows of `unit` bytes a token), the bytes outside the
//! blocks' rows untouched; a table that does not fit the layout refused
//! before anything is written; a failing block reported as by
//! `open_blocks`.

use ds4::blocks::{open_blocks_into, write_block, Run, Target};
use ds4::format::block::{self};
use ds4::format::block_table::{Record, Table};
use std::num::NonZeroU32;

const ABI: &str = "test-abi";
const BT: u32 = 4;
const N: u64 = 14; // three blocks of four tokens and a tail of two

/// Two arrays: the first with a K-like run (one row of 3 bytes a token)
/// after an 8-byte header and a transposed-V-like run (2 rows of 2 bytes
/// a token) after a 5-byte gap; the second one run of 1 byte a token.
fn layout() -> Vec<(usize, Vec<Run>)> {
    let k = Run {
        start: 8,
        rows: 1,
        unit: 3,
    };
    let v = Run {
        start: 8 + 3 * N + 5,
        rows: 2,
        unit: 2,
    };
    let len0 = usize::try_from(v.start + 2 * 2 * N + 3).unwrap();
    let w = Run {
        start: 0,
        rows: 1,
        unit: 1,
    };
    vec![(len0, vec![k, v]), (usize::try_from(N).unwrap(), vec![w])]
}

/// Block `b`'s payload cut from `state` by the layout's rule.
fn cut(state: &[Vec<u8>], b: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for ((_, runs), arr) in layout().iter().zip(state) {
        for r in runs {
            for row in 0..r.rows {
                let at = usize::try_from(r.start + (row * N + b * u64::from(BT)) * r.unit).unwrap();
                let len = usize::try_from(u64::from(BT) * r.unit).unwrap();
                out.extend_from_slice(&arr[at..at + len]);
            }
        }
    }
    out
}

fn state() -> Vec<Vec<u8>> {
    layout()
        .iter()
        .enumerate()
        .map(|(i, (len, _))| {
            (0..*len)
                .map(|k| u8::try_from((k * 37 + i * 11) % 251).unwrap())
                .collect()
        })
        .collect()
}

fn store(dir: &std::path::Path, state: &[Vec<u8>]) -> Table {
    let tokens: Vec<u32> = (0..u32::try_from(N).unwrap()).collect();
    let root = block::root(ABI, b"").unwrap();
    let names = block::names(&root, &tokens, NonZeroU32::new(BT).unwrap(), ABI).unwrap();
    let records = names
        .iter()
        .enumerate()
        .map(|(b, name)| {
            let p = cut(state, b as u64);
            let w = write_block(dir, name, BT, ABI, &p, None).unwrap();
            Record {
                name: *name,
                n_tokens: BT,
                payload_len: p.len() as u64,
                checksum: w.checksum,
            }
        })
        .collect();
    Table {
        block_tokens: BT,
        records,
    }
}

/// Whether byte `k` of array `i` is in a block's rows.
fn in_blocks(i: usize, k: u64) -> bool {
    let whole = 3 * u64::from(BT);
    layout()[i].1.iter().any(|r| {
        (0..r.rows).any(|row| {
            let lo = r.start + row * N * r.unit;
            (lo..lo + whole * r.unit).contains(&k)
        })
    })
}

fn run_into(
    dir: &std::path::Path,
    table: &Table,
    threads: usize,
) -> Result<Vec<Vec<u8>>, ds4::blocks::Failure> {
    let mut outs: Vec<Vec<u8>> = layout().iter().map(|(len, _)| vec![0xEE; *len]).collect();
    let lay = layout();
    let mut targets: Vec<Target<'_>> = outs
        .iter_mut()
        .zip(&lay)
        .map(|(o, (_, runs))| Target {
            out: o,
            runs: runs.clone(),
        })
        .collect();
    open_blocks_into(dir, table, ABI, None, threads, &mut targets, N)?;
    Ok(outs)
}

#[test]
fn each_block_lands_in_its_rows_and_nothing_else_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let st = state();
    let table = store(dir.path(), &st);
    assert_eq!(table.records.len(), 3);
    for threads in [1, 2, 3] {
        let outs = run_into(dir.path(), &table, threads).unwrap();
        for (i, (out, want)) in outs.iter().zip(&st).enumerate() {
            for (k, (&got, &w)) in out.iter().zip(want).enumerate() {
                let expect = if in_blocks(i, k as u64) { w } else { 0xEE };
                assert_eq!(got, expect, "array {i} byte {k} ({threads} threads)");
            }
        }
    }
}

#[test]
fn a_table_that_does_not_fit_the_layout_is_block_table() {
    let dir = tempfile::tempdir().unwrap();
    let st = state();
    let mut table = store(dir.path(), &st);
    table.records[1].payload_len += 1; // a block of another layout's size
    let f = run_into(dir.path(), &table, 2).unwrap_err();
    assert_eq!(f.error.code(), "block_table");
    let mut table = store(dir.path(), &st);
    table.block_tokens = 5; // four blocks of five tokens do not fit fourteen
    table.records.push(table.records[0]);
    let f = run_into(dir.path(), &table, 2).unwrap_err();
    assert_eq!(f.error.code(), "block_table");
}

#[test]
fn a_damaged_block_is_reported_as_open_blocks_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let table = store(dir.path(), &state());
    let victim = dir.path().join(block::file_name(&table.records[2].name));
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&victim, bytes).unwrap();
    let f = run_into(dir.path(), &table, 2).unwrap_err();
    assert_eq!(f.error.code(), "block_checksum");
    assert_eq!(f.path.as_deref(), Some(victim.as_path()));
    std::fs::remove_file(&victim).unwrap();
    let f = run_into(dir.path(), &table, 2).unwrap_err();
    assert_eq!(f.error.code(), "block_missing");
}
