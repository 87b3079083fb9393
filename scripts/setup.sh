#!/usr/bin/env bash
# Installs everything ds4 needs on a fresh machine (idempotent; fast when
# already done): the pinned Python dependencies and the package itself,
# built from this checkout with maturin (the Rust core is compiled here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo (Rust) is required to build the ds4 core" >&2
  exit 1
fi
echo "== setup: Python dependencies (requirements-dev.txt)"
"$PY" -m pip install -q -r requirements-dev.txt
echo "== setup: building and installing ds4 (Rust core + Python package)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import ds4, ds4._core; print('ds4', ds4.__version__, 'installed')"
