//! Where a payload lives once verified: a read-only copy-on-write memory map
//! of the file, made under a read [`Lease`] in a slot of the SIGBUS table
//! ([`crate::io::sigbus`]: a page truncated away under the map reads zeros
//! and marks it faulted, never kills the process), or a 64-byte-aligned
//! heap buffer filled with `pread` and checksummed as it is filled (where a
//! lease or a slot cannot be had, or mapping is unsafe). The map is made
//! here; its heap counterpart is the submodule `aligned`.

use crate::error::{Error, Result};
use crate::format::mac::MacState;
use crate::io::{checked_range, read_exact_at, sigbus, Lease};
use std::fs::File;
use std::sync::Mutex;
use xxhash_rust::xxh3::Xxh3;

mod aligned;

pub use aligned::{AlignedBuf, MAP_ABOVE};

pub enum Storage {
    /// A guarded, leased map of the whole file (see [`Lease`]).
    Mmap {
        map: memmap2::Mmap,
        slot: sigbus::Slot,
        lease: Mutex<Option<Lease>>,
    },
    Heap(AlignedBuf),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Mmap { map, .. } => write!(f, "Storage::Mmap({} bytes)", map.len()),
            Storage::Heap(b) => write!(f, "Storage::Heap({} bytes)", b.as_slice().len()),
        }
    }
}

/// What can go wrong with stored bytes after they were verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// A page vanished under the map (the file was truncated): it reads zeros.
    Faulted,
    /// Another process may have written the file while the map was in use.
    Changed,
}

/// Bytes checksummed (and, behind them, dropped from a map) per step: what
/// bounds the memory a verification takes, whatever the header claims.
pub const WINDOW: usize = 8 << 20;
/// Above this many payload bytes, a map's pages are dropped behind the
/// checksum and a copy is verified in a streaming pass before it is made.
pub const STREAM_ABOVE: usize = 32 << 20;

impl Storage {
    /// Maps the whole file under `lease`, in a guarded slot of the SIGBUS
    /// table. `None` when every slot is taken (the caller copies instead:
    /// a map is never unguarded). The caller has verified `file_len`
    /// against the header; an empty file is a (heap) empty buffer.
    pub fn map(file: &File, file_len: u64, lease: Option<Lease>) -> Result<Option<Storage>> {
        if file_len == 0 {
            return Ok(Some(Storage::Heap(AlignedBuf::zeroed(0)?)));
        }
        let len = usize::try_from(file_len).map_err(|_| Error::SizeOverflow)?;
        sigbus::install();
        let Some(slot) = sigbus::Slot::claim() else {
            return Ok(None);
        };
        // SAFETY: a private (copy-on-write), read-only mapping of `len`
        // bytes, the file length we just checked. Writes by other processes
        // show through a private map: under a lease (verify.rs takes one
        // before it checksums) no other process can open the file for
        // writing, and `intact` tells whether the lease held. Truncation is
        // caught by the SIGBUS guard (the slot, published below).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .len(len)
                .map_copy_read_only(file)?
        };
        let _ = map.advise(memmap2::Advice::Sequential);
        // WILLNEED: the kernel reads the file into the page cache ahead of
        // the checksum pass, in large requests, whichever way its pages got
        // there before. (Not MAP_POPULATE: that maps every page at once, and
        // a 2 GiB file would cost 2 GiB of resident memory; see
        // tests/test_bounded_verify.py.)
        let _ = map.advise(memmap2::Advice::WillNeed);
        slot.publish(map.as_ptr() as usize, map.len());
        Ok(Some(Storage::Mmap {
            map,
            slot,
            lease: Mutex::new(lease),
        }))
    }

    /// Reads `len` bytes at `offset` into an aligned heap buffer.
    pub fn pread(file: &File, offset: u64, len: u64, file_len: u64) -> Result<Storage> {
        Storage::copy(file, offset, len, file_len, None, None)
    }

    /// Copies `len` bytes at `offset` into an aligned heap buffer and, with
    /// `checksum`, checks the xxh3-64 of the bytes copied (what is checked is
    /// what is kept, whatever happens to the file meanwhile), and feeds `mac`
    /// (when given) the same copied bytes. Above
    /// [`STREAM_ABOVE`] bytes a first pass checks the file through one
    /// [`WINDOW`]-sized buffer, so a file whose payload is a lie costs no
    /// more memory than that, however large it claims to be.
    pub fn copy(
        file: &File,
        offset: u64,
        len: u64,
        file_len: u64,
        checksum: Option<u64>,
        mut mac: Option<&mut MacState>,
    ) -> Result<Storage> {
        let n = checked_range(offset, len, file_len)?;
        if let Some(stored) = checksum {
            if n > STREAM_ABOVE {
                let computed = stream_checksum(file, offset, n, file_len)?;
                if computed != stored {
                    return Err(Error::PayloadChecksum { stored, computed });
                }
            }
        }
        let mut buf = AlignedBuf::zeroed(n)?;
        let mut h = Xxh3::new();
        let mut at = offset;
        for chunk in buf.as_mut_slice().chunks_mut(WINDOW) {
            read_exact_at(file, chunk, at, file_len)?;
            h.update(chunk);
            if let Some(m) = mac.as_deref_mut() {
                m.update(chunk);
            }
            at += chunk.len() as u64;
        }
        if let Some(stored) = checksum {
            let computed = h.digest();
            if computed != stored {
                return Err(Error::PayloadChecksum { stored, computed });
            }
        }
        Ok(Storage::Heap(buf))
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap { map, .. } => map,
            Storage::Heap(b) => b.as_slice(),
        }
    }

    /// xxh3-64 of `range` of these bytes, one [`WINDOW`] at a time, feeding
    /// `mac` (when given) in the same pass. With `drop_behind`, a map's
    /// pages are given back after each window (they are read again from the
    /// page cache when used), so checking a map takes no more memory than
    /// one window.
    pub fn checksum(
        &self,
        range: std::ops::Range<usize>,
        drop_behind: bool,
        mut mac: Option<&mut MacState>,
    ) -> Option<u64> {
        let bytes = self.bytes().get(range.clone())?;
        let mut h = Xxh3::new();
        let mut at = range.start;
        for w in bytes.chunks(WINDOW) {
            h.update(w);
            if let Some(m) = mac.as_deref_mut() {
                m.update(w);
            }
            if drop_behind {
                if let Storage::Mmap { map, .. } = self {
                    // SAFETY: DONTNEED on a private, read-only file map
                    // only drops page-table entries: the next read refaults
                    // the file's page (nothing of ours was written there).
                    let _ = unsafe {
                        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, w.len())
                    };
                }
            }
            at += w.len();
        }
        Some(h.digest())
    }

    /// True when a page of this map vanished under us (the file was
    /// truncated by someone else): its contents can no longer be trusted.
    pub fn faulted(&self) -> bool {
        match self {
            Storage::Mmap { slot, .. } => slot.faulted(),
            Storage::Heap(_) => false,
        }
    }

    /// `Ok` when everything read from these bytes so far is what was
    /// verified: a copy always is; a map is unless a page vanished
    /// ([`Damage::Faulted`]) or its lease was taken away long enough for a
    /// writer to get through ([`Damage::Changed`]). A released lease checks
    /// nothing more (only truncation is seen after [`Storage::release`]).
    pub fn intact(&self) -> std::result::Result<(), Damage> {
        if self.faulted() {
            return Err(Damage::Faulted);
        }
        if let Storage::Mmap { lease, .. } = self {
            let guard = lease
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(l) = guard.as_ref() {
                if !l.held() {
                    return Err(Damage::Changed);
                }
            }
        }
        Ok(())
    }

    /// Whether this map still holds its lease.
    pub fn leased(&self) -> bool {
        match self {
            Storage::Mmap { lease, .. } => lease
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_some(),
            Storage::Heap(_) => false,
        }
    }

    /// Gives the lease back (writers waiting for it go on). The bytes stay
    /// mapped; from now on only truncation is detected.
    pub fn release(&self) {
        if let Storage::Mmap { lease, .. } = self {
            drop(
                lease
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take(),
            );
        }
    }
}

/// xxh3-64 of `n` bytes of `file` at `offset`, read through one buffer of
/// at most [`WINDOW`] bytes.
fn stream_checksum(file: &File, offset: u64, n: usize, file_len: u64) -> Result<u64> {
    let mut buf = vec![0u8; n.min(WINDOW)];
    let mut h = Xxh3::new();
    let mut at = offset;
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len());
        let chunk = buf.get_mut(..k).ok_or(Error::SizeOverflow)?;
        read_exact_at(file, chunk, at, file_len)?;
        h.update(chunk);
        at += k as u64;
        left -= k;
    }
    Ok(h.digest())
}
