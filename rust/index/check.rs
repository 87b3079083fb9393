//! An index read from its file, checked against the files it names
//! ([`Index::check_files`]): what an open does for every record the
//! listing did not already send to a full header read, so that a forged
//! `.ds4.index` (checksum recomputed) cannot attribute a file's bytes to
//! another namespace, nor another size, age or kind, for longer than the
//! open. One open (`O_NOFOLLOW`), one `fstat` and one `pread` of the first
//! 4 KiB per file (a second `pread` only when the ABI or the text's first
//! [`NS_READ`] bytes lie beyond them); the text is not hashed, the
//! metadata not decoded, the header's checksum not computed: what a
//! disagreement sends to [`read_entry`] (the full header read) is what the
//! store re-reads.

use super::{name_of, namespace_of, read_entry, Entry, Index, StatKey, NS_READ};
use crate::error::{Error, Result};
use crate::format::bytes::{byte, le_u16, le_u32, le_u64};
use crate::format::v1::V1_FIXED;
use crate::format::{MAGIC, V2_FIXED, VERSION_V1, VERSION_V2, VERSION_V3};
use crate::io;
use std::borrow::Cow;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// How a file disagrees with its index record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Disagreement {
    /// Another stat key (inode, size, mtime): the file changed since it
    /// was indexed (a hit's `touch` the index file was not written after,
    /// an in-place rewrite), or the record lies about it.
    Changed,
    /// The same stat key, and a fact of the fixed header (version,
    /// quantization, reason, tokens, hits, context, created, last use,
    /// text length; v2/v3: the recorded SHA-1), or the ABI, differs.
    Header,
    /// The same stat key and header facts, another namespace than the
    /// text's preamble names.
    Namespace,
    /// A record of a file kept unindexed whose header indexes.
    Kept,
    /// Not opened or read as a regular file (gone, a symlink, a FIFO,
    /// unreadable, shorter than its header says).
    Unreadable,
}

impl Disagreement {
    /// Its name (`ds4._core.StoreIndex.check_files`).
    pub fn as_str(self) -> &'static str {
        match self {
            Disagreement::Changed => "changed",
            Disagreement::Header => "header",
            Disagreement::Namespace => "namespace",
            Disagreement::Kept => "kept",
            Disagreement::Unreadable => "unreadable",
        }
    }
}

/// Bytes of the first read: the fixed header, the ABI string and, when
/// the metadata is short, the text's start.
const FIRST_READ: usize = 4096;

/// Opens a regular file without following a symlink (or blocking on a
/// FIFO); its length.
fn open_file(path: &Path) -> Result<(File, std::fs::Metadata)> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(Error::from_nofollow_open)?;
    let md = file.metadata()?;
    if !md.file_type().is_file() {
        return Err(Error::NotRegularFile {
            what: "special file",
        });
    }
    Ok((file, md))
}

/// `n` bytes at `off`: from `first` (the file's first bytes) when they are
/// there, else read (one `pread`), refused past `file_len`.
fn bytes_at<'a>(
    file: &File,
    first: &'a [u8],
    off: u64,
    n: usize,
    file_len: u64,
) -> Result<Cow<'a, [u8]>> {
    let end = off.checked_add(n as u64).ok_or(Error::SizeOverflow)?;
    if let Some(b) = usize::try_from(off)
        .ok()
        .zip(usize::try_from(end).ok())
        .and_then(|(a, z)| first.get(a..z))
    {
        return Ok(Cow::Borrowed(b));
    }
    let mut v = vec![0u8; io::checked_range(off, n as u64, file_len)?];
    io::read_exact_at(file, &mut v, off, file_len)?;
    Ok(Cow::Owned(v))
}

/// Whether the fixed header's facts are the entry's (the offsets are
/// the same in v1 and v2/v3: FORMAT.md §1.2, §2.1).
fn same_fixed(h: &[u8], e: &Entry) -> bool {
    byte(h, 3) == e.version
        && byte(h, 4) == e.quant_bits
        && byte(h, 5) == e.reason
        && le_u32(h, 8) == e.tokens
        && le_u32(h, 12) == e.hits
        && le_u32(h, 16) == e.ctx
        && le_u64(h, 24) == e.created
        && le_u64(h, 32) == e.last_used
        && le_u32(h, 48) == e.text_bytes
}

/// Opens `name` in the directory `dir` as [`open_file`] does (`openat`:
/// no walk of the directory's path per file).
fn open_in(dir: &File, name: &str) -> Result<(File, std::fs::Metadata)> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = std::ffi::CString::new(name).map_err(|_| Error::SizeOverflow)?;
    // SAFETY: `dir` is an open descriptor and `c` a NUL-terminated name;
    // the descriptor returned is owned by the `File` made from it.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK,
        )
    };
    if fd < 0 {
        return Err(Error::from_nofollow_open(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    let md = file.metadata()?;
    if !md.file_type().is_file() {
        return Err(Error::NotRegularFile {
            what: "special file",
        });
    }
    Ok((file, md))
}

/// [`check_entry`]'s work on the opened file; an error is
/// [`Disagreement::Unreadable`].
fn check(opened: Result<(File, std::fs::Metadata)>, e: &Entry) -> Result<Option<Disagreement>> {
    let (file, md) = opened?;
    if StatKey::of(&md) != e.key {
        return Ok(Some(Disagreement::Changed));
    }
    let file_len = md.len();
    let mut first = [0u8; FIRST_READ];
    let n = io::checked_range(0, file_len.min(FIRST_READ as u64), file_len)?;
    let first = first.get_mut(..n).ok_or(Error::SizeOverflow)?;
    io::read_exact_at(&file, first, 0, file_len)?;
    let first: &[u8] = first;
    let fixed = match byte(first, 3) {
        VERSION_V1 => V1_FIXED,
        VERSION_V2 | VERSION_V3 => V2_FIXED,
        _ => return Ok(Some(Disagreement::Header)),
    };
    if first.len() < fixed || first.get(..3) != Some(&MAGIC[..]) || !same_fixed(first, e) {
        return Ok(Some(Disagreement::Header));
    }
    let text_offset = if fixed == V2_FIXED {
        if first.get(56..76) != Some(&e.digest[..]) {
            return Ok(Some(Disagreement::Header));
        }
        let abi_len = usize::from(le_u16(first, V2_FIXED));
        let abi = bytes_at(&file, first, V2_FIXED as u64 + 2, abi_len, file_len)?;
        if *abi != *e.abi.as_bytes() {
            return Ok(Some(Disagreement::Header));
        }
        V2_FIXED as u64 + u64::from(le_u32(first, 20))
    } else {
        if !e.abi.is_empty() {
            return Ok(Some(Disagreement::Header));
        }
        V1_FIXED as u64
    };
    let head_len = (e.text_bytes as usize).min(NS_READ);
    let head = bytes_at(&file, first, text_offset, head_len, file_len)?;
    if namespace_of(&head) != e.namespace.as_deref() {
        return Ok(Some(Disagreement::Namespace));
    }
    Ok(None)
}

/// Whether the file at `path` says what its index record `e` says (None),
/// or how it disagrees: its stat key, then its fixed header's facts, its
/// ABI and (v2/v3) the SHA-1 it records, then the namespace its text's
/// preamble names (the text's first [`NS_READ`] bytes). Not checked: the
/// header's checksum, the metadata past the ABI and the text's tail (the
/// lookup's filter: a wrong one costs a miss), all of which a load checks.
pub fn check_entry(path: &Path, e: &Entry) -> Option<Disagreement> {
    check(open_file(path), e).unwrap_or(Some(Disagreement::Unreadable))
}

/// Whether a file recorded as kept unindexed (stat key `key`) is one:
/// another stat key is [`Disagreement::Changed`], a header that indexes
/// [`Disagreement::Kept`] (a full header read: kept files are few).
fn check_kept(path: &Path, key: StatKey) -> Option<Disagreement> {
    let Ok((_file, md)) = open_file(path) else {
        return Some(Disagreement::Unreadable);
    };
    if StatKey::of(&md) != key {
        return Some(Disagreement::Changed);
    }
    read_entry(path).is_ok().then_some(Disagreement::Kept)
}

impl Index {
    /// Every record whose file in `dir` disagrees with it ([`check_entry`];
    /// a kept file's record: [`check_kept`]), by file name, with how.
    /// Nothing is changed: the caller reads the names again from their
    /// headers. Files are checked on up to `threads` threads (at least 1).
    pub fn check_files(&self, dir: &Path, threads: usize) -> Vec<(String, Disagreement)> {
        let entries: Vec<&Entry> = self.entries.values().collect();
        let dirf = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(dir);
        let dirf = dirf.as_ref().ok();
        let chunk = entries.len().div_ceil(threads.max(1)).max(256);
        let mut out: Vec<(String, Disagreement)> = std::thread::scope(|s| {
            let jobs: Vec<_> = entries
                .chunks(chunk)
                .map(|part| {
                    s.spawn(move || {
                        part.iter()
                            .filter_map(|e| {
                                let name = e.name();
                                let opened = match dirf {
                                    Some(df) => open_in(df, &name),
                                    None => open_file(&dir.join(&name)),
                                };
                                check(opened, e)
                                    .unwrap_or(Some(Disagreement::Unreadable))
                                    .map(|d| (name, d))
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            jobs.into_iter()
                .flat_map(|j| j.join().unwrap_or_default())
                .collect()
        });
        for (id, (key, case)) in &self.kept {
            let name = name_of(id, *case);
            if let Some(d) = check_kept(&dir.join(&name), *key) {
                out.push((name, d));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
