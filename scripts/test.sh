#!/usr/bin/env bash
# The whole test suite: Rust (cargo test) and Python (pytest), after setup.
# With DS4_TEST_WHEEL=1 (CI), pytest runs against the artifact users get: the
# abi3 wheel built from the sdist, installed in a fresh venv (scripts/wheel.sh);
# otherwise against the editable install of this checkout.
#
# --quick: the inner loop, on a checkout already set up: pytest without the
# tests marked slow (a real model, a server or Redis process, many turns;
# tests/conftest.py), no setup, no cargo test. The default runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "--quick" ]; then
  shift
  echo "== pytest (quick: not slow)"
  exec "$PY" -m pytest -q -p no:cacheprovider -m "not slow" "$@"
fi
bash scripts/setup.sh
if [ -n "${DS4_TEST_WHEEL:-}" ]; then
  PY=$(bash scripts/wheel.sh | tail -n 1)
fi
echo "== cargo test"
cargo test --locked
echo "== pytest"
"$PY" -m pytest -q -p no:cacheprovider "$@"
