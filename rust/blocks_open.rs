//! A manifest's whole block table verified on several threads (FORMAT.md
//! §7): every file `lstat`ed first, in table order, then each block read,
//! hashed and checked (MAC with a key) by one of the threads, and handed
//! to its destination: one buffer of the payloads concatenated in table
//! order ([`open_blocks`]), or the state's own arrays, each block's bytes
//! placed where the layout's runs say its tokens' rows go
//! ([`open_blocks_into`]: no buffer of the concatenation, no second pass).
//! The failure reported is the first in table order, whatever the
//! threads' timing.

use crate::blocks::{stat_block, verify_file, Expect, Sink};
use crate::error::{Error, Result};
use crate::format::block;
use crate::format::block_table::{Record, Table};
use crate::format::mac::MacKey;
use crate::hash::to_hex;
use crate::name::{model_tag, ModelTag};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The first failure of a table's verification and the path it is about
/// (the block file's; None for a failure of no block).
#[derive(Debug)]
pub struct Failure {
    pub error: Error,
    pub path: Option<PathBuf>,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Failure { error, path: None }
    }
}

/// One block of a table to verify: its index, record, file and label.
pub(crate) struct Job<'a> {
    index: usize,
    record: &'a Record,
    path: PathBuf,
    label: String,
}

impl Job<'_> {
    fn expect<'k>(&'k self, tag: ModelTag, key: Option<&'k MacKey>) -> Expect<'k> {
        Expect {
            name: Some(&self.record.name),
            abi_tag: Some(tag),
            record: Some(self.record),
            key,
        }
    }
}

/// The table's blocks, checked by `lstat` in order, and the first failure
/// (only the blocks before it are read).
fn jobs<'t>(dir: &Path, table: &'t Table) -> (Vec<Job<'t>>, Option<(usize, Error)>) {
    let jobs: Vec<Job<'t>> = table
        .records
        .iter()
        .enumerate()
        .map(|(index, record)| Job {
            index,
            record,
            path: dir.join(block::file_name(&record.name)),
            label: to_hex(&record.name),
        })
        .collect();
    let failure = jobs.iter().find_map(|j| {
        stat_block(&j.path, j.record, &j.label)
            .err()
            .map(|e| (j.index, e))
    });
    (jobs, failure)
}

/// What [`verify_each`] runs for one block: its job, its sink and the
/// thread's scratch buffer.
type Check<'c, S> = dyn Fn(&Job<'_>, S, &mut Vec<u8>) -> Result<()> + Sync + 'c;

/// Runs `check(job, sink, scratch)` for the jobs before the `lstat`
/// pass's failure `before`, one sink each, on up to `threads` threads
/// (dealt round-robin, each thread with its own scratch buffer); a thread
/// stops at a job after a known failure. The first failure in table order
/// is reported, with its block file's path.
fn verify_each<S: Send>(
    jobs: &[Job<'_>],
    sinks: Vec<S>,
    threads: usize,
    before: Option<(usize, Error)>,
    check: &Check<'_, S>,
) -> std::result::Result<(), Failure> {
    let n_ok = before.as_ref().map_or(jobs.len(), |(i, _)| *i);
    let threads = threads.clamp(1, n_ok.max(1));
    let mut buckets: Vec<Vec<(&Job<'_>, S)>> = (0..threads).map(|_| Vec::new()).collect();
    for ((j, sink), b) in jobs.iter().take(n_ok).zip(sinks).zip((0..threads).cycle()) {
        if let Some(bucket) = buckets.get_mut(b) {
            bucket.push((j, sink));
        }
    }
    let first = AtomicUsize::new(usize::MAX);
    let run = |bucket: Vec<(&Job<'_>, S)>| -> Option<(usize, Error)> {
        let mut scratch = Vec::new();
        for (j, sink) in bucket {
            if j.index > first.load(Ordering::Relaxed) {
                return None;
            }
            if let Err(e) = check(j, sink, &mut scratch) {
                first.fetch_min(j.index, Ordering::Relaxed);
                return Some((j.index, e));
            }
        }
        None
    };
    let failures: Vec<(usize, Error)> = if threads == 1 {
        buckets.into_iter().filter_map(run).collect()
    } else {
        let run = &run;
        std::thread::scope(|s| {
            let handles: Vec<_> = buckets
                .into_iter()
                .map(|bucket| s.spawn(move || run(bucket)))
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    };
    match failures.into_iter().min_by_key(|(i, _)| *i).or(before) {
        None => Ok(()),
        Some((i, error)) => Err(Failure {
            error,
            path: jobs.get(i).map(|j| j.path.clone()),
        }),
    }
}

/// Verifies every block of `table` in `dir` against its record, for the
/// payload ABI `abi` (and the MAC key `key`), on up to `threads` threads,
/// and returns the payloads concatenated in table order (each read
/// straight into its place). The buffer is allocated for the blocks before
/// the first `lstat` failure only.
pub fn open_blocks(
    dir: &Path,
    table: &Table,
    abi: &str,
    key: Option<&MacKey>,
    threads: usize,
) -> std::result::Result<Vec<u8>, Failure> {
    let (jobs, before) = jobs(dir, table);
    let n_ok = before.as_ref().map_or(jobs.len(), |(i, _)| *i);
    let total: u64 = jobs.iter().take(n_ok).map(|j| j.record.payload_len).sum();
    let mut out = vec![0u8; usize::try_from(total).map_err(|_| Error::SizeOverflow)?];
    let mut sinks: Vec<&mut [u8]> = Vec::with_capacity(n_ok);
    let mut rest: &mut [u8] = &mut out;
    for j in jobs.iter().take(n_ok) {
        let len = usize::try_from(j.record.payload_len).map_err(|_| Error::SizeOverflow)?;
        let (mine, tail) = rest.split_at_mut_checked(len).ok_or(Error::SizeOverflow)?;
        sinks.push(mine);
        rest = tail;
    }
    let tag = model_tag(abi);
    let check = |j: &Job<'_>, sink: &mut [u8], _: &mut Vec<u8>| {
        verify_file(&j.path, j.expect(tag, key), Sink::Whole(sink), &j.label).map(|_| ())
    };
    verify_each(&jobs, sinks, threads, before, &check)?;
    Ok(out)
}

/// An append-only run of an array: `rows` rows of `unit` bytes a token,
/// from byte `start` (row `r`'s token `t` at `start + (r * n + t) * unit`
/// for a state of `n` tokens: `ds4.blocks.Run`).
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub start: u64,
    pub rows: u64,
    pub unit: u64,
}

/// One array of the state being joined, and its runs in byte order.
pub struct Target<'a> {
    pub out: &'a mut [u8],
    pub runs: Vec<Run>,
}

fn bad_layout(detail: &str) -> Error {
    Error::BlockTable(format!(
        "the table does not fit this state's layout: {detail}"
    ))
}

/// Each block's destinations, in its payload's order: for every target,
/// every run, every row, the `block * unit` bytes of its tokens. Checks
/// that the runs lie in their arrays, do not overlap, and that every
/// record holds the table's block of tokens in exactly the bytes a block
/// of this layout takes (`block_table` otherwise: nothing is written).
fn destinations<'a>(
    targets: &mut [Target<'a>],
    table: &Table,
    n_blocks: usize,
    n_tokens: u64,
) -> Result<Vec<Vec<&'a mut [u8]>>> {
    let block = u64::from(table.block_tokens);
    let whole = block
        .checked_mul(n_blocks as u64)
        .ok_or(Error::SizeOverflow)?;
    if whole > n_tokens {
        return Err(bad_layout(&format!(
            "{n_blocks} blocks of {block} tokens in a state of {n_tokens}"
        )));
    }
    let mut per_block: u64 = 0;
    let mut out: Vec<Vec<&'a mut [u8]>> = (0..n_blocks).map(|_| Vec::new()).collect();
    for t in targets.iter_mut() {
        let mut rest: &'a mut [u8] = std::mem::take(&mut t.out);
        let mut at: u64 = 0;
        for r in &t.runs {
            let seg = block.checked_mul(r.unit).ok_or(Error::SizeOverflow)?;
            per_block = r
                .rows
                .checked_mul(seg)
                .and_then(|x| x.checked_add(per_block))
                .ok_or(Error::SizeOverflow)?;
            let skip = r
                .start
                .checked_sub(at)
                .ok_or_else(|| bad_layout("runs overlap"))?;
            let span = r
                .rows
                .checked_mul(r.unit)
                .and_then(|x| x.checked_mul(n_tokens))
                .ok_or(Error::SizeOverflow)?;
            rest = take(rest, skip)?.1;
            for _ in 0..r.rows {
                for dst in &mut out {
                    let (seg_buf, tail) = take(rest, seg)?;
                    dst.push(seg_buf);
                    rest = tail;
                }
                let tail = r
                    .unit
                    .checked_mul(n_tokens - whole)
                    .ok_or(Error::SizeOverflow)?;
                rest = take(rest, tail)?.1; // the tokens after the last block: the residue's
            }
            at = r.start.checked_add(span).ok_or(Error::SizeOverflow)?;
        }
    }
    if let Some(r) = table
        .records
        .iter()
        .find(|r| u64::from(r.n_tokens) != block || r.payload_len != per_block)
    {
        return Err(bad_layout(&format!(
            "a record of {} tokens in {} bytes, blocks of this layout hold {block} in {per_block}",
            r.n_tokens, r.payload_len
        )));
    }
    Ok(out)
}

/// `buf`'s first `n` bytes and the rest (`block_table` when it is shorter:
/// a run outside its array).
fn take(buf: &mut [u8], n: u64) -> Result<(&mut [u8], &mut [u8])> {
    let n = usize::try_from(n).map_err(|_| Error::SizeOverflow)?;
    buf.split_at_mut_checked(n)
        .ok_or_else(|| bad_layout("a run lies outside its array"))
}

/// Verifies every block of `table` as [`open_blocks`] does and places each
/// block's bytes into `targets` (a state of `n_tokens` tokens whose
/// blocks' rows are still to be filled): block `b`'s payload is, for every
/// target, run and row in order, the rows of tokens `b * block ..
/// (b + 1) * block`. Bytes outside the blocks' rows are not touched.
pub fn open_blocks_into(
    dir: &Path,
    table: &Table,
    abi: &str,
    key: Option<&MacKey>,
    threads: usize,
    targets: &mut [Target<'_>],
    n_tokens: u64,
) -> std::result::Result<(), Failure> {
    let n_blocks = table.records.len();
    let dests = destinations(targets, table, n_blocks, n_tokens)?;
    let (jobs, before) = jobs(dir, table);
    let sinks: Vec<Vec<&mut [u8]>> = dests;
    let tag = model_tag(abi);
    let check = |j: &Job<'_>, segs: Vec<&mut [u8]>, _: &mut Vec<u8>| -> Result<()> {
        // each piece is copied to its places as soon as it is read and hashed (still in cache);
        // the places are the joined state's, which nothing uses until every block has passed
        let mut segs = segs.into_iter().filter(|s| !s.is_empty());
        let mut cur: Option<&mut [u8]> = segs.next();
        {
            let mut fill = |mut src: &[u8]| -> Result<()> {
                while !src.is_empty() {
                    let seg = cur.take().ok_or(Error::SizeOverflow)?;
                    let n = seg.len().min(src.len());
                    let (head, rest) = seg.split_at_mut(n);
                    let (mine, tail) = src.split_at(n);
                    head.copy_from_slice(mine);
                    src = tail;
                    cur = if rest.is_empty() {
                        segs.next()
                    } else {
                        Some(rest)
                    };
                }
                Ok(())
            };
            verify_file(&j.path, j.expect(tag, key), Sink::Each(&mut fill), &j.label)?;
        }
        if cur.is_some() {
            return Err(Error::SizeOverflow); // the places hold more than the block: never for a checked table
        }
        Ok(())
    };
    verify_each(&jobs, sinks, threads, before, &check)
}
