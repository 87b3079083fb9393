#!/usr/bin/env bash
# The whole test suite: Rust (cargo test) and Python (pytest), after setup.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
echo "== cargo test"
cargo test --locked
echo "== pytest"
"$PY" -m pytest -q -p no:cacheprovider "$@"
