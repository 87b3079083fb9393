#!/usr/bin/env bash
# The lint gates, one entry point for people and CI (.ci/run runs it before
# the tests). Today: ruff (check and format), stubtest of the extension's
# stub, and the Rust gates. mypy on the package and ruff's complexity rule
# join with the reshaping of the package (issue "One house"): they do not
# pass on today's layout. stubtest needs the built package (scripts/setup.sh).
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
echo "== lint: stubtest ds4._core (the allowlist says what stubtest cannot see)"
"$PY" -m mypy.stubtest ds4._core --allowlist python/ds4/_core.stubtest-allowlist
echo "== lint: cargo fmt --check"
cargo fmt --check
echo "== lint: cargo clippy (all targets, all features, warnings are errors)"
cargo clippy --locked --all-targets --all-features -- -D warnings
