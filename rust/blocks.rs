//! Block files on disk (FORMAT.md §7): the durable write of one, the checks
//! of one file (against its table record, or on its own for `ds4 kv ls`);
//! a manifest's whole table is verified in [`crate::blocks_open`].
//!
//! Blocks are read with plain reads (`pread`) and hashed as they are read,
//! never mapped: a block file is shared by many checkpoints and may be
//! written again under its name by another save; the bytes verified are the
//! bytes the caller gets.

pub use crate::blocks_open::{open_blocks, open_blocks_into, Failure, Run, Target};
use crate::error::{Error, Result};
use crate::format::block::{
    self, BlockHeader, BlockName, BLOCK_HEADER, BLOCK_MAC_BYTES, MAX_BLOCK_PAYLOAD,
};
use crate::format::block_table::Record;
use crate::format::mac::MacKey;
use crate::format::writer::temp_name;
use crate::hash::to_hex;
use crate::io::{open_regular, read_exact_at};
use crate::name::{model_tag, ModelTag};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Bytes read (and hashed) at a time.
const CHUNK: usize = 1 << 20;

/// The block file a writer produced.
#[derive(Debug, Clone)]
pub struct BlockWritten {
    pub path: PathBuf,
    pub file_len: u64,
    /// xxh3-64 of the payload (the table record's checksum).
    pub checksum: u64,
}

/// Writes the block `name` of `n_tokens` tokens durably as
/// `dir/<hex>.kvb`: a 0600 temp file in `dir` ([`temp_name`]), the header,
/// the payload, the MAC when `key` is given, fsync, rename. The directory
/// is not fsynced (a save writes many blocks and syncs it once). On any
/// error the temp file is removed.
pub fn write_block(
    dir: &Path,
    name: &BlockName,
    n_tokens: u32,
    abi: &str,
    payload: &[u8],
    key: Option<&MacKey>,
) -> Result<BlockWritten> {
    if n_tokens == 0 {
        return Err(Error::BadMetadata(
            "a block holds at least one token".to_owned(),
        ));
    }
    let payload_len = payload.len() as u64;
    if payload_len > MAX_BLOCK_PAYLOAD {
        return Err(Error::HeaderTooLarge {
            what: "block payload",
            len: payload_len,
            max: MAX_BLOCK_PAYLOAD,
        });
    }
    let checksum = xxh3_64(payload);
    let head = block::encode_header(
        name,
        n_tokens,
        &model_tag(abi),
        payload_len,
        checksum,
        key.is_some(),
    );
    let tag = key.map(|k| {
        let mut m = block::mac_state(k, &head);
        m.update(payload);
        *m.finalize().as_bytes()
    });
    let total = block::file_len(payload_len, key.is_some());
    let final_name = block::file_name(name);
    let path = dir.join(&final_name);
    let tmp = dir.join(temp_name(&final_name));
    let res = (|| -> Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        file.write_all(&head)?;
        file.write_all(payload)?;
        if let Some(t) = &tag {
            file.write_all(t)?;
        }
        let written = file.metadata()?.len();
        if written != total {
            return Err(Error::Io(std::io::Error::other(format!(
                "wrote {written} bytes, expected {total}"
            ))));
        }
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, &path)?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(BlockWritten {
        path,
        file_len: total,
        checksum,
    })
}

/// What a block file must be besides what its own header's checks ask.
#[derive(Default, Clone, Copy)]
pub(crate) struct Expect<'a> {
    pub(crate) name: Option<&'a BlockName>,
    pub(crate) abi_tag: Option<ModelTag>,
    pub(crate) record: Option<&'a Record>,
    pub(crate) key: Option<&'a MacKey>,
}

fn corrupt(block: &str, detail: String) -> Error {
    Error::BlockCorrupt {
        block: block.to_owned(),
        detail,
    }
}

/// A read that met the end of a file which shrank under it is `block_short`.
fn short(e: Error, block: &str) -> Error {
    match e {
        Error::Truncated { expected, actual } => Error::BlockShort {
            block: block.to_owned(),
            detail: format!("the file ends at {actual} bytes, before {expected}"),
        },
        e => e,
    }
}

/// A missing path is `block_missing`, an entry that is not a regular file
/// (a symlink, a directory) `block_corrupt`; other failures stay I/O errors.
fn not_there(e: Error, path: &Path, block: &str) -> Error {
    match e {
        Error::Io(io) if io.kind() == std::io::ErrorKind::NotFound => Error::BlockMissing {
            block: block.to_owned(),
            detail: format!("no file {}", path.display()),
        },
        Error::NotRegularFile { what } => corrupt(block, format!("not a regular file: {what}")),
        e => e,
    }
}

/// The table's first check of a block, before anything is read or
/// allocated: `lstat` finds a regular file of the length the record's
/// payload makes (with or without a MAC trailer).
pub(crate) fn stat_block(path: &Path, r: &Record, block: &str) -> Result<()> {
    let md = fs::symlink_metadata(path).map_err(|e| not_there(e.into(), path, block))?;
    if !md.file_type().is_file() {
        let what = if md.file_type().is_symlink() {
            "symlink"
        } else if md.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(corrupt(block, format!("not a regular file: {what}")));
    }
    let (bare, keyed) = (
        block::file_len(r.payload_len, false),
        block::file_len(r.payload_len, true),
    );
    if md.len() != bare && md.len() != keyed {
        return Err(Error::BlockShort {
            block: block.to_owned(),
            detail: format!(
                "the file is {} bytes, the table's {} payload bytes make {bare} ({keyed} with a MAC)",
                md.len(),
                r.payload_len
            ),
        });
    }
    Ok(())
}

/// Opens a block file (no symlink followed) and checks its header.
fn open_header(path: &Path, block: &str) -> Result<(File, [u8; BLOCK_HEADER], BlockHeader)> {
    let (file, file_len) = open_regular(path, false).map_err(|e| not_there(e, path, block))?;
    let mut head = [0u8; BLOCK_HEADER];
    let n = usize::try_from(file_len.min(BLOCK_HEADER as u64)).unwrap_or(0);
    let part = head.get_mut(..n).unwrap_or_default();
    read_exact_at(&file, part, 0, file_len).map_err(|e| short(e, block))?;
    let h = block::parse_header(head.get(..n).unwrap_or_default(), file_len, block)?;
    Ok((file, head, h))
}

/// The header's claims against what the caller expects.
fn check_claims(h: &BlockHeader, x: Expect<'_>, block: &str) -> Result<()> {
    if let Some(n) = x.name.filter(|&n| *n != h.name) {
        return Err(Error::BlockName {
            block: block.to_owned(),
            detail: format!(
                "its header names block {} (expected {})",
                to_hex(&h.name),
                to_hex(n)
            ),
        });
    }
    if let Some(t) = x.abi_tag.filter(|t| *t != h.abi_tag) {
        return Err(Error::BlockAbi {
            block: block.to_owned(),
            detail: format!("ABI tag {}, expected {}", to_hex(&h.abi_tag), to_hex(&t)),
        });
    }
    if let Some(r) = x
        .record
        .filter(|r| r.n_tokens != h.n_tokens || r.payload_len != h.payload_len)
    {
        return Err(corrupt(
            block,
            format!(
                "the header says {} tokens in {} bytes, the table {} tokens in {} bytes",
                h.n_tokens, h.payload_len, r.n_tokens, r.payload_len
            ),
        ));
    }
    Ok(())
}

/// Where a block's payload goes as it is read and hashed.
pub(crate) enum Sink<'s> {
    /// Nowhere: read through a small scratch buffer, a check only.
    None,
    /// A buffer of the payload's length, read into directly.
    Whole(&'s mut [u8]),
    /// Each piece handed on as soon as it is read and hashed, from a small
    /// scratch buffer that is still in cache (a scatter to its places).
    Each(&'s mut dyn FnMut(&[u8]) -> Result<()>),
}

/// The piece of a payload read through a scratch buffer at a time: small
/// enough to stay in a core's cache between its read, hash and copy.
const SCRATCH_CHUNK: usize = 256 << 10;

/// Reads the payload (into the sink's buffer, or through a scratch buffer
/// whose pieces an `Each` sink receives), hashing it as it is read; checks
/// its xxh3 against the header and the record, and the MAC when a key is
/// given. An `Each` sink may have received bytes when a check fails.
fn check_payload(
    file: &File,
    head: &[u8; BLOCK_HEADER],
    h: &BlockHeader,
    x: Expect<'_>,
    sink: Sink<'_>,
    block: &str,
) -> Result<()> {
    let file_len = h.file_len();
    let len = usize::try_from(h.payload_len).map_err(|_| Error::SizeOverflow)?;
    let (mut whole, mut each) = match sink {
        Sink::None => (None, None),
        Sink::Whole(s) => (Some(s), None),
        Sink::Each(f) => (None, Some(f)),
    };
    let step = if whole.is_some() {
        CHUNK
    } else {
        SCRATCH_CHUNK
    };
    let mut scratch = if whole.is_some() {
        Vec::new()
    } else {
        vec![0u8; len.min(step)]
    };
    let mut xx = Xxh3::new();
    let mut mac = x.key.map(|k| block::mac_state(k, head));
    let mut off = 0usize;
    while off < len {
        let n = step.min(len - off);
        let buf = match whole.as_deref_mut() {
            Some(s) => s.get_mut(off..off + n),
            None => scratch.get_mut(..n),
        }
        .ok_or(Error::SizeOverflow)?;
        read_exact_at(file, buf, BLOCK_HEADER as u64 + off as u64, file_len)
            .map_err(|e| short(e, block))?;
        xx.update(buf);
        if let Some(m) = mac.as_mut() {
            m.update(buf);
        }
        if let Some(f) = each.as_mut() {
            f(buf)?;
        }
        off += n;
    }
    let computed = xx.digest();
    let recorded = x.record.map_or(h.checksum, |r| r.checksum);
    if computed != h.checksum || computed != recorded {
        return Err(Error::BlockChecksum {
            block: block.to_owned(),
            detail: format!(
                "payload checksum {computed:016x}, the header records {:016x}, the table {recorded:016x}",
                h.checksum
            ),
        });
    }
    if let Some(m) = mac {
        let mut stored = [0u8; BLOCK_MAC_BYTES];
        read_exact_at(
            file,
            &mut stored,
            file_len - BLOCK_MAC_BYTES as u64,
            file_len,
        )
        .map_err(|e| short(e, block))?;
        // blake3::Hash's equality is constant-time.
        if m.finalize() != blake3::Hash::from_bytes(stored) {
            return Err(Error::BlockMac {
                block: block.to_owned(),
            });
        }
    }
    Ok(())
}

/// Every check of one block file, in order: the entry, the header, its
/// claims, the MAC's presence with a key, the payload's checksum, the MAC.
pub(crate) fn verify_file(
    path: &Path,
    x: Expect<'_>,
    sink: Sink<'_>,
    block: &str,
) -> Result<BlockHeader> {
    let (file, head, h) = open_header(path, block)?;
    check_claims(&h, x, block)?;
    if x.key.is_some() && !h.authenticated {
        return Err(Error::BlockMacMissing {
            block: block.to_owned(),
        });
    }
    check_payload(&file, &head, &h, x, sink, block)?;
    Ok(h)
}

/// The hex name a block file's name spells, or "" when it spells none.
fn label_of(path: &Path) -> (Option<BlockName>, String) {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(block::parse_file_name);
    (name, name.map(|n| to_hex(&n)).unwrap_or_default())
}

/// A block file's header, with the header's own checks only (the entry,
/// magic, version, flags, reserved bytes, header checksum, file length):
/// what `ds4 kv ls` shows. The payload is not read.
pub fn read_block_header(path: &Path) -> Result<BlockHeader> {
    let (_, label) = label_of(path);
    open_header(path, &label).map(|(_, _, h)| h)
}

/// Every check of one block file on its own: the header's, its name
/// against the file's name (`<hex>.kvb`), the ABI tag when `abi` is given,
/// the payload checksum, and the MAC when `key` is given. The payload is
/// read in chunks, not kept.
pub fn verify_block(path: &Path, abi: Option<&str>, key: Option<&MacKey>) -> Result<BlockHeader> {
    let (name, label) = label_of(path);
    let Some(name) = name else {
        let (_, _, h) = open_header(path, &label)?;
        return Err(Error::BlockName {
            block: to_hex(&h.name),
            detail: format!("the file name {} is not <64 hex>.kvb", path.display()),
        });
    };
    let x = Expect {
        name: Some(&name),
        abi_tag: abi.map(model_tag),
        record: None,
        key,
    };
    verify_file(path, x, Sink::None, &label)
}
