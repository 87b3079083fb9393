//! The file primitives every reader of a checkpoint or block file stands
//! on: opening a regular file without following a symlink, bounded reads
//! (every size checked against the file's real length before anything is
//! allocated), and the kernel's guards of a mapped or shared file: the read
//! [`Lease`] ([`lease`]), the SIGBUS guard of mapped pages ([`sigbus`]) and
//! the advisory `flock` ([`lock`]).

use crate::error::{Error, Result};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

pub mod lease;
pub mod lock;
pub mod sigbus;

pub use lease::Lease;
pub use lock::FileLock;

/// Opens a file for reading without following a final symlink, and checks
/// that what was opened is a regular file.
pub fn open_regular(path: &Path, write: bool) -> Result<(File, u64)> {
    let md = std::fs::symlink_metadata(path)?;
    let ft = md.file_type();
    if ft.is_symlink() {
        return Err(Error::NotRegularFile { what: "symlink" });
    }
    if ft.is_dir() {
        return Err(Error::NotRegularFile { what: "directory" });
    }
    if !ft.is_file() {
        return Err(Error::NotRegularFile {
            what: "special file",
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(Error::from_nofollow_open)?;
    let md = file.metadata()?; // the file we actually hold (no TOCTOU)
    if !md.file_type().is_file() {
        return Err(Error::NotRegularFile {
            what: "special file",
        });
    }
    Ok((file, md.len()))
}

/// `len` bytes of `file` at `offset`, in a new buffer (the range checked
/// against `file_len` before it is allocated).
pub(crate) fn pread_vec(file: &File, offset: u64, len: u64, file_len: u64) -> Result<Vec<u8>> {
    // Callers have checked offset+len <= file_len; re-checked before allocating.
    let mut v = vec![0u8; checked_range(offset, len, file_len)?];
    read_exact_at(file, &mut v, offset, file_len)?;
    Ok(v)
}

/// `len` as a buffer size, once `offset + len` is known to lie within a file
/// of `file_len` bytes (checked before anything is allocated).
pub(crate) fn checked_range(offset: u64, len: u64, file_len: u64) -> Result<usize> {
    let end = offset.checked_add(len).ok_or(Error::SizeOverflow)?;
    if end > file_len {
        return Err(Error::Truncated {
            expected: end,
            actual: file_len,
        });
    }
    usize::try_from(len).map_err(|_| Error::SizeOverflow)
}

/// Fills `buf` from `offset`; a file that shrank under us (EOF before the
/// end) is `Truncated` against the length it had.
pub(crate) fn read_exact_at(file: &File, buf: &mut [u8], offset: u64, file_len: u64) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Truncated {
                expected: offset + buf.len() as u64,
                actual: file_len,
            }
        } else {
            Error::Io(e)
        }
    })
}
