#!/usr/bin/env bash
# The lint gates, one entry point for people and CI (.ci/run runs it before
# the tests). Today: ruff (check and format) and the Rust gates. mypy,
# stubtest and ruff's complexity rule join with the reshaping of the package
# (issue "One house"), which they do not pass on today's layout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff --version >/dev/null 2>&1 || "$PY" -m pip install -q "$(grep -E '^ruff==' requirements-dev.txt)"
echo "== lint: ruff check"
"$PY" -m ruff check .
echo "== lint: ruff format --check"
"$PY" -m ruff format --check .
echo "== lint: cargo fmt --check"
cargo fmt --check
echo "== lint: cargo clippy (all targets, all features, warnings are errors)"
cargo clippy --locked --all-targets --all-features -- -D warnings
