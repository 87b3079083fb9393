//! The read lease a payload map is made under (see [`Lease`]): what keeps
//! the mapped bytes the bytes that were verified.

use std::fs::File;
use std::os::unix::io::AsRawFd;

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
