//! The in-memory index: the entries by name, their lengths and tails sorted
//! for the lookup's filter, and the one-pass lookup ([`Index::lookup`]).

use super::{name_of, tail_of, Entry, Prefixes, StatKey};
use crate::error::Result;
use crate::format::VERSION_V1;
use crate::hash;
use crate::name::FileId;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::Path;
use std::sync::Arc;

/// What a lookup filters on besides the text (see `KVStore.lookup`).
#[derive(Debug, Clone, Default)]
pub struct Query<'a> {
    pub min_tokens: u32,
    /// Only this ABI (v1 files pass: they are rejected at load, and reported).
    pub abi: Option<&'a str>,
    /// Only entries with fewer tokens than this.
    pub ctx: Option<u32>,
}

/// What [`Index::sync_listing`] found.
#[derive(Debug, Default)]
pub struct Listing {
    pub changed: Vec<String>,
    pub others: Vec<String>,
    pub gone: usize,
}

/// Hashes a SHA-1 digest key by its first 8 bytes: the names are digests
/// already (uniform), and `SipHash` over 100,000 of them is a good part of
/// an open. (A writer of the directory could pick names that collide here;
/// whoever can write the directory is trusted already: see
/// `open_cache_dir` on the Python side.)
#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // `Hash for [u8; 20]` writes the 20 bytes once (after a length,
        // through `write_usize`, which only folds in)
        let mut b = [0u8; 8];
        let n = bytes.len().min(8);
        b[..n].copy_from_slice(&bytes[..n]);
        self.0 ^= u64::from_le_bytes(b);
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = self.0.rotate_left(7) ^ n as u64;
    }
}

pub(super) type DigestMap<V> = HashMap<FileId, V, BuildHasherDefault<DigestHasher>>;
type DigestSet = HashSet<FileId, BuildHasherDefault<DigestHasher>>;

/// The directory an index file describes and when it was scanned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DirStamp {
    pub dev: u64,
    pub ino: u64,
    /// The directory's mtime (ns) when the scan began.
    pub mtime_ns: i64,
    /// The wall clock (ns since the epoch) when the scan began.
    pub scanned_ns: i64,
}

/// The index: entries by name, files kept unindexed (another format's) by
/// name with their stat key, and the length-sorted lookup table.
#[derive(Debug, Default)]
pub struct Index {
    pub(super) entries: DigestMap<Entry>,
    pub(super) kept: DigestMap<(StatKey, u64)>,
    pub(super) abis: Vec<Arc<str>>,
    pub(super) namespaces: Vec<Arc<str>>,
    /// The lookup's table; None when stale (rebuilt by the next lookup).
    pub(super) table: Option<Arc<Table>>,
}

/// The lookup's table: one row per entry, sorted by text length, with what
/// the lookup filters on (its tail, tokens, ABI and namespace as small ids
/// into the table's own string lists), so a lookup touches no entry until
/// it yields one. Immutable once built ([`Index::table`]): a cursor
/// ([`Prefixes`]) keeps the one it started from.
#[derive(Debug, Default)]
pub struct Table {
    pub(super) lens: Vec<u32>,
    pub(super) tails: Vec<u64>,
    pub(super) digests: Vec<FileId>,
    pub(super) rows: Vec<Row>,
    /// The ABIs and namespaces the rows' ids refer to.
    pub(super) abis: Vec<Arc<str>>,
    pub(super) namespaces: Vec<Arc<str>>,
}

/// A row's filter facts: tokens, whether it is a v1 file, its ABI (an index
/// into [`Table::abis`]) and namespace (0: the default; `i + 1`: index `i`
/// of [`Table::namespaces`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Row {
    pub(super) tokens: u32,
    pub(super) v1: bool,
    pub(super) abi: u32,
    pub(super) ns: u32,
}

/// The id of `s` in `pool` (by identity first: the index interns its
/// strings; by value otherwise), or `u32::MAX`.
fn id_in(ids: &HashMap<usize, u32>, pool: &[Arc<str>], s: &Arc<str>) -> u32 {
    ids.get(&(Arc::as_ptr(s).cast::<u8>() as usize))
        .copied()
        .or_else(|| {
            pool.iter()
                .position(|x| **x == **s)
                .and_then(|i| u32::try_from(i).ok())
        })
        .unwrap_or(u32::MAX)
}

fn ids_of(pool: &[Arc<str>]) -> HashMap<usize, u32> {
    pool.iter()
        .enumerate()
        .map(|(i, a)| {
            (
                Arc::as_ptr(a).cast::<u8>() as usize,
                u32::try_from(i).unwrap_or(u32::MAX),
            )
        })
        .collect()
}

impl Table {
    fn build(idx: &Index) -> Self {
        let (abi_ids, ns_ids) = (ids_of(&idx.abis), ids_of(&idx.namespaces));
        let mut rows: Vec<(u32, u64, FileId, Row)> = idx
            .entries
            .values()
            .map(|e| {
                let row = Row {
                    tokens: e.tokens,
                    v1: e.version == VERSION_V1,
                    abi: id_in(&abi_ids, &idx.abis, &e.abi),
                    ns: e
                        .namespace
                        .as_ref()
                        .map_or(0, |n| id_in(&ns_ids, &idx.namespaces, n).saturating_add(1)),
                };
                (e.text_bytes, e.tail, e.id(), row)
            })
            .collect();
        rows.sort_unstable_by_key(|r| r.0);
        Table {
            lens: rows.iter().map(|r| r.0).collect(),
            tails: rows.iter().map(|r| r.1).collect(),
            digests: rows.iter().map(|r| r.2).collect(),
            rows: rows.iter().map(|r| r.3).collect(),
            abis: idx.abis.clone(),
            namespaces: idx.namespaces.clone(),
        }
    }

    /// How many rows have a text no longer than `len`.
    pub(super) fn end_for(&self, len: usize) -> usize {
        self.lens.partition_point(|&l| l as usize <= len)
    }

    /// Whether row `i` passes `q` (its ABI as an id: [`Table::abi_id`]).
    pub(super) fn passes(&self, i: usize, q: &Query<'_>, abi: Option<u32>) -> bool {
        let r = self.rows[i];
        r.tokens >= q.min_tokens
            && abi.is_none_or(|a| r.v1 || r.abi == a)
            && q.ctx.is_none_or(|c| r.tokens < c)
    }

    /// The id a query's ABI has in this table (`u32::MAX`: no row's).
    pub(super) fn abi_id(&self, abi: Option<&str>) -> Option<u32> {
        abi.map(|a| {
            self.abis
                .iter()
                .position(|x| &**x == a)
                .and_then(|i| u32::try_from(i).ok())
                .unwrap_or(u32::MAX)
        })
    }

    /// The row id of a namespace (0: the default), None when no row can be in it.
    pub(super) fn ns_id(&self, ns: Option<&str>) -> Option<u32> {
        match ns {
            None => Some(0),
            Some(n) => self
                .namespaces
                .iter()
                .position(|x| &**x == n)
                .and_then(|i| u32::try_from(i + 1).ok()),
        }
    }
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn get(&self, d: &FileId) -> Option<&Entry> {
        self.entries.get(d)
    }
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }
    /// The stat key the index holds for a name: its entry's, or the kept file's.
    pub fn key_of(&self, d: &FileId) -> Option<(StatKey, bool)> {
        self.entries
            .get(d)
            .map(|e| (e.key, true))
            .or_else(|| self.kept.get(d).map(|k| (k.0, false)))
    }
    /// The file name the index knows for an id (its case as on disk).
    pub fn name(&self, d: &FileId) -> Option<String> {
        self.entries
            .get(d)
            .map(|e| e.case)
            .or_else(|| self.kept.get(d).map(|k| k.1))
            .map(|case| name_of(d, case))
    }
    pub fn names(&self) -> impl Iterator<Item = &FileId> {
        self.entries.keys().chain(self.kept.keys())
    }
    fn intern(pool: &mut Vec<Arc<str>>, s: &Arc<str>) -> Arc<str> {
        if let Some(a) = pool.iter().find(|a| ***a == **s) {
            return Arc::clone(a);
        }
        pool.push(Arc::clone(s));
        Arc::clone(s)
    }
    /// Adds or replaces an entry (and forgets a kept file of that name).
    pub fn insert(&mut self, mut e: Entry) {
        e.abi = Self::intern(&mut self.abis, &e.abi);
        e.namespace = e
            .namespace
            .as_ref()
            .map(|n| Self::intern(&mut self.namespaces, n));
        let id = e.id();
        self.kept.remove(&id);
        self.entries.insert(id, e);
        self.table = None;
    }
    /// Remembers a file that is kept but not indexed, by its stat key (and
    /// the case of its name).
    pub fn keep(&mut self, d: FileId, key: StatKey, case: u64) {
        if self.entries.remove(&d).is_some() {
            self.table = None;
        }
        self.kept.insert(d, (key, case));
    }
    /// Forgets a name (entry or kept file); true when it was known.
    pub fn remove(&mut self, d: &FileId) -> bool {
        let was = self.entries.remove(d).is_some();
        if was {
            self.table = None;
        }
        self.kept.remove(d).is_some() || was
    }
    /// Updates an entry after a hit; false when the name is not indexed.
    pub fn set_hit(&mut self, d: &FileId, hits: u32, last_used: u64, key: StatKey) -> bool {
        match self.entries.get_mut(d) {
            Some(e) => {
                e.hits = hits;
                e.last_used = last_used;
                e.key = key;
                true
            }
            None => false,
        }
    }
    /// Sum of the indexed files' sizes.
    pub fn total_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.key.size).sum()
    }
    /// Bytes, files and hits per payload ABI (each model's share of the
    /// directory: `kv ls`, `/metrics`, `/ui`), sorted by ABI, in one pass
    /// over the entries.
    pub fn abi_usage(&self) -> Vec<(Arc<str>, u64, u64, u64)> {
        let mut by: HashMap<&str, (u64, u64, u64)> = HashMap::new();
        for e in self.entries.values() {
            let u = by.entry(&e.abi).or_default();
            u.0 += e.key.size;
            u.1 += 1;
            u.2 += u64::from(e.hits);
        }
        let mut out: Vec<(Arc<str>, u64, u64, u64)> = by
            .into_iter()
            .map(|(abi, (bytes, files, hits))| (Arc::from(abi), bytes, files, hits))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Bytes and files per namespace (None: the default), sorted, in one
    /// pass over the entries: what the tenants' shares are counted from
    /// (the tenant of a namespace is Python's policy, `ds4.keytext`).
    pub fn namespace_usage(&self) -> Vec<(Option<Arc<str>>, u64, u64)> {
        let mut by: HashMap<Option<&str>, (u64, u64)> = HashMap::new();
        for e in self.entries.values() {
            let u = by.entry(e.namespace.as_deref()).or_default();
            u.0 += e.key.size;
            u.1 += 1;
        }
        let mut out: Vec<_> = by
            .into_iter()
            .map(|(ns, (bytes, files))| (ns.map(Arc::from), bytes, files))
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }
    /// An estimate of the heap the index holds (bytes).
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(FileId, Entry)>() + 1;
        let kept = std::mem::size_of::<(FileId, (StatKey, u64))>() + 1;
        let table = self.table.as_ref().map_or(0, |t| {
            t.lens.capacity() * 4
                + t.tails.capacity() * 8
                + t.digests.capacity() * 20
                + t.rows.capacity() * std::mem::size_of::<Row>()
        });
        self.entries.capacity() * entry
            + self.kept.capacity() * kept
            + table
            + self
                .abis
                .iter()
                .chain(&self.namespaces)
                .map(|a| a.len() + 16)
                .sum::<usize>()
            + self.block_bytes()
    }

    /// Brings the names up to date with one listing of `dir` (names and
    /// inode numbers from `readdir`, no `stat`): names gone from the
    /// directory are forgotten; checkpoint names that are new, or whose
    /// inode differs from the indexed one (replaced by a rename), are
    /// returned in `changed` for the caller to stat and index; every other
    /// name is returned in `others` (the caller's temp-file rules).
    pub fn sync_listing(&mut self, dir: &Path) -> Result<Listing> {
        use std::os::unix::fs::DirEntryExt;
        let mut out = Listing::default();
        let mut seen = DigestSet::with_capacity_and_hasher(
            self.entries.len() + self.kept.len(),
            BuildHasherDefault::default(),
        );
        for de in std::fs::read_dir(dir)? {
            let de = de?;
            let name = de.file_name();
            let Some(name) = name.to_str() else { continue };
            match FileId::parse(name) {
                Some(d) => {
                    seen.insert(d);
                    let same_name = self.name(&d).is_some_and(|n| n == name);
                    if !same_name || self.key_of(&d).is_none_or(|(k, _)| k.ino != de.ino()) {
                        out.changed.push(name.to_owned());
                    }
                }
                None => out.others.push(name.to_owned()),
            }
        }
        let before = self.entries.len() + self.kept.len();
        self.entries.retain(|d, _| seen.contains(d));
        self.kept.retain(|d, _| seen.contains(d));
        out.gone = before - self.entries.len() - self.kept.len();
        if out.gone > 0 {
            self.table = None;
        }
        Ok(out)
    }

    /// The lookup's table as the index stands (built when stale).
    pub fn table(&mut self) -> Arc<Table> {
        if self.table.is_none() {
            self.table = Some(Arc::new(Table::build(self)));
        }
        self.table.clone().unwrap_or_default()
    }

    /// Every entry whose name is the SHA-1 of a prefix of `prompt` and that
    /// passes `q`, longest first (then most tokens): the tails filter, then
    /// one SHA-1 pass hashes the prompt at the remaining lengths (a state
    /// finalised per candidate: what a caller that wants them all pays).
    /// [`Index::prefixes`] yields the same entries in the same order, one
    /// at a time, without hashing at lengths it is not asked for.
    pub fn lookup(&mut self, prompt: &[u8], q: &Query<'_>) -> Vec<Entry> {
        let t = self.table();
        let abi = t.abi_id(q.abi);
        let cands: Vec<usize> = (0..t.end_for(prompt.len()))
            .filter(|&i| tail_of(prompt, t.lens[i] as usize) == t.tails[i] && t.passes(i, q, abi))
            .collect();
        let lengths: Vec<usize> = cands.iter().map(|&i| t.lens[i] as usize).collect();
        let digests = hash::sha1_prefixes(prompt, &lengths);
        let mut out: Vec<Entry> = cands
            .iter()
            .zip(digests)
            .filter(|(&i, d)| d.as_ref() == Some(&t.digests[i].digest))
            .filter_map(|(&i, _)| self.entries.get(&t.digests[i]).cloned())
            .collect();
        out.sort_by(|a, b| (b.text_bytes, b.tokens, a.id()).cmp(&(a.text_bytes, a.tokens, b.id())));
        out
    }

    /// A cursor over the entries [`Index::lookup`] would return for
    /// `prompt` and `q`, in its order, hashing nothing yet: each
    /// [`Index::next_prefix`] walks the table down from the longest text
    /// no longer than the prompt and stops at the next match. The first
    /// call hashes the prompt once, up to the longest candidate (one whose
    /// tail and filters pass), keeping the SHA-1 state every
    /// [`super::SNAPSHOT_STRIDE`] bytes; every later candidate is finalised from
    /// the nearest state below it (at most one stride of hashing). So the
    /// best match costs one SHA-1 pass plus one row per longer entry, and
    /// each further match a stride at most, whatever the number of stored
    /// prefixes.
    pub fn prefixes(&mut self, prompt_len: usize, q: &Query<'_>) -> Prefixes {
        let table = self.table();
        Prefixes {
            abi: table.abi_id(q.abi),
            min_tokens: q.min_tokens,
            ctx: q.ctx,
            next: table.end_for(prompt_len),
            prompt_len,
            table,
            snaps: Vec::new(),
            last: None,
        }
    }

    /// The next entry of a cursor made by [`Index::prefixes`] (`prompt`:
    /// the same bytes it was made for); None when there is none. An entry
    /// forgotten since the cursor was made is skipped (its file is gone).
    pub fn next_prefix(&self, cur: &mut Prefixes, prompt: &[u8]) -> Option<Entry> {
        while let Some(d) = cur.next_digest(prompt) {
            if let Some(e) = self.entries.get(&d) {
                return Some(e.clone());
            }
        }
        None
    }

    /// The longest entry of namespace `ns` (None: the default) whose text
    /// is no longer than `limit` bytes, with at least `min_tokens` tokens
    /// and fewer than `ctx`, not named in `exclude`; ties: most tokens,
    /// then the smaller name. Nothing is hashed: it need not be a prefix
    /// of anything (the ladder's divergence, `kvstore/considered.py`). One
    /// row per longer entry of the table, no entry touched but the
    /// winner's length's.
    pub fn longest(
        &mut self,
        limit: usize,
        ns: Option<&str>,
        q: &Query<'_>,
        exclude: &HashSet<String>,
    ) -> Option<Entry> {
        let t = self.table();
        let ns = t.ns_id(ns)?;
        let ok = |i: usize| t.rows[i].ns == ns && t.passes(i, q, None);
        let mut best: Option<(&Entry, String)> = None;
        for i in (0..t.end_for(limit)).rev() {
            if best.as_ref().is_some_and(|(b, _)| t.lens[i] < b.text_bytes) {
                break;
            }
            if !ok(i) {
                continue;
            }
            let Some(e) = self.entries.get(&t.digests[i]) else {
                continue;
            };
            let name = e.name();
            if exclude.contains(&name) {
                continue;
            }
            if best
                .as_ref()
                .is_none_or(|(b, bn)| (e.tokens, bn.as_str()) > (b.tokens, name.as_str()))
            {
                best = Some((e, name));
            }
        }
        best.map(|(e, _)| e.clone())
    }
}

// -- the index file --------------------------------------------------------------
