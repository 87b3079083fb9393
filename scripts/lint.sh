#!/usr/bin/env bash
# The lint gates, one entry point for people and CI (.ci/run runs it before
# the tests; .pre-commit-config.yaml before each commit): ruff (check with
# the complexity rule, McCabe 13, no reach into another object's private
# members on the package, SLF001, and format), the 500-line rule for the
# package's modules (scripts/check_sizes.py), mypy on the package (strict on the core
# modules), stubtest of the extension's stub, and the Rust gates (fmt, clippy
# with the [lints] policy of Cargo.toml). Configuration: pyproject.toml and
# Cargo.toml. stubtest needs the built package (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
for tool in ruff mypy; do
  "$PY" -m "$tool" --version >/dev/null 2>&1 || "$PY" -m pip install -q "$(grep -E "^$tool==" requirements-dev.txt)"
done
echo "== lint: ruff check"
"$PY" -m ruff check .
echo "== lint: ruff format --check"
"$PY" -m ruff format --check .
echo "== lint: every Python module of the package at most 500 lines (scripts/check_sizes.py)"
"$PY" scripts/check_sizes.py
echo "== lint: mypy (python/ds4; strict on errors, checkpoint, session, all of kvstore/, the ladder: recovery, loading, frontier; report, constrain)"
"$PY" -m mypy
echo "== lint: stubtest ds4._core (the allowlist says what stubtest cannot see)"
"$PY" -m mypy.stubtest ds4._core --allowlist python/ds4/_core.stubtest-allowlist
echo "== lint: cargo fmt --check"
cargo fmt --check
echo "== lint: cargo clippy (all targets, all features, warnings are errors)"
cargo clippy --locked --all-targets --all-features -- -D warnings
