#!/usr/bin/env bash
# The lint gates, one entry point for people and CI (.ci/run runs it before
# the tests). Today: the Rust gates. The Python gates (ruff, mypy, stubtest)
# join with the reshaping of the package (issue "One house").
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== lint: cargo fmt --check"
cargo fmt --check
echo "== lint: cargo clippy (all targets, all features, warnings are errors)"
cargo clippy --locked --all-targets --all-features -- -D warnings
