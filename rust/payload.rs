//! Where a payload lives once verified: a read-only copy-on-write memory map
//! of the file, or a 64-byte-aligned heap buffer filled with `pread` (for
//! filesystems where mapping is unsafe). All `unsafe` for mapping is here.
//!
//! ## SIGBUS
//! If another process truncates a file while we have it mapped, touching a
//! page past the new end raises SIGBUS, which would kill the process. Maps
//! made here are registered in a fixed table; a SIGBUS handler that finds
//! the faulting address inside a registered map replaces that page with a
//! zero page (so the access completes) and marks the map *faulted*. Every
//! consumer checks [`Storage::faulted`] after reading (the payload checksum
//! would also catch the zeros): a faulted checkpoint is reported as
//! truncated and never used. Faults outside our maps go to the previous
//! handler (or the default action), exactly as if ds4 were not there.

use crate::error::{Error, Result};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::os::unix::fs::FileExt;

/// A 64-byte-aligned heap buffer (zeroed lazily by the allocator: large
/// allocations come straight from fresh anonymous pages, no extra pass).
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn zeroed(len: usize) -> Result<AlignedBuf> {
        if len == 0 {
            // A dangling but 64-aligned pointer, so empty views stay aligned.
            return Ok(AlignedBuf {
                ptr: std::ptr::without_provenance_mut(64),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, 64).map_err(|_| Error::SizeOverflow)?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                "cannot allocate payload buffer",
            )));
        }
        Ok(AlignedBuf { ptr, len })
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes, or dangling with len 0.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, 64)) }
        }
    }
}

pub enum Storage {
    Mmap {
        map: memmap2::Mmap,
        slot: Option<usize>,
    },
    Heap(AlignedBuf),
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Storage::Mmap { map, .. } => write!(f, "Storage::Mmap({} bytes)", map.len()),
            Storage::Heap(b) => write!(f, "Storage::Heap({} bytes)", b.len),
        }
    }
}

impl Storage {
    /// Maps the whole file. The caller has verified `file_len` against the
    /// header; an empty file is never mapped.
    pub fn map(file: &File, file_len: u64) -> Result<Storage> {
        if file_len == 0 {
            return Ok(Storage::Heap(AlignedBuf::zeroed(0)?));
        }
        let len = usize::try_from(file_len).map_err(|_| Error::SizeOverflow)?;
        sigbus::install();
        // SAFETY: a private (copy-on-write), read-only mapping of `len`
        // bytes, the file length we just checked. Other processes writing the
        // file in place may show through: checkpoints are only ever replaced
        // by rename (the hit fields excepted, which are outside the payload).
        // Truncation by another process is caught by the SIGBUS guard.
        // `populate` (MAP_POPULATE): the page tables are filled in the map
        // call, in one pass, instead of one fault per page during the
        // checksum pass (every byte is read right after anyway).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .len(len)
                .populate()
                .map_copy_read_only(file)?
        };
        let _ = map.advise(memmap2::Advice::Sequential);
        let slot = sigbus::register(map.as_ptr() as usize, map.len());
        Ok(Storage::Mmap { map, slot })
    }

    /// Reads `len` bytes at `offset` into an aligned heap buffer.
    pub fn pread(file: &File, offset: u64, len: u64, file_len: u64) -> Result<Storage> {
        let n = checked_range(offset, len, file_len)?;
        let mut buf = AlignedBuf::zeroed(n)?;
        read_exact_at(file, buf.as_mut_slice(), offset, file_len)?;
        Ok(Storage::Heap(buf))
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap { map, .. } => map,
            Storage::Heap(b) => b.as_slice(),
        }
    }

    /// True when a page of this map vanished under us (the file was
    /// truncated by someone else): its contents can no longer be trusted.
    pub fn faulted(&self) -> bool {
        match self {
            Storage::Mmap { slot: Some(s), .. } => sigbus::faulted(*s),
            _ => false,
        }
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        if let Storage::Mmap { slot: Some(s), .. } = self {
            sigbus::unregister(*s);
        }
    }
}

mod sigbus {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Once;

    const SLOTS: usize = 1024;
    // (start, len) of registered maps; start == 0 means free.
    static START: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static LEN: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
    static FAULTED: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];
    static INSTALLED: Once = Once::new();
    static mut PREV: std::mem::MaybeUninit<libc::sigaction> = std::mem::MaybeUninit::uninit();
    static PREV_SET: AtomicBool = AtomicBool::new(false);

    pub fn install() {
        INSTALLED.call_once(|| {
            // SAFETY: installing a process-wide handler with sigaction; the
            // handler only touches atomics and makes async-signal-safe
            // syscalls (mmap, sigaction). PREV is written once, before the
            // handler can run.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = handler as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&raw mut sa.sa_mask);
                let mut prev: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGBUS, &raw const sa, &raw mut prev) == 0 {
                    (*std::ptr::addr_of_mut!(PREV)).write(prev);
                    PREV_SET.store(true, Ordering::SeqCst);
                }
            }
        });
    }

    /// Registers a map; None when the table is full (the map then works
    /// as before, unguarded).
    pub fn register(start: usize, len: usize) -> Option<usize> {
        for i in 0..SLOTS {
            if START[i].load(Ordering::Relaxed) == 0 {
                LEN[i].store(len, Ordering::SeqCst);
                FAULTED[i].store(false, Ordering::SeqCst);
                if START[i]
                    .compare_exchange(0, start, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    return Some(i);
                }
            }
        }
        None
    }

    pub fn unregister(slot: usize) {
        START[slot].store(0, Ordering::SeqCst);
    }

    pub fn faulted(slot: usize) -> bool {
        FAULTED[slot].load(Ordering::SeqCst)
    }

    extern "C" fn handler(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // SAFETY: called by the kernel with a valid siginfo for SIGBUS.
        let addr = unsafe { (*info).si_addr() } as usize;
        for i in 0..SLOTS {
            let s = START[i].load(Ordering::SeqCst);
            if s != 0 && addr >= s && addr < s + LEN[i].load(Ordering::SeqCst) {
                // SAFETY: sysconf takes no pointers.
                let sys_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
                let page = usize::try_from(sys_page).map_or(4096, |p| p.max(4096));
                let p = addr & !(page - 1);
                // SAFETY: replaces exactly one page inside our own private,
                // read-only mapping with an anonymous zero page.
                let r = unsafe {
                    libc::mmap(
                        p as *mut libc::c_void,
                        page,
                        libc::PROT_READ,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if r != libc::MAP_FAILED {
                    FAULTED[i].store(true, Ordering::SeqCst);
                    return;
                }
                break;
            }
        }
        // Not ours: behave as if we had never been installed.
        // SAFETY: PREV was written before the handler was installed.
        unsafe {
            if PREV_SET.load(Ordering::SeqCst) {
                let prev = (*std::ptr::addr_of!(PREV)).assume_init_ref();
                let h = prev.sa_sigaction;
                if h == libc::SIG_DFL || h == libc::SIG_IGN {
                    libc::sigaction(libc::SIGBUS, prev, std::ptr::null_mut());
                    return; // the fault repeats and takes the default action
                }
                if prev.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(h);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
                    f(sig);
                }
            } else {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &raw const dfl, std::ptr::null_mut());
            }
        }
    }
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
