//! Where a payload lives once verified: a read-only copy-on-write memory map
//! of the file, made under a read [`Lease`] in a slot of the SIGBUS table,
//! or a 64-byte-aligned heap buffer filled with `pread` and checksummed as
//! it is filled (where a lease or a slot cannot be had, or mapping is
//! unsafe). All `unsafe` for mapping is here and in its two submodules:
//! `aligned` (the heap buffer) and `sigbus` (the guard of mapped pages).
//!
//! ## SIGBUS
//! If another process truncates a file while we have it mapped, touching a
//! page past the new end raises SIGBUS, which would kill the process. A map
//! is made only in a claimed slot of a fixed table (none free: the payload
//! is copied instead); a SIGBUS handler that finds
//! the faulting address inside a registered map replaces that page with a
//! zero page (so the access completes) and marks the map *faulted*. Every
//! consumer checks [`Storage::faulted`] after reading (the payload checksum
//! would also catch the zeros): a faulted checkpoint is reported as
//! truncated and never used. Faults outside our maps go to the previous
//! handler (or the default action), exactly as if ds4 were not there.

use crate::error::{Error, Result};
use crate::format::mac::MacState;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::Mutex;
use xxhash_rust::xxh3::Xxh3;

mod aligned;
pub mod sigbus;

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

/// A read lease (`F_SETLEASE`, `F_RDLCK`) on an open file: while it is held,
/// no other process can open the file for writing or truncate it. The
/// kernel grants it only when nobody has the file open for writing (a
/// writable shared map included), and only to the file's owner (or with
/// `CAP_LEASE`). A writer that opens the file later *breaks* the lease: its
/// `open` waits until the lease is given back, or until
/// `/proc/sys/fs/lease-break-time` seconds have passed. So the bytes of a
/// leased file cannot change while [`Lease::held`] is true: the lease is
/// either intact, or broken less than the break time ago (the writer still
/// waits). Nothing in user space can fake that: the kernel keeps the lease.
///
/// A break is announced by a signal to the lease's owner; the lease is set
/// to send `SIGURG` (ignored by default) and then has no owner, so no signal
/// is sent at all.
pub struct Lease {
    file: File,
    since_ns: u128,
    break_secs: u64,
}

impl Lease {
    /// Takes a read lease on `file`, or `None` when the kernel refuses it
    /// (someone has the file open for writing, we do not own it, or the
    /// filesystem has no leases).
    pub fn take(file: &File) -> Option<Lease> {
        let break_secs = lease_break_secs()?;
        let file = file.try_clone().ok()?; // the same open file description
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a valid descriptor with integer arguments.
        unsafe {
            if libc::fcntl(fd, F_SETSIG, libc::SIGURG) != 0 {
                return None;
            }
            if libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) != 0 {
                return None;
            }
            libc::fcntl(fd, libc::F_SETOWN, 0);
        }
        Some(Lease {
            file,
            since_ns: boottime_ns()?,
            break_secs,
        })
    }

    /// True while no writer can have got through: the lease is intact, or
    /// its break began less than the break time ago (a second of margin).
    pub fn held(&self) -> bool {
        // SAFETY: fcntl on a descriptor we own.
        let kind = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_GETLEASE) };
        let limit = self.break_secs.min(lease_break_secs().unwrap_or(0));
        let elapsed = boottime_ns().map(|now| now.saturating_sub(self.since_ns));
        still_guards(kind, elapsed, limit)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // SAFETY: fcntl on a descriptor we own; closing it would release
        // the lease too, but other descriptors may share the description.
        unsafe {
            libc::fcntl(self.file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK);
        }
    }
}

/// The decision of [`Lease::held`]: the lease is intact (`kind` is
/// `F_RDLCK`), or a writer that broke it still waits: less than `limit`
/// seconds (the break time), one second of margin, have passed since the
/// lease was taken (so since any break began). An unknown elapsed time
/// guards nothing.
fn still_guards(kind: libc::c_int, elapsed_ns: Option<u128>, limit_secs: u64) -> bool {
    if kind == libc::F_RDLCK {
        return true;
    }
    elapsed_ns.is_some_and(|e| e + 1_000_000_000 < u128::from(limit_secs) * 1_000_000_000)
}

/// `fcntl(F_SETSIG)` (Linux; not exported by the libc crate).
const F_SETSIG: libc::c_int = 10;

fn lease_break_secs() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/lease-break-time")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `CLOCK_BOOTTIME` in nanoseconds: it keeps counting through a suspend, so
/// an elapsed time measured with it is never shorter than the kernel's.
fn boottime_ns() -> Option<u128> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &raw mut ts) } != 0 {
        return None;
    }
    Some(u128::try_from(ts.tv_sec).ok()? * 1_000_000_000 + u128::try_from(ts.tv_nsec).ok()?)
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

#[cfg(test)]
mod tests {
    use super::still_guards;

    #[test]
    fn a_broken_lease_guards_only_within_the_break_time() {
        const S: u128 = 1_000_000_000;
        // intact: always
        assert!(still_guards(libc::F_RDLCK, None, 0));
        // broken (F_UNLCK): the writer waits lease-break-time from the break,
        // which began after the lease was taken
        assert!(still_guards(libc::F_UNLCK, Some(0), 45));
        assert!(still_guards(libc::F_UNLCK, Some(43 * S), 45));
        assert!(!still_guards(libc::F_UNLCK, Some(44 * S), 45), "the margin");
        assert!(!still_guards(libc::F_UNLCK, Some(45 * S), 45));
        assert!(!still_guards(libc::F_UNLCK, Some(3600 * S), 45));
        // a break time of 0 or 1 s (or unreadable: 0) leaves no margin at all
        assert!(!still_guards(libc::F_UNLCK, Some(0), 1));
        assert!(!still_guards(libc::F_UNLCK, Some(0), 0));
        // the clock unreadable: nothing is vouched for
        assert!(!still_guards(libc::F_UNLCK, None, 45));
        // F_GETLEASE failing (-1) is not a lease
        assert!(!still_guards(-1, Some(100 * S), 45));
    }
}
