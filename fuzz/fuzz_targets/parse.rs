//! Arbitrary bytes through every reader entry point: the raw parsers on the
//! bytes themselves, then the whole pipeline (`ds4::open`) on a file holding
//! them, in mmap and pread mode. Nothing may panic, both modes must agree, a
//! file that opens must satisfy the format's invariants, and `touch` must
//! never turn a good file bad.
#![no_main]

#[path = "parse_check.rs"]
mod parse_check;
mod scratch;

libfuzzer_sys::fuzz_target!(|data: &[u8]| parse_check::check(data));
