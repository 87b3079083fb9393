//! The store's index: what the headers of a directory's checkpoints say,
//! kept in memory, looked up in one pass over a prompt, and persisted in the
//! directory (docs/FORMAT.md, "The index file").
//!
//! A file enters the index from its header alone ([`read_entry`]: the fixed
//! header and metadata, checked as a load checks them, and the last 8 bytes
//! of its text, the lookup's filter); its text is never hashed here. The
//! index only proposes candidates: every load runs the whole pipeline
//! ([`crate::verify::open`]) again, so an index that lies (stale, torn,
//! foreign, tampered) can cost a miss or a rejected candidate, never a wrong
//! load.
//!
//! Each entry also records its cache namespace ([`namespace_of`]: the key
//! text's preamble, read with the header from the text's first
//! [`NS_READ`] bytes), so the store's eviction policy can tell tenants
//! apart without reading any file again. Like every header fact it is a
//! claim of the file's: the load pipeline verifies the whole text (and the
//! name is its SHA-1), so a lying preamble cannot make a file load for
//! another namespace's prompt; it can only misattribute its own bytes.
//!
//! Lookup ([`Index::lookup`]) keeps the entries' text lengths and tails in
//! two arrays sorted by length: an entry is a candidate when its tail equals
//! the prompt's bytes just before its length (one comparison per entry, no
//! hashing), and only the candidates' lengths are hashed, in one SHA-1 pass
//! ([`crate::hash::sha1_prefixes`]).

use crate::error::{Error, Result};
use crate::format::{self, VERSION_V1};
use crate::hash::{self, Sha1Digest};
use crate::payload;
use crate::verify;
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// What identifies one version of a file: inode, size, mtime (ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatKey {
    pub ino: u64,
    pub size: u64,
    pub mtime_ns: i64,
}

impl StatKey {
    pub fn of(md: &std::fs::Metadata) -> Self {
        StatKey {
            ino: md.ino(),
            size: md.size(),
            mtime_ns: md
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(md.mtime_nsec()),
        }
    }
}

/// One indexed checkpoint: its header facts, its text's tail and the stat
/// key of the version they were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub digest: Sha1Digest,
    pub version: u8,
    pub quant_bits: u8,
    pub reason: u8,
    pub tokens: u32,
    pub hits: u32,
    pub ctx: u32,
    pub text_bytes: u32,
    pub created: u64,
    pub last_used: u64,
    pub abi: Arc<str>,
    /// The cache namespace its text's preamble names (None: the default
    /// namespace, or a text whose start is not a well-formed preamble).
    pub namespace: Option<Arc<str>>,
    /// The last (up to) 8 bytes of the text, little-endian, zero-padded.
    pub tail: u64,
    pub key: StatKey,
    /// Which of the name's 40 hex digits are upper case (bit i: digit i);
    /// 0 for the usual lower-case name. ds4 reads names in either case.
    pub case: u64,
}

/// The bits of [`Entry::case`] for a file name.
pub fn case_of(name: &str) -> u64 {
    name.bytes()
        .take(40)
        .enumerate()
        .filter(|(_, c)| c.is_ascii_uppercase())
        .fold(0, |m, (i, _)| m | (1 << i))
}

/// The file name of a digest whose digits have the case `case`.
pub fn name_of(d: &Sha1Digest, case: u64) -> String {
    let mut hex = hash::to_hex(d).into_bytes();
    for (i, c) in hex.iter_mut().enumerate() {
        if case & (1 << i) != 0 {
            c.make_ascii_uppercase();
        }
    }
    hex.extend_from_slice(b".kv");
    String::from_utf8(hex).unwrap_or_default()
}

/// The last (up to) 8 bytes of `text[..len]` as a little-endian `u64`
/// (zero-padded when `len < 8`); `len <= text.len()`.
pub fn tail_of(text: &[u8], len: usize) -> u64 {
    let mut b = [0u8; 8];
    let start = len.saturating_sub(8);
    if let (Some(src), Some(dst)) = (text.get(start..len), b.get_mut(..len - start)) {
        dst.copy_from_slice(src);
    }
    u64::from_le_bytes(b)
}

/// How many bytes of a text [`read_entry`] reads for its namespace: the
/// longest preamble, `FF 00 "ns:"`, a 128-byte id and `FF 00`.
pub const NS_READ: usize = 5 + NS_ID_MAX + 2;
/// The longest namespace id (`ds4.keytext.NAMESPACE_ID_RE`).
pub const NS_ID_MAX: usize = 128;
const NS_HEAD: &[u8] = b"\xff\x00ns:";
const NS_MARK: &[u8] = b"\xff\x00";

/// Whether `id` is a namespace id: 1 to 128 printable ASCII bytes without
/// spaces (`ds4.keytext.NAMESPACE_ID_RE`).
pub fn is_namespace_id(id: &[u8]) -> bool {
    (1..=NS_ID_MAX).contains(&id.len()) && id.iter().all(|c| (b'!'..=b'~').contains(c))
}

/// The namespace a key text's preamble names (`ds4.keytext.namespace_of`):
/// `FF 00 "ns:" <id> FF 00` at its start. None for the default namespace (no
/// preamble) and for a start that is not a whole, well-formed preamble (no
/// text ds4 writes is that: it is counted as the default namespace's).
pub fn namespace_of(text: &[u8]) -> Option<&str> {
    let rest = text.strip_prefix(NS_HEAD)?;
    let end = rest.windows(2).position(|w| w == NS_MARK)?;
    let id = rest.get(..end)?;
    if is_namespace_id(id) {
        std::str::from_utf8(id).ok()
    } else {
        None
    }
}

/// Indexes one file from its header: the name must be `<sha1>.kv`, the file
/// regular, the header valid (the corrupt checks of a load's header stage);
/// a v2 header's recorded SHA-1 must equal the name. Reads the text's first
/// [`NS_READ`] bytes (its namespace) and last 8 bytes, never the whole text. The stat key is the opened file's.
pub fn read_entry(path: &Path) -> Result<Entry> {
    let digest = verify::digest_from_name(path)?;
    let case = case_of(path.file_name().and_then(|n| n.to_str()).unwrap_or(""));
    let (file, file_len) = verify::open_regular(path, false)?;
    let key = StatKey::of(&file.metadata()?);
    let h = verify::read_header(&file, file_len)?;
    if let Some(stored) = h.text_sha1 {
        if stored != digest {
            return Err(Error::NameMismatch {
                name: hash::to_hex(&digest),
                computed: hash::to_hex(&stored),
            });
        }
    }
    let text_len = u64::from(h.text_bytes);
    let head_len = text_len.min(NS_READ as u64);
    let mut head = vec![0u8; payload::checked_range(h.text_offset, head_len, file_len)?];
    payload::read_exact_at(&file, &mut head, h.text_offset, file_len)?;
    let tail = if text_len <= head_len {
        tail_of(&head, head.len())
    } else {
        let at = h.text_offset + text_len - 8;
        let mut last = [0u8; 8];
        payload::checked_range(at, 8, file_len)?;
        payload::read_exact_at(&file, &mut last, at, file_len)?;
        u64::from_le_bytes(last)
    };
    Ok(Entry {
        digest,
        version: h.version,
        quant_bits: h.quant_bits,
        reason: h.reason,
        tokens: h.tokens,
        hits: h.hits,
        ctx: h.ctx,
        text_bytes: h.text_bytes,
        created: h.created,
        last_used: h.last_used,
        abi: Arc::from(h.abi.as_str()),
        namespace: namespace_of(&head).map(Arc::from),
        tail,
        key,
        case,
    })
}

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

type DigestMap<V> = HashMap<Sha1Digest, V, BuildHasherDefault<DigestHasher>>;
type DigestSet = HashSet<Sha1Digest, BuildHasherDefault<DigestHasher>>;

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
    entries: DigestMap<Entry>,
    kept: DigestMap<(StatKey, u64)>,
    abis: Vec<Arc<str>>,
    namespaces: Vec<Arc<str>>,
    /// (text length, tail, digest), sorted by length; None when stale.
    table: Option<Table>,
}

#[derive(Debug, Default)]
struct Table {
    lens: Vec<u32>,
    tails: Vec<u64>,
    digests: Vec<Sha1Digest>,
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
    pub fn get(&self, d: &Sha1Digest) -> Option<&Entry> {
        self.entries.get(d)
    }
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }
    /// The stat key the index holds for a name: its entry's, or the kept file's.
    pub fn key_of(&self, d: &Sha1Digest) -> Option<(StatKey, bool)> {
        self.entries
            .get(d)
            .map(|e| (e.key, true))
            .or_else(|| self.kept.get(d).map(|k| (k.0, false)))
    }
    /// The file name the index knows for a digest (its case as on disk).
    pub fn name(&self, d: &Sha1Digest) -> Option<String> {
        self.entries
            .get(d)
            .map(|e| e.case)
            .or_else(|| self.kept.get(d).map(|k| k.1))
            .map(|case| name_of(d, case))
    }
    pub fn names(&self) -> impl Iterator<Item = &Sha1Digest> {
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
        self.kept.remove(&e.digest);
        self.entries.insert(e.digest, e);
        self.table = None;
    }
    /// Remembers a file that is kept but not indexed, by its stat key (and
    /// the case of its name).
    pub fn keep(&mut self, d: Sha1Digest, key: StatKey, case: u64) {
        if self.entries.remove(&d).is_some() {
            self.table = None;
        }
        self.kept.insert(d, (key, case));
    }
    /// Forgets a name (entry or kept file); true when it was known.
    pub fn remove(&mut self, d: &Sha1Digest) -> bool {
        let was = self.entries.remove(d).is_some();
        if was {
            self.table = None;
        }
        self.kept.remove(d).is_some() || was
    }
    /// Updates an entry after a hit; false when the name is not indexed.
    pub fn set_hit(&mut self, d: &Sha1Digest, hits: u32, last_used: u64, key: StatKey) -> bool {
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
        let entry = std::mem::size_of::<(Sha1Digest, Entry)>() + 1;
        let kept = std::mem::size_of::<(Sha1Digest, (StatKey, u64))>() + 1;
        let table = self.table.as_ref().map_or(0, |t| {
            t.lens.capacity() * 4 + t.tails.capacity() * 8 + t.digests.capacity() * 20
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
            match name.strip_suffix(".kv").and_then(hash::parse_hex_digest) {
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

    fn table(&mut self) -> &Table {
        self.table.get_or_insert_with(|| {
            let mut rows: Vec<(u32, u64, Sha1Digest)> = self
                .entries
                .values()
                .map(|e| (e.text_bytes, e.tail, e.digest))
                .collect();
            rows.sort_unstable_by_key(|r| r.0);
            Table {
                lens: rows.iter().map(|r| r.0).collect(),
                tails: rows.iter().map(|r| r.1).collect(),
                digests: rows.iter().map(|r| r.2).collect(),
            }
        })
    }

    /// The entries whose name is the SHA-1 of a prefix of `prompt` and that
    /// pass `q`, longest first (then most tokens): the tails filter, then
    /// one SHA-1 pass hashes the prompt at the remaining lengths.
    pub fn lookup(&mut self, prompt: &[u8], q: &Query<'_>) -> Vec<Entry> {
        let t = self.table();
        let end = t.lens.partition_point(|&l| l as usize <= prompt.len());
        let mut cands: Vec<Sha1Digest> = Vec::new();
        for ((&len, &tail), d) in t.lens[..end].iter().zip(&t.tails[..end]).zip(&t.digests) {
            if tail_of(prompt, len as usize) == tail {
                cands.push(*d);
            }
        }
        let hits: Vec<&Entry> = cands
            .iter()
            .filter_map(|d| self.entries.get(d))
            .filter(|e| {
                e.tokens >= q.min_tokens
                    && q.abi
                        .is_none_or(|a| e.version == VERSION_V1 || &*e.abi == a)
                    && q.ctx.is_none_or(|c| e.tokens < c)
            })
            .collect();
        let lengths: Vec<usize> = hits.iter().map(|e| e.text_bytes as usize).collect();
        let digests = hash::sha1_prefixes(prompt, &lengths);
        let mut out: Vec<Entry> = hits
            .into_iter()
            .zip(digests)
            .filter(|(e, d)| d.as_ref() == Some(&e.digest))
            .map(|(e, _)| e.clone())
            .collect();
        out.sort_by(|a, b| {
            (b.text_bytes, b.tokens, a.digest).cmp(&(a.text_bytes, a.tokens, b.digest))
        });
        out
    }
}

// -- the index file --------------------------------------------------------------

/// The index file's magic and version.
pub const INDEX_MAGIC: [u8; 8] = *b"DS4INDEX";
/// Version 2 added the namespaces (a string table and a reference per
/// record); a file of version 1 is rebuilt from the headers.
pub const INDEX_VERSION: u32 = 2;
/// Bytes of the fixed head: magic, version, entry count, ABI count,
/// namespace count, the directory stamp (dev, ino, mtime, scan time).
const HEAD: usize = 8 + 4 + 4 + 4 + 4 + 32;
/// Bytes of one record.
pub const RECORD: usize = 104;
/// A record's namespace reference for the default namespace.
const NO_NAMESPACE: u32 = u32::MAX;
/// An index file larger than this is not read (10 million entries).
pub const MAX_INDEX_FILE: u64 = 1 << 30;

fn bad(what: &str) -> Error {
    Error::BadMetadata(format!("index file: {what}"))
}

fn position_in(pool: &[Arc<str>], s: &Arc<str>) -> u32 {
    pool.iter()
        .position(|x| Arc::ptr_eq(x, s) || **x == **s)
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(u32::MAX)
}

fn put_strings(v: &mut Vec<u8>, pool: &[Arc<str>]) {
    for a in pool {
        v.extend_from_slice(&u32::try_from(a.len()).unwrap_or(u32::MAX).to_le_bytes());
        v.extend_from_slice(a.as_bytes());
    }
}

/// The index's bytes: head, ABI strings, namespace strings, one record per
/// entry and kept file, then an xxh3-64 of everything before it.
pub fn encode(idx: &Index, stamp: &DirStamp) -> Vec<u8> {
    let n = idx.entries.len() + idx.kept.len();
    // only the namespaces some entry still names
    let mut nss: Vec<Arc<str>> = Vec::new();
    for e in idx.entries.values() {
        if let Some(ns) = &e.namespace {
            if position_in(&nss, ns) == u32::MAX {
                nss.push(Arc::clone(ns));
            }
        }
    }
    let mut v = Vec::with_capacity(HEAD + n * RECORD + 64);
    v.extend_from_slice(&INDEX_MAGIC);
    v.extend_from_slice(&INDEX_VERSION.to_le_bytes());
    v.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    v.extend_from_slice(
        &u32::try_from(idx.abis.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    v.extend_from_slice(&u32::try_from(nss.len()).unwrap_or(u32::MAX).to_le_bytes());
    v.extend_from_slice(&stamp.dev.to_le_bytes());
    v.extend_from_slice(&stamp.ino.to_le_bytes());
    v.extend_from_slice(&stamp.mtime_ns.to_le_bytes());
    v.extend_from_slice(&stamp.scanned_ns.to_le_bytes());
    put_strings(&mut v, &idx.abis);
    put_strings(&mut v, &nss);
    for e in idx.entries.values() {
        v.extend_from_slice(&e.digest);
        v.extend_from_slice(&[e.version, e.quant_bits, e.reason, 0]);
        let ns = e
            .namespace
            .as_ref()
            .map_or(NO_NAMESPACE, |s| position_in(&nss, s));
        for x in [
            e.tokens,
            e.hits,
            e.ctx,
            e.text_bytes,
            position_in(&idx.abis, &e.abi),
            ns,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for x in [e.created, e.last_used, e.tail, e.key.ino, e.key.size] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(&e.key.mtime_ns.to_le_bytes());
        v.extend_from_slice(&e.case.to_le_bytes());
    }
    for (d, (k, case)) in &idx.kept {
        v.extend_from_slice(d);
        v.extend_from_slice(&[0, 0, 0, 1]);
        v.extend_from_slice(&[0u8; 24 + 24]);
        v.extend_from_slice(&k.ino.to_le_bytes());
        v.extend_from_slice(&k.size.to_le_bytes());
        v.extend_from_slice(&k.mtime_ns.to_le_bytes());
        v.extend_from_slice(&case.to_le_bytes());
    }
    let sum = xxh3_64(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).ok_or_else(|| bad("truncated"))?;
        let s = self.b.get(self.at..end).ok_or_else(|| bad("truncated"))?;
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes(
            s.try_into().map_err(|_| bad("truncated"))?,
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        let s = self.take(8)?;
        Ok(u64::from_le_bytes(
            s.try_into().map_err(|_| bad("truncated"))?,
        ))
    }
    fn i64(&mut self) -> Result<i64> {
        let s = self.take(8)?;
        Ok(i64::from_le_bytes(
            s.try_into().map_err(|_| bad("truncated"))?,
        ))
    }
}

fn get_strings(
    r: &mut Reader<'_>,
    n: usize,
    max: usize,
    valid: fn(&str) -> bool,
) -> Result<Vec<Arc<str>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u32()? as usize;
        if len > max {
            return Err(bad("string too long"));
        }
        let s = std::str::from_utf8(r.take(len)?).map_err(|_| bad("string not UTF-8"))?;
        if !valid(s) {
            return Err(bad("not a namespace id"));
        }
        out.push(Arc::<str>::from(s));
    }
    Ok(out)
}

/// Parses an index file's bytes: magic, version, exact length, checksum,
/// every count, ABI and namespace reference in bounds, every namespace a
/// valid id, no name twice. Any failure is
/// `bad_metadata` (the caller rebuilds from the headers).
pub fn decode(b: &[u8]) -> Result<(Index, DirStamp)> {
    let body_len = b.len().checked_sub(8).ok_or_else(|| bad("truncated"))?;
    let (body, sum) = b.split_at(body_len);
    let mut r = Reader { b: body, at: 0 };
    if r.take(8)? != INDEX_MAGIC {
        return Err(bad("bad magic"));
    }
    if r.u32()? != INDEX_VERSION {
        return Err(bad("unknown version"));
    }
    if xxh3_64(body).to_le_bytes() != sum {
        return Err(bad("checksum mismatch"));
    }
    let n = r.u32()? as usize;
    let n_abi = r.u32()? as usize;
    let n_ns = r.u32()? as usize;
    let stamp = DirStamp {
        dev: r.u64()?,
        ino: r.u64()?,
        mtime_ns: r.i64()?,
        scanned_ns: r.i64()?,
    };
    if n_abi > format::MAX_TENSORS
        || n_ns > n
        || n.checked_mul(RECORD).is_none_or(|x| x > body.len())
    {
        return Err(bad("counts out of bounds"));
    }
    let abis = get_strings(&mut r, n_abi, format::MAX_ABI, |_| true)?;
    let nss = get_strings(&mut r, n_ns, NS_ID_MAX, |s| is_namespace_id(s.as_bytes()))?;
    let mut idx = Index {
        abis: abis.clone(),
        namespaces: nss.clone(),
        entries: DigestMap::with_capacity_and_hasher(n, BuildHasherDefault::default()),
        ..Index::default()
    };
    for _ in 0..n {
        let digest: Sha1Digest = r.take(20)?.try_into().map_err(|_| bad("truncated"))?;
        let f = r.take(4)?;
        let (version, quant_bits, reason, kind) = (f[0], f[1], f[2], f[3]);
        let (tokens, hits, ctx, text_bytes, abi, ns) =
            (r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (created, last_used, tail) = (r.u64()?, r.u64()?, r.u64()?);
        let key = StatKey {
            ino: r.u64()?,
            size: r.u64()?,
            mtime_ns: r.i64()?,
        };
        let case = r.u64()?;
        if case >> 40 != 0 {
            return Err(bad("case bits beyond the name"));
        }
        if idx.entries.contains_key(&digest) || idx.kept.contains_key(&digest) {
            return Err(bad("a name recorded twice"));
        }
        match kind {
            0 => {
                let abi = abis
                    .get(abi as usize)
                    .cloned()
                    .ok_or_else(|| bad("ABI reference out of bounds"))?;
                let namespace = match ns {
                    NO_NAMESPACE => None,
                    i => Some(
                        nss.get(i as usize)
                            .cloned()
                            .ok_or_else(|| bad("namespace reference out of bounds"))?,
                    ),
                };
                idx.entries.insert(
                    digest,
                    Entry {
                        digest,
                        version,
                        quant_bits,
                        reason,
                        tokens,
                        hits,
                        ctx,
                        text_bytes,
                        created,
                        last_used,
                        abi,
                        namespace,
                        tail,
                        key,
                        case,
                    },
                );
            }
            1 => {
                idx.kept.insert(digest, (key, case));
            }
            _ => return Err(bad("unknown record kind")),
        }
    }
    if r.at != body.len() {
        return Err(bad("trailing bytes"));
    }
    Ok((idx, stamp))
}

/// Reads an index file (a regular file, opened without following a
/// symlink, at most [`MAX_INDEX_FILE`] bytes) and decodes it.
pub fn load(path: &Path) -> Result<(Index, DirStamp)> {
    let (file, len) = verify::open_regular(path, false)?;
    if len > MAX_INDEX_FILE {
        return Err(bad("too large"));
    }
    let mut b = vec![0u8; payload::checked_range(0, len, len)?];
    payload::read_exact_at(&file, &mut b, 0, len)?;
    decode(&b)
}

/// Writes the index durably: `tmp` (created or truncated, never through a
/// symlink, refused when not a regular file, mode 0600), fsync, rename over
/// `path` (refused when `path` exists and is not a regular file: such
/// entries are never replaced), fsync of the directory. The caller holds the
/// directory's lock, so `tmp` has one writer at a time.
pub fn save(idx: &Index, stamp: &DirStamp, path: &Path, tmp: &Path) -> Result<u64> {
    let bytes = encode(idx, stamp);
    let mut f: File = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(tmp)
        .map_err(Error::from_nofollow_open)?;
    if !f.metadata()?.file_type().is_file() {
        return Err(Error::NotRegularFile {
            what: "special file",
        });
    }
    f.set_len(0)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    drop(f);
    match std::fs::symlink_metadata(path) {
        Ok(md) if !md.file_type().is_file() => {
            let _ = std::fs::remove_file(tmp);
            return Err(Error::NotRegularFile {
                what: "not a regular file",
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::Io(e)),
    }
    std::fs::rename(tmp, path)?;
    if let Some(dir) = path.parent() {
        format::writer::sync_dir(dir)?;
    }
    Ok(bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &[u8], tokens: u32, abi: &str) -> Entry {
        Entry {
            digest: hash::sha1(text),
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
        idx.remove(&hash::sha1(&p[..100]));
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
        idx.keep(hash::sha1(b"kept"), StatKey::default(), 1 << 39);
        let stamp = DirStamp {
            dev: 1,
            ino: 2,
            mtime_ns: 3,
            scanned_ns: 4,
        };
        let b = encode(&idx, &stamp);
        let (back, st) = decode(&b).unwrap();
        assert_eq!(st, stamp);
        assert_eq!(back.len(), 5);
        assert_eq!(back.namespaces.len(), 2);
        assert_eq!(back.kept.len(), 1);
        for e in idx.entries() {
            assert_eq!(back.get(&e.digest), Some(e));
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
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
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
        let name_a = format!("{}.kv", hash::to_hex(&a.digest));
        std::fs::write(d.path().join(&name_a), b"x").unwrap();
        let l = back.sync_listing(d.path()).unwrap();
        assert_eq!(l.changed, [name_a]);
        assert_eq!(l.gone, 1);
        let mut others = l.others;
        others.sort();
        assert_eq!(others, [".ds4.index"]);
        assert!(back.get(&b.digest).is_none() && back.get(&a.digest).is_some());
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
}
