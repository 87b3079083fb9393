//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: the SIGBUS guard (in child processes): truncation after open is
//! reported by `check_intact`, faults outside the guarded range go to the
//! previous handler or kill as before.

mod common;

use common::child::{assert_child_killed_by_sigbus, assert_child_passed, child_dir};
use common::*;
use ds4::payload::Storage;
use ds4::{open, Class, Error, VerifyOptions};
use std::fs::{File, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

// The SIGBUS guard runs in child processes (this test binary again, running
// one test): a guard that fails kills the process, and some checks need a
// process-wide SIGBUS disposition of their own.

/// Maps `len` bytes of `f` read-only (at `at` exactly when given).
fn map_file(f: &File, len: usize, at: Option<usize>) -> usize {
    let fixed = if at.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: a new private read-only mapping of the test's own file; with
    // MAP_FIXED it replaces pages of a mapping this test owns.
    let p = unsafe {
        libc::mmap(
            at.unwrap_or(0) as *mut libc::c_void,
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE | fixed,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
    p as usize
}

fn read_at(addr: usize) -> u8 {
    // SAFETY: callers pass an address inside a live mapping they made.
    unsafe { std::ptr::read_volatile(addr as *const u8) }
}

fn shrink(p: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[test]
fn check_intact_reports_a_mapped_file_truncated_after_open() {
    const NAME: &str = "check_intact_reports_a_mapped_file_truncated_after_open";
    let Some(d) = child_dir() else {
        return assert_child_passed(NAME, "child: truncation reported");
    };
    // A payload of many pages, no zero byte in it.
    let big: Vec<u8> = (0..256 * 1024u32).map(|i| (i % 251) as u8 + 1).collect();
    let t = [RawTensor {
        name: b"big",
        dtype: 0,
        shape: vec![big.len() as u64],
        offset: 0,
        nbytes: big.len() as u64,
    }];
    let f = assemble(&encode_meta(ABI.as_bytes(), &t), TEXT, &big);
    let keep = 8192u64;

    // Mapped: the pages past the new end fault, read as zeros, and the
    // checkpoint reports itself truncated.
    let p = put(&d, TEXT, &f);
    let ck = open(&p, &opts()).unwrap();
    ck.check_intact().unwrap();
    // Under its lease nobody could cut the file (the open for writing would
    // wait); a load gives the lease back at its end, and the map stays.
    ck.release();
    shrink(&p, keep);
    let payload = ck.payload().unwrap();
    for i in (0..payload.len()).step_by(4096) {
        // SAFETY: a read of a byte inside the slice.
        unsafe { std::ptr::read_volatile(&raw const payload[i]) };
    }
    assert_eq!(
        payload[payload.len() - 1],
        0,
        "a vanished page reads as zeros"
    );
    assert_eq!(payload[0], big[0], "a page still in the file is intact");
    assert!(ck.storage.as_ref().unwrap().faulted());
    let e = ck.check_intact().unwrap_err();
    assert!(
        matches!(e, Error::Truncated { expected, actual } if expected == f.len() as u64 && actual == keep),
        "{e}"
    );
    assert_eq!((e.code(), e.class()), ("truncated", Class::Corrupt));
    drop(ck);

    // Read into memory: the copy is unaffected by the truncation.
    let p = put(&d, TEXT, &f);
    let ck = open(
        &p,
        &VerifyOptions {
            mmap: false,
            ..opts()
        },
    )
    .unwrap();
    shrink(&p, keep);
    assert_eq!(ck.payload().unwrap(), &big[..]);
    assert!(!ck.storage.as_ref().unwrap().faulted());
    ck.check_intact().unwrap();
    println!("child: truncation reported");
}

// The child's own SIGBUS handler, installed before ds4's: it records what it
// was given and resolves the fault at EXPECTED with a zero page.
static BUS_CALLS: AtomicUsize = AtomicUsize::new(0);
static BUS_ADDR: AtomicUsize = AtomicUsize::new(0);
static BUS_EXPECTED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn own_bus_handler(
    _sig: libc::c_int,
    info: *mut libc::siginfo_t,
    _ctx: *mut libc::c_void,
) {
    BUS_CALLS.fetch_add(1, Ordering::SeqCst);
    if !info.is_null() {
        // SAFETY: the kernel (or a handler chaining to this one) passes the
        // siginfo of the fault.
        BUS_ADDR.store(unsafe { (*info).si_addr() } as usize, Ordering::SeqCst);
    }
    let page = BUS_EXPECTED.load(Ordering::SeqCst) & !4095;
    // SAFETY: replaces one page of a mapping the test made with zeros.
    unsafe {
        libc::mmap(
            page as *mut libc::c_void,
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        );
    }
}

#[test]
fn a_fault_outside_the_guarded_range_goes_to_the_previous_handler() {
    const NAME: &str = "a_fault_outside_the_guarded_range_goes_to_the_previous_handler";
    let Some(d) = child_dir() else {
        return assert_child_passed(NAME, "child: faults went where they belong");
    };
    // SAFETY: installs the handler above (SA_SIGINFO) for this process.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = own_bus_handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&raw mut sa.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGBUS, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    // A guarded map of 4096 + 100 bytes: its second page is only partly
    // inside the guarded range [s, s + len).
    let guarded = d.join("guarded");
    std::fs::write(&guarded, vec![1u8; 4096 + 100]).unwrap();
    let gf = File::open(&guarded).unwrap();
    let storage = Storage::map(&gf, 4096 + 100, None).unwrap().unwrap();
    let s = storage.bytes().as_ptr() as usize;
    let len = storage.bytes().len();
    assert_eq!(len, 4096 + 100);

    // A file of the test's own, mapped over that second page, then cut: a
    // read of the first byte past the guarded range faults, and that fault
    // is not the guard's.
    let mine = d.join("mine");
    std::fs::write(&mine, vec![2u8; 4096]).unwrap();
    let mf = File::open(&mine).unwrap();
    let m = map_file(&mf, 4096, Some(s + 4096));
    assert_eq!(read_at(m + 100), 2);
    shrink(&mine, 0);
    BUS_EXPECTED.store(s + len, Ordering::SeqCst);
    assert_eq!(read_at(s + len), 0);
    assert_eq!(
        BUS_CALLS.load(Ordering::SeqCst),
        1,
        "the previous handler was not called"
    );
    assert_eq!(
        BUS_ADDR.load(Ordering::SeqCst),
        s + len,
        "the previous handler did not get the fault's siginfo"
    );
    assert!(
        !storage.faulted(),
        "the guard took a fault outside its range"
    );

    // The guard is still in place for its own range.
    shrink(&guarded, 0);
    BUS_EXPECTED.store(s + 50, Ordering::SeqCst);
    // SAFETY: a read of a byte inside the slice.
    assert_eq!(
        unsafe { std::ptr::read_volatile(&raw const storage.bytes()[50]) },
        0
    );
    assert!(storage.faulted(), "the guard did not take its own fault");
    assert_eq!(
        BUS_CALLS.load(Ordering::SeqCst),
        1,
        "the guard passed on its own fault"
    );
    println!("child: faults went where they belong");
}

/// In a child whose SIGBUS disposition is `disp` (`SIG_DFL` or `SIG_IGN`) before
/// ds4 guards a map: a fault outside the guarded maps kills it with SIGBUS,
/// as it would without ds4.
fn foreign_fault_with_disposition(d: &Path, disp: libc::sighandler_t) {
    // SAFETY: sets the disposition of SIGBUS for this (child) process.
    unsafe {
        assert_ne!(libc::signal(libc::SIGBUS, disp), libc::SIG_ERR);
    }
    let p = put(d, TEXT, &default_file());
    let ck = open(&p, &opts()).unwrap(); // installs the guard
    let mine = d.join("mine");
    std::fs::write(&mine, vec![2u8; 4096]).unwrap();
    let mf = File::open(&mine).unwrap();
    let m = map_file(&mf, 4096, None);
    shrink(&mine, 0);
    println!("child: about to fault");
    read_at(m + 10);
    println!("child: survived a fault outside ds4's maps");
    drop(ck);
}

#[test]
fn a_foreign_fault_still_kills_when_sigbus_was_default() {
    const NAME: &str = "a_foreign_fault_still_kills_when_sigbus_was_default";
    let Some(d) = child_dir() else {
        return assert_child_killed_by_sigbus(NAME, "child: about to fault");
    };
    foreign_fault_with_disposition(&d, libc::SIG_DFL);
}

#[test]
fn a_foreign_fault_still_kills_when_sigbus_was_ignored() {
    const NAME: &str = "a_foreign_fault_still_kills_when_sigbus_was_ignored";
    let Some(d) = child_dir() else {
        return assert_child_killed_by_sigbus(NAME, "child: about to fault");
    };
    foreign_fault_with_disposition(&d, libc::SIG_IGN);
}
