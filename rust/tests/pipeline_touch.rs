//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: `touch`: the 40-byte bound, what the open flags buy (`O_NONBLOCK`
//! against a lease, `O_NOFOLLOW` against a path swapped for a symlink after
//! the `lstat`), `flock` released on drop and retried after a signal.

mod common;

use common::*;
use ds4::io::FileLock;
use ds4::{open, touch, Class, Error, VerifyOptions};
use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Waits until `cond` holds; panics (instead of hanging) after a minute.
#[track_caller]
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "gave up waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Installs `handler` for `sig` with exactly `flags` (no `SA_RESTART` unless given).
fn install_handler(sig: libc::c_int, handler: extern "C" fn(libc::c_int), flags: libc::c_int) {
    // SAFETY: a plain sigaction call with a zeroed, then filled-in struct;
    // the handlers used here only touch atomics and call fcntl.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = flags;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(sig, &raw const sa, std::ptr::null_mut()),
            0,
            "{}",
            std::io::Error::last_os_error()
        );
    }
}

/// `flock(LOCK_EX | LOCK_NB)` on a descriptor of the test's own: Ok when
/// taken, the errno when not.
fn try_lock(f: &File) -> Result<(), i32> {
    // SAFETY: flock on an open descriptor.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    }
}

fn unlock(f: &File) {
    // SAFETY: flock on an open descriptor.
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) }, 0);
}

fn hits_and_last_used(p: &Path) -> (u32, u64) {
    let b = std::fs::read(p).unwrap();
    (
        u32::from_le_bytes(b[12..16].try_into().unwrap()),
        u64::from_le_bytes(b[32..40].try_into().unwrap()),
    )
}

// ---- touch: bounds, open flags, the lock ----

#[test]
fn touch_needs_exactly_the_mutable_fields() {
    let d = dir();
    // 40 bytes reach the end of last_used: enough to record a hit.
    let mut f = default_file()[..40].to_vec();
    f[12..16].copy_from_slice(&7u32.to_le_bytes());
    let p = put(d.path(), TEXT, &f);
    assert_eq!(touch(&p, 1_234_567).unwrap(), 8);
    assert_eq!(hits_and_last_used(&p), (8, 1_234_567));
    let g = std::fs::read(&p).unwrap();
    assert_eq!((&g[..12], &g[16..32]), (&f[..12], &f[16..32]));
    // 39 bytes do not.
    let p = put(d.path(), TEXT, &f[..39]);
    let e = touch(&p, 1).unwrap_err();
    assert!(matches!(e, Error::TooShort { need: 40, have: 39 }), "{e}");
    assert_eq!(std::fs::read(&p).unwrap(), &f[..39]);
}

static LEASE_FD: AtomicI32 = AtomicI32::new(-1);
static SIGIO_SEEN: AtomicUsize = AtomicUsize::new(0);

/// The lease holder's answer to a lease break: give the lease up.
extern "C" fn give_up_lease(_: libc::c_int) {
    SIGIO_SEEN.fetch_add(1, Ordering::SeqCst);
    let fd = LEASE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: fcntl is async-signal-safe; fd is the test's open descriptor.
        unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
    }
}

#[test]
fn touch_waits_briefly_for_a_lease_then_gives_up() {
    // Another process holding a read lease (a load of ours, a file server,
    // a backup tool) makes an open for writing wait until it gives the
    // lease up. touch opens with O_NONBLOCK and retries for a bounded
    // while: a holder that gives the lease up (on the break's signal) lets
    // the hit through; one that keeps it makes touch fail, unwritten.
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    install_handler(libc::SIGIO, give_up_lease, libc::SA_RESTART);
    let holder = File::open(&p).unwrap();
    LEASE_FD.store(holder.as_raw_fd(), Ordering::SeqCst);
    let seen = SIGIO_SEEN.load(Ordering::SeqCst);
    // SAFETY: fcntl on an open descriptor.
    let r = unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    assert_eq!(r, 0, "F_SETLEASE: {}", std::io::Error::last_os_error());

    // Reading does not conflict with a read lease: verification is not held up.
    open_both(&p, &opts()).unwrap();
    assert_eq!(touch(&p, 9).unwrap(), 1, "the hit after the holder let go");
    assert!(
        SIGIO_SEEN.load(Ordering::SeqCst) > seen,
        "the break was signalled"
    );

    // A holder that keeps its lease: touch gives up, and writes nothing.
    LEASE_FD.store(-1, Ordering::SeqCst);
    // SAFETY: as above.
    let r = unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_SETLEASE, libc::F_RDLCK) };
    assert_eq!(r, 0, "F_SETLEASE: {}", std::io::Error::last_os_error());
    let before = std::fs::read(&p).unwrap();
    let e = touch(&p, 10).expect_err("touch wrote under a lease");
    match &e {
        Error::Io(io) => assert_eq!(io.raw_os_error(), Some(libc::EWOULDBLOCK), "{io}"),
        other => panic!("expected an I/O error, got {other}"),
    }
    assert_eq!((e.code(), e.stage(), e.class()), ("io", "open", Class::Io));
    assert_eq!(
        std::fs::read(&p).unwrap(),
        before,
        "a refused touch must not write"
    );
    drop(holder);
    assert_eq!(touch(&p, 11).unwrap(), 2);
}

#[test]
fn file_lock_is_released_on_drop() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let file = File::open(&p).unwrap();
    let other = File::open(&p).unwrap();
    let lock = FileLock::exclusive(&file).unwrap();
    assert_eq!(try_lock(&other), Err(libc::EWOULDBLOCK));
    drop(lock);
    // `file` is still open: only the drop can have released the lock.
    assert_eq!(try_lock(&other), Ok(()));
    unlock(&other);
    // And it can be taken again through the same descriptor.
    let lock = FileLock::exclusive(&file).unwrap();
    assert_eq!(try_lock(&other), Err(libc::EWOULDBLOCK));
    drop(lock);
    drop(file);
}

static SIGNALS: AtomicUsize = AtomicUsize::new(0);
extern "C" fn count_signal(_: libc::c_int) {
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// True when /proc/locks shows a process waiting for a FLOCK on inode `ino`.
fn flock_waiter_on(ino: u64) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    let suffix = format!(":{ino}");
    locks.lines().any(|l| {
        l.contains("->")
            && l.contains("FLOCK")
            && l.split_whitespace().any(|w| w.ends_with(&suffix))
    })
}

#[test]
fn touch_waiting_for_the_lock_survives_a_signal() {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::thread::JoinHandleExt;
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let ino = std::fs::metadata(&p).unwrap().ino();
    // Another process holds the lock.
    let holder = File::open(&p).unwrap();
    try_lock(&holder).unwrap();
    // A handler without SA_RESTART: a blocked flock returns EINTR.
    install_handler(libc::SIGUSR2, count_signal, 0);

    let pp = p.clone();
    let t = std::thread::spawn(move || touch(&pp, 42));
    wait_for("touch to wait for the lock", || flock_waiter_on(ino));
    let before = SIGNALS.load(Ordering::SeqCst);
    // SAFETY: the thread is alive (it is blocked in flock until we unlock).
    assert_eq!(
        unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGUSR2) },
        0
    );
    // The handler has run, so the flock it interrupted has returned EINTR.
    wait_for("the signal handler", || {
        SIGNALS.load(Ordering::SeqCst) > before
    });
    // touch either waits again or has given up; let it have the lock.
    wait_for("touch to wait again or return", || {
        t.is_finished() || flock_waiter_on(ino)
    });
    unlock(&holder);
    assert_eq!(t.join().unwrap().unwrap(), 1, "touch gave up on EINTR");
    assert_eq!(hits_and_last_used(&p), (1, 42));
}

#[test]
fn a_path_swapped_for_a_symlink_is_never_followed() {
    // The name check (lstat) and the open are two steps; a checkpoint path
    // replaced by a symlink in between must still not be followed (the open
    // itself refuses symlinks). Another thread keeps exchanging the path
    // with a symlink to a different, valid checkpoint; every open must give
    // either the real file or "symlink", never the file the symlink names.
    // (A race: it can only show a regression with some probability.)
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::sync::atomic::AtomicBool;
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let other_text = b"another checkpoint";
    let other = d.path().join("other.kv");
    std::fs::write(
        &other,
        assemble(
            &encode_meta(ABI.as_bytes(), &default_tensors()),
            other_text,
            &default_payload(),
        ),
    )
    .unwrap();
    let link = d.path().join("link");
    std::os::unix::fs::symlink(&other, &link).unwrap();
    let cp = CString::new(p.as_os_str().as_bytes()).unwrap();
    let cl = CString::new(link.as_os_str().as_bytes()).unwrap();
    // Reach the file through many "./" components: the open walks them all
    // after the lstat has looked, which widens the window for the swap.
    let mut slow = d.path().as_os_str().to_owned();
    slow.push("/");
    slow.push("./".repeat(1800));
    let slow = std::path::PathBuf::from(slow).join(p.file_name().unwrap());
    let stop = AtomicBool::new(false);
    let o = VerifyOptions {
        check_name: false,
        load_payload: false,
        ..opts()
    };
    let (mut real, mut refused) = (0, 0);
    let mut wrong: Vec<String> = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                // SAFETY: two valid NUL-terminated paths.
                let r = unsafe {
                    libc::renameat2(
                        libc::AT_FDCWD,
                        cp.as_ptr(),
                        libc::AT_FDCWD,
                        cl.as_ptr(),
                        libc::RENAME_EXCHANGE,
                    )
                };
                assert!(r == 0, "renameat2: {}", std::io::Error::last_os_error());
            }
        });
        let t0 = Instant::now();
        let mut i = 0;
        while wrong.is_empty() && i < 20_000 && (i < 2_000 || t0.elapsed() < Duration::from_secs(1))
        {
            i += 1;
            match open(&slow, &o) {
                Ok(ck) if ck.text == TEXT => real += 1,
                Ok(ck) => wrong.push(format!(
                    "followed the symlink to {:?}",
                    String::from_utf8_lossy(&ck.text)
                )),
                Err(Error::NotRegularFile { what: "symlink" }) => refused += 1,
                Err(e) => wrong.push(format!("unexpected error: {e}")),
            }
        }
        // Stop the swapper before any assertion can unwind out of the scope.
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(wrong, Vec::<String>::new());
    assert!(real + refused >= 2_000);
}
