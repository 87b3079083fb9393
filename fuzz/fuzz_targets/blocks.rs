//! Arbitrary bytes as a KV block file's header, as a manifest's block table
//! and as a block file on disk (docs/FORMAT.md §7): nothing may panic, what
//! parses satisfies the format's invariants and encodes back to the same
//! bytes, and the header-only read agrees with the full check.
#![no_main]

#[path = "blocks_check.rs"]
mod blocks_check;
mod scratch;

libfuzzer_sys::fuzz_target!(|data: &[u8]| blocks_check::check(data));
