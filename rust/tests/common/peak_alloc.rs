//! A global allocator that records the largest single allocation one
//! thread makes while a closure runs (`peak_alloc`): the tests that show a
//! reader never allocates for what a file claims. A test binary installs
//! it with `#[path = "common/peak_alloc.rs"] mod peak_alloc;` (one global
//! allocator per binary, so it is not in `common`).
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Tracking;
// Both per thread: the harness runs a binary's tests on several threads at
// once, and one test's tracked allocations must never count in another's
// peak (a shared peak did, now and then).
thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}
fn note(size: usize) {
    if TRACK.try_with(Cell::get).unwrap_or(false) {
        let _ = PEAK.try_with(|p| p.set(p.get().max(size)));
    }
}
// SAFETY: forwards every call to `System` unchanged; only records sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note(new);
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}
#[global_allocator]
static A: Tracking = Tracking;

/// The largest single allocation made by this thread while running `f`.
pub fn peak_alloc<T>(f: impl FnOnce() -> T) -> (T, usize) {
    PEAK.with(|p| p.set(0));
    TRACK.with(|t| t.set(true));
    let r = f();
    TRACK.with(|t| t.set(false));
    (r, PEAK.with(Cell::get))
}
