//! The SIGBUS guard of mapped payloads.
//!
//! If another process truncates a file while we have it mapped, touching a
//! page past the new end raises SIGBUS, which would kill the process. A map
//! is made only in a claimed slot of a fixed table (none free: the payload
//! is copied instead); a SIGBUS handler that finds
//! the faulting address inside a registered map replaces that page with a
//! zero page (so the access completes) and marks the map *faulted*. Every
//! consumer checks [`Storage::faulted`](crate::payload::Storage::faulted)
//! after reading (the payload checksum
//! would also catch the zeros): a faulted checkpoint is reported as
//! truncated and never used. Faults outside our maps go to the previous
//! handler (or the default action), exactly as if ds4 were not there.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

/// Number of maps guarded at once; past that, payloads are copied.
pub const SLOTS: usize = 1024;
// Who owns each slot; then (start, len) of its map, start == 0 until published.
static CLAIMED: [AtomicBool; SLOTS] = [const { AtomicBool::new(false) }; SLOTS];
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

/// A slot of the table, claimed by one map. Claiming is one
/// compare-and-swap on the slot's own flag, so two threads never share
/// a slot; the map's range is published (start last) once it is known,
/// and the slot is freed when this is dropped.
pub struct Slot(usize);

impl Slot {
    /// A free slot, or None when all are taken.
    pub fn claim() -> Option<Slot> {
        (0..SLOTS).find_map(|i| {
            CLAIMED[i]
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                .then(|| {
                    FAULTED[i].store(false, Ordering::SeqCst);
                    Slot(i)
                })
        })
    }

    /// Makes the guard cover `[start, start + len)`.
    pub fn publish(&self, start: usize, len: usize) {
        LEN[self.0].store(len, Ordering::SeqCst);
        START[self.0].store(start, Ordering::SeqCst);
    }

    pub fn faulted(&self) -> bool {
        FAULTED[self.0].load(Ordering::SeqCst)
    }

    /// Which slot of the table this is.
    pub fn index(&self) -> usize {
        self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        START[self.0].store(0, Ordering::SeqCst);
        LEN[self.0].store(0, Ordering::SeqCst);
        CLAIMED[self.0].store(false, Ordering::Release);
    }
}

/// How many slots are claimed now (tests and diagnostics).
pub fn claimed() -> usize {
    CLAIMED.iter().filter(|c| c.load(Ordering::Relaxed)).count()
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
