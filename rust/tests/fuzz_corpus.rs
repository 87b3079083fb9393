//! Every seed and every crash input of the fuzz corpus, replayed through the
//! fuzz targets' own checks (`fuzz/fuzz_targets/*_check.rs`, the code the
//! fuzzer runs) under `cargo test`: a crash the fuzzer once found stays
//! fixed without cargo-fuzz or a nightly toolchain.
//!
//! Inputs: `fuzz/corpus/<target>/*` (the committed `seed-*` files, among
//! them the crash inputs kept as `seed-crash-*`, and whatever a local fuzz
//! run added) and `fuzz/artifacts/<target>/*` (crashes of a local run).

#[path = "../../fuzz/fuzz_targets/blocks_check.rs"]
mod blocks_check;
#[path = "../../fuzz/fuzz_targets/parse_check.rs"]
mod parse_check;
#[path = "../../fuzz/fuzz_targets/roundtrip_check.rs"]
mod roundtrip_check;
#[path = "../../fuzz/fuzz_targets/scratch.rs"]
mod scratch;

use std::path::{Path, PathBuf};

fn inputs(target: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut out = Vec::new();
    for dir in ["corpus", "artifacts"] {
        let Ok(rd) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        out.extend(
            rd.filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.is_file()),
        );
    }
    out.sort();
    out
}

fn replay(target: &str, check: fn(&[u8])) -> usize {
    let files = inputs(target);
    let seeds = files
        .iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        })
        .count();
    assert!(seeds > 0, "no committed seeds for {target}");
    for p in &files {
        let data = std::fs::read(p).unwrap();
        let r = std::panic::catch_unwind(|| check(&data));
        assert!(r.is_ok(), "{target}: {} fails its check", p.display());
    }
    files.len()
}

#[test]
fn every_parse_seed_and_crash_input_replays() {
    assert!(replay("parse", parse_check::check) >= 4);
}

#[test]
fn every_roundtrip_seed_and_crash_input_replays() {
    assert!(replay("roundtrip", roundtrip_check::check) >= 4);
}

#[test]
fn every_blocks_seed_and_crash_input_replays() {
    assert!(replay("blocks", blocks_check::check) >= 3);
}
