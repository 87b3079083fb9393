//! Edges of the verification pipeline that the per-error tests
//! (`errors_*.rs`) do not pin down, written against the mutants
//! cargo-mutants found; one file per concern: `pipeline_names.rs`,
//! `pipeline_header.rs`, `pipeline_writer.rs`, `pipeline_touch.rs`,
//! `pipeline_storage.rs`, `pipeline_sigbus.rs`.
//!
//! Here: storage: heap buffers freed, `Storage::pread` on a file that
//! shrank after `fstat`, every map guarded (the SIGBUS guard's slots), and
//! leases.

mod common;

use common::*;
use ds4::io::{open_regular, sigbus};
use ds4::payload::Storage;
use ds4::{open, Error, VerifyOptions};
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;

// ---- storage: heap buffers, maps and the SIGBUS guard ----

#[test]
fn storage_debug_names_the_kind_and_size_never_the_bytes() {
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let ck = open(&p, &opts()).unwrap();
    let s = ck.storage.as_deref().unwrap();
    assert_eq!(
        format!("{s:?}"),
        format!("Storage::Mmap({} bytes)", f.len())
    );
    assert!(format!("{ck:?}").contains(&format!("Storage::Mmap({} bytes)", f.len())));
    let ck = open(
        &p,
        &VerifyOptions {
            mmap: false,
            ..opts()
        },
    )
    .unwrap();
    let s = ck.storage.as_deref().unwrap();
    assert_eq!(
        format!("{s:?}"),
        format!("Storage::Heap({} bytes)", default_payload().len())
    );
}

#[test]
fn storage_pread_reports_a_file_that_shrank_after_fstat() {
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let (file, len) = open_regular(&p, false).unwrap();
    let po = payload_offset(&f) as u64;
    OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(po + 1)
        .unwrap();
    let e = Storage::pread(&file, po, len - po, len).unwrap_err();
    assert!(
        matches!(e, Error::Truncated { expected, actual } if expected == len && actual == len),
        "{e}"
    );
    // What is still there reads fine.
    let s = Storage::pread(&file, po, 1, len).unwrap();
    let po = usize::try_from(po).unwrap();
    assert_eq!(s.bytes(), &f[po..=po]);
}

#[test]
fn a_read_payload_is_freed_with_its_checkpoint() {
    let d = dir();
    let big = vec![5u8; 1 << 20];
    let t = [RawTensor {
        name: b"big",
        dtype: 0,
        shape: vec![big.len() as u64],
        offset: 0,
        nbytes: big.len() as u64,
    }];
    let f = assemble(&encode_meta(ABI.as_bytes(), &t), TEXT, &big);
    let p = put(d.path(), TEXT, &f);
    let o = VerifyOptions {
        mmap: false,
        ..opts()
    };
    drop(open(&p, &o).unwrap()); // first-use allocations, if any
    let before = live_bytes();
    let ck = open(&p, &o).unwrap();
    let held = live_bytes() - before;
    assert!(held >= isize::try_from(big.len()).unwrap(), "{held}");
    assert_eq!(ck.payload().unwrap(), &big[..]);
    drop(ck);
    let left = live_bytes() - before;
    assert!(
        left < 64 * 1024,
        "{left} bytes still allocated after the drop"
    );
}

#[test]
fn every_map_is_guarded_however_many_came_before() {
    // More maps than the guard has slots, one after the other: each one
    // frees its slot when dropped, so the next is guarded too.
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    for i in 0..1100 {
        let ck = open(&p, &opts()).unwrap();
        match ck.storage.as_deref() {
            Some(s @ Storage::Mmap { .. }) => assert!(s.leased(), "map {i} has no lease"),
            other => panic!("map {i} is not a guarded map: {other:?}"),
        }
    }
}

#[test]
fn when_every_slot_is_taken_the_payload_is_copied_never_mapped_unguarded() {
    // 1,100 checkpoints alive at once: more than the guard has slots. Every
    // map holds a slot (a map is only ever made in one); the rest are
    // copies, checked as they were copied, and read the same bytes.
    let d = dir();
    let f = default_file();
    let p = put(d.path(), TEXT, &f);
    let mut live = Vec::new();
    for _ in 0..1100 {
        let ck = open(&p, &opts()).unwrap();
        ck.release(); // as a load does at its end: the map stays, the lease goes
        live.push(ck);
    }
    let (mut maps, mut copies) = (0, 0);
    for ck in &live {
        match ck.storage.as_deref() {
            Some(Storage::Mmap { .. }) => maps += 1,
            Some(Storage::Heap(_)) => copies += 1,
            None => panic!("no payload"),
        }
        assert_eq!(ck.payload().unwrap(), default_payload().as_slice());
        ck.check_intact().unwrap();
    }
    assert!(maps <= sigbus::SLOTS && maps > 0, "{maps} maps");
    assert!(copies >= 1100 - sigbus::SLOTS, "{copies} copies");
    assert!(sigbus::claimed() <= sigbus::SLOTS);
    drop(live);
    // The slots came back: the next open maps again.
    let ck = open(&p, &opts()).unwrap();
    assert!(matches!(ck.storage.as_deref(), Some(Storage::Mmap { .. })));
}

#[test]
fn slot_claims_race_free_across_threads() {
    // Threads claim slots at the same time: no slot is ever handed to two
    // of them (a claim is one compare-and-swap on the slot's own flag).
    let taken: Vec<Vec<sigbus::Slot>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                sc.spawn(|| {
                    (0..100)
                        .filter_map(|_| sigbus::Slot::claim())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut seen = std::collections::HashSet::new();
    for s in taken.iter().flatten() {
        assert!(
            seen.insert(s.index()),
            "slot {} handed out twice",
            s.index()
        );
    }
    assert!(!seen.is_empty());
}

#[test]
fn a_lease_keeps_writers_out_until_it_is_given_back() {
    let d = dir();
    let p = put(d.path(), TEXT, &default_file());
    let ck = open(&p, &opts()).unwrap();
    assert!(ck.storage.as_deref().unwrap().leased());
    let try_write = || {
        OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&p)
    };
    let e = try_write().unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EWOULDBLOCK), "{e}");
    // The writer's attempt broke the lease; the break is recent, so no
    // writer can have got through: the bytes read are still the verified ones.
    ck.check_intact().unwrap();
    ck.release();
    assert!(!ck.storage.as_deref().unwrap().leased());
    drop(try_write().unwrap());
    // A file someone has open for writing gets no lease: its payload is copied.
    let w = OpenOptions::new().write(true).open(&p).unwrap();
    let ck = open(&p, &opts()).unwrap();
    assert!(matches!(ck.storage.as_deref(), Some(Storage::Heap(_))));
    assert_eq!(ck.payload().unwrap(), default_payload().as_slice());
    drop(w);
}

// ---- a global allocator that counts the live bytes of each thread ----

struct Counting;
thread_local! {
    static LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}
fn add_live(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_add_unsigned(n)));
}
fn sub_live(n: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub_unsigned(n)));
}
fn live_bytes() -> isize {
    LIVE.with(std::cell::Cell::get)
}
// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        add_live(l.size());
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        add_live(l.size());
        unsafe { std::alloc::System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        add_live(new);
        sub_live(l.size());
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        sub_live(l.size());
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}
#[global_allocator]
static ALLOC: Counting = Counting;
