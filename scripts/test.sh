#!/usr/bin/env bash
# The whole test suite: Rust (cargo test) and Python (pytest), after setup.
# With DS4_TEST_WHEEL=1 (CI), pytest runs against the artifact users get: the
# abi3 wheel built from the sdist, installed in a fresh venv (scripts/wheel.sh);
# otherwise against the editable install of this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
if [ -n "${DS4_TEST_WHEEL:-}" ]; then
  PY=$(bash scripts/wheel.sh | tail -n 1)
fi
echo "== cargo test"
cargo test --locked
echo "== pytest"
"$PY" -m pytest -q -p no:cacheprovider "$@"
