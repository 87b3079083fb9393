//! The index file (docs/FORMAT.md, "The index file"): [`encode`],
//! [`decode`] (read with the format's one [`Cursor`]), [`load`], [`save`].

use super::blocks::{decode_blocks, encode_blocks};
use super::{is_namespace_id, DigestMap, DirStamp, Entry, Index, StatKey, NS_ID_MAX};
use crate::error::{Error, Result};
use crate::format;
use crate::format::bytes::Cursor;
use crate::hash::Sha1Digest;
use crate::io;
use crate::name::FileId;
use std::fs::{File, OpenOptions};
use std::hash::BuildHasherDefault;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use xxhash_rust::xxh3::xxh3_64;

/// The index file's magic and version.
pub const INDEX_MAGIC: [u8; 8] = *b"DS4INDEX";
/// Version 2 added the namespaces (a string table and a reference per
/// record), version 3 the per-model names (a record's model tag), version 4
/// the block section (which blocks each manifest names); a file of an
/// earlier version is rebuilt from the headers.
pub const INDEX_VERSION: u32 = 4;
/// Bytes of the fixed head: magic, version, entry count, ABI count,
/// namespace count, the directory stamp (dev, ino, mtime, scan time).
const HEAD: usize = 8 + 4 + 4 + 4 + 4 + 32;
/// Bytes of one record.
pub const RECORD: usize = 112;
/// A record's kind byte: bit 0, a kept file (not an entry); bit 1, the
/// name carries a model tag (the record's last 8 bytes).
const KIND_KEPT: u8 = 1;
const KIND_TAGGED: u8 = 2;
/// A record's namespace reference for the default namespace.
const NO_NAMESPACE: u32 = u32::MAX;
/// An index file larger than this is not read (10 million entries).
pub const MAX_INDEX_FILE: u64 = 1 << 30;

pub(super) fn bad(what: &str) -> Error {
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

/// A record's kind byte for a name's tag and `base` (0 or [`KIND_KEPT`]).
fn kind_of(model: Option<[u8; 8]>, base: u8) -> u8 {
    base | if model.is_some() { KIND_TAGGED } else { 0 }
}

/// The index's bytes: head, ABI strings, namespace strings, one record per
/// entry and kept file, the block section, then an xxh3-64 of everything
/// before it.
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
        v.extend_from_slice(&[e.version, e.quant_bits, e.reason, kind_of(e.model, 0)]);
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
        v.extend_from_slice(&e.model.unwrap_or_default());
    }
    for (d, (k, case)) in &idx.kept {
        v.extend_from_slice(&d.digest);
        v.extend_from_slice(&[0, 0, 0, kind_of(d.model, KIND_KEPT)]);
        v.extend_from_slice(&[0u8; 24 + 24]);
        v.extend_from_slice(&k.ino.to_le_bytes());
        v.extend_from_slice(&k.size.to_le_bytes());
        v.extend_from_slice(&k.mtime_ns.to_le_bytes());
        v.extend_from_slice(&case.to_le_bytes());
        v.extend_from_slice(&d.model.unwrap_or_default());
    }
    encode_blocks(idx.entries.values(), &mut v);
    let sum = xxh3_64(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

/// Every short read of an index file is one error (the caller rebuilds
/// from the headers).
fn truncated(_: &str) -> Error {
    bad("truncated")
}

fn get_strings(
    r: &mut Cursor<'_, fn(&str) -> Error>,
    n: usize,
    max: usize,
    valid: fn(&str) -> bool,
) -> Result<Vec<Arc<str>>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u32("index")? as usize;
        if len > max {
            return Err(bad("string too long"));
        }
        let s = std::str::from_utf8(r.take(len, "index")?).map_err(|_| bad("string not UTF-8"))?;
        if !valid(s) {
            return Err(bad("not a namespace id"));
        }
        out.push(Arc::<str>::from(s));
    }
    Ok(out)
}

/// Entry `i` of a record's string table (`what`: the table's name).
fn referenced(pool: &[Arc<str>], i: u32, what: &str) -> Result<Arc<str>> {
    pool.get(i as usize)
        .cloned()
        .ok_or_else(|| bad(&format!("{what} reference out of bounds")))
}

/// A record's last fields, `case` and `tag`, with its digest and kind: the
/// name it records (its [`FileId`]) and the name's case bits.
fn name_tail(
    r: &mut Cursor<'_, fn(&str) -> Error>,
    digest: Sha1Digest,
    kind: u8,
) -> Result<(FileId, u64)> {
    let case = r.u64("index")?;
    if case >> 40 != 0 {
        return Err(bad("case bits beyond the name"));
    }
    let tag: [u8; 8] = r
        .take(8, "index")?
        .try_into()
        .map_err(|_| bad("truncated"))?;
    if kind & KIND_TAGGED == 0 && tag != [0; 8] {
        return Err(bad("a model tag on an untagged name"));
    }
    let model = (kind & KIND_TAGGED != 0).then_some(tag);
    Ok((FileId { digest, model }, case))
}

/// Parses an index file's bytes: magic, version, exact length, checksum,
/// every count, ABI, namespace and block reference in bounds, every
/// namespace a valid id, no name twice, no record's blocks twice. Any failure is
/// `bad_metadata` (the caller rebuilds from the headers).
pub fn decode(b: &[u8]) -> Result<(Index, DirStamp)> {
    let body_len = b.len().checked_sub(8).ok_or_else(|| bad("truncated"))?;
    let (body, sum) = b.split_at(body_len);
    let mut r = Cursor::new(body, truncated as fn(&str) -> Error);
    if r.take(8, "index")? != INDEX_MAGIC {
        return Err(bad("bad magic"));
    }
    if r.u32("index")? != INDEX_VERSION {
        return Err(bad("unknown version"));
    }
    if xxh3_64(body).to_le_bytes() != sum {
        return Err(bad("checksum mismatch"));
    }
    let n = r.u32("index")? as usize;
    let n_abi = r.u32("index")? as usize;
    let n_ns = r.u32("index")? as usize;
    let stamp = DirStamp {
        dev: r.u64("index")?,
        ino: r.u64("index")?,
        mtime_ns: r.i64("index")?,
        scanned_ns: r.i64("index")?,
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
    let mut order: Vec<FileId> = Vec::with_capacity(n);
    for _ in 0..n {
        let digest: Sha1Digest = r
            .take(20, "index")?
            .try_into()
            .map_err(|_| bad("truncated"))?;
        let f = r.take(4, "index")?;
        let (version, quant_bits, reason, kind) = (f[0], f[1], f[2], f[3]);
        let mut u = [0u32; 6];
        for x in &mut u {
            *x = r.u32("index")?;
        }
        let [tokens, hits, ctx, text_bytes, abi, ns] = u;
        let (created, last_used, tail) = (r.u64("index")?, r.u64("index")?, r.u64("index")?);
        let key = StatKey {
            ino: r.u64("index")?,
            size: r.u64("index")?,
            mtime_ns: r.i64("index")?,
        };
        let (digest, case) = name_tail(&mut r, digest, kind)?;
        if idx.entries.contains_key(&digest) || idx.kept.contains_key(&digest) {
            return Err(bad("a name recorded twice"));
        }
        match kind & !KIND_TAGGED {
            0 => {
                let abi = referenced(&abis, abi, "ABI")?;
                let namespace = match ns {
                    NO_NAMESPACE => None,
                    i => Some(referenced(&nss, i, "namespace")?),
                };
                order.push(digest);
                idx.entries.insert(
                    digest,
                    Entry {
                        digest: digest.digest,
                        model: digest.model,
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
                        blocks: None,
                    },
                );
            }
            KIND_KEPT => {
                idx.kept.insert(digest, (key, case));
            }
            _ => return Err(bad("unknown record kind")),
        }
    }
    decode_blocks(&mut r, &order, &mut idx)?;
    if r.remaining() != 0 {
        return Err(bad("trailing bytes"));
    }
    Ok((idx, stamp))
}

/// Reads an index file (a regular file, opened without following a
/// symlink, at most [`MAX_INDEX_FILE`] bytes) and decodes it.
pub fn load(path: &Path) -> Result<(Index, DirStamp)> {
    let (file, len) = io::open_regular(path, false)?;
    if len > MAX_INDEX_FILE {
        return Err(bad("too large"));
    }
    let mut b = vec![0u8; io::checked_range(0, len, len)?];
    io::read_exact_at(&file, &mut b, 0, len)?;
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
mod tests;
