//! Where a payload lives once verified: a read-only copy-on-write memory map
//! of the file, or a 64-byte-aligned heap buffer filled with `pread` (for
//! filesystems where mapping is unsafe). All `unsafe` for mapping is here.

use crate::error::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct Block([u8; 64]);

pub enum Storage {
    Mmap(memmap2::Mmap),
    Heap { blocks: Vec<Block>, len: usize },
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Mmap(m) => write!(f, "Storage::Mmap({} bytes)", m.len()),
            Storage::Heap { len, .. } => write!(f, "Storage::Heap({len} bytes)"),
        }
    }
}

impl Storage {
    /// Maps the whole file. The caller has verified `file_len` against the
    /// header; an empty file is never mapped.
    pub fn map(file: &File, file_len: u64) -> Result<Storage> {
        if file_len == 0 {
            return Ok(Storage::Heap { blocks: Vec::new(), len: 0 });
        }
        let len = usize::try_from(file_len).map_err(|_| Error::SizeOverflow)?;
        // SAFETY: a private (copy-on-write), read-only mapping: writes by
        // other processes to the file may still show through, which is why
        // checkpoints are only ever replaced by rename, never written in
        // place (except the mutable hit fields, which are not part of the
        // payload). Bounds: `len` is the file length we just checked.
        let m = unsafe { memmap2::MmapOptions::new().len(len).map_copy_read_only(file)? };
        #[cfg(unix)]
        {
            let _ = m.advise(memmap2::Advice::Sequential);
        }
        Ok(Storage::Mmap(m))
    }

    /// Reads `len` bytes at `offset` into an aligned heap buffer.
    pub fn pread(file: &File, offset: u64, len: u64, file_len: u64) -> Result<Storage> {
        let end = offset.checked_add(len).ok_or(Error::SizeOverflow)?;
        if end > file_len {
            return Err(Error::Truncated { expected: end, actual: file_len });
        }
        let len = usize::try_from(len).map_err(|_| Error::SizeOverflow)?;
        let mut blocks = vec![Block([0; 64]); len.div_ceil(64)];
        // SAFETY: `blocks` is a contiguous allocation of at least `len` bytes
        // of plain `u8`s; the slice does not outlive it.
        let buf = unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr() as *mut u8, len) };
        file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Error::Truncated { expected: end, actual: file_len }
            } else {
                Error::Io(e)
            }
        })?;
        Ok(Storage::Heap { blocks, len })
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            // SAFETY: as in `pread`: `len` bytes of initialised u8s.
            Storage::Heap { blocks, len } => unsafe { std::slice::from_raw_parts(blocks.as_ptr() as *const u8, *len) },
        }
    }
}
