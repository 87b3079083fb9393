//! Text and tensors derived from the input are written with the v2 writer
//! and opened again (mmap and pread): everything must come back identical,
//! every tensor 64-byte aligned. Any mismatch panics.
#![no_main]

#[path = "roundtrip_check.rs"]
mod roundtrip_check;
mod scratch;

libfuzzer_sys::fuzz_target!(|input: &[u8]| roundtrip_check::check(input));
