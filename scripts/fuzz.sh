#!/usr/bin/env bash
# Runs each cargo-fuzz target (parse, roundtrip, blocks) for SECONDS seconds (default 60).
#
#   scripts/fuzz.sh [SECONDS] [extra libFuzzer args...]
#
# Installs cargo-fuzz (`cargo install cargo-fuzz --locked`, pinned below)
# when it is missing. On a stable toolchain the sanitizer flags are enabled
# with RUSTC_BOOTSTRAP=1. Every seed and crash input also replays under
# `cargo test` (rust/tests/fuzz_corpus.rs): keep a crash input as
# fuzz/corpus/<target>/seed-crash-<what> once it is fixed.
# Seeds live in fuzz/corpus/<target>/seed-*; new corpus entries the fuzzer
# finds are written next to them (git-ignored), crashes to fuzz/artifacts/.
set -euo pipefail
secs="${1:-60}"
shift || true
CARGO_FUZZ_VERSION=0.13.1
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== cargo-fuzz is missing: installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi
cd "$(dirname "$0")/../fuzz"
export RUSTC_BOOTSTRAP="${RUSTC_BOOTSTRAP:-1}"
# The targets write one file per input: give them a tmpfs scratch directory.
scratch="$(mktemp -d -p /dev/shm ds4-fuzz.XXXXXX 2>/dev/null || mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
export DS4_FUZZ_SCRATCH="$scratch"
status=0
for target in parse roundtrip blocks; do
    echo "== fuzz target $target for ${secs}s"
    if ! cargo fuzz run "$target" -- -max_total_time="$secs" -print_final_stats=1 "$@"; then
        echo "!! $target found a failure; see fuzz/artifacts/$target/" >&2
        status=1
    fi
done
exit "$status"
