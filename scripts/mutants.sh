#!/usr/bin/env bash
# Mutation testing of the safety mechanism (outside CI: it takes hours of CPU
# on two cores). Two maintained tools, one per language:
#
#   cargo-mutants  over the Rust verification pipeline (format readers,
#                  checks, checksums, SHA-1 and prefix, payload reads)
#   mutmut 3       over session, kvstore, recovery, checkpoint and the
#                  engines' state-import paths
#
# usage: bash scripts/mutants.sh [rust|python|all] [OUT] [cargo-mutants args, with rust]
#   OUT defaults to target/mutants; each tool leaves its raw results there and
#   scripts/mutants_report.py prints the killed/total table per module that
#   docs/RELIABILITY.md quotes.
#
# Environment: DS4_MUTANTS_JOBS (cargo-mutants -j, default 1),
# DS4_MUTMUT_CHILDREN (mutmut --max-children, default nproc),
# DS4_MUTANTS_FUNCS (mutmut: globs of mangled names, space-separated, to
# restrict the run, e.g. to an earlier run's survivors),
# DS4_MUTANTS_TESTS (mutmut: space-separated test files instead of PY_TESTS),
# DS4_MUTANTS_RESUME=1 (mutmut: keep the staged tree and its finished results).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WHAT=${1:-all}
OUT=$(realpath -m "${2:-target/mutants}")
PY=${PYTHON:-python3}
mkdir -p "$OUT"

# The files whose every mutant must be killed (or argued equivalent).
RUST_FILES=(rust/verify.rs rust/format/mod.rs rust/format/bytes.rs rust/format/v2.rs rust/format/v1.rs rust/format/writer.rs rust/hash.rs rust/payload.rs rust/error.rs
            rust/io/mod.rs rust/io/lease.rs rust/io/sigbus.rs rust/io/lock.rs rust/touch.rs)
PY_MODULES=(session.py recovery.py loading.py checkpoint.py kvstore/__init__.py kvstore/files.py kvstore/entries.py kvstore/save.py
            kvstore/remove.py kvstore/indexed.py kvstore/admission.py kvstore/rejection.py)
# What is mutated: all of session, recovery and checkpoint; of kvstore the
# paths a checkpoint takes into a session and out of the directory (index,
# lookup, load, discard, temp cleanup), not the save and eviction policy.
PY_FUNCS=('ds4.session.*' 'ds4.recovery.*' 'ds4.loading.*' 'ds4.checkpoint.*'
  'ds4.kvstore.admission.*' 'ds4.kvstore.rejection.*'
  'ds4.kvstore.xǁKVStoreǁcandidates__mutmut_*'
  'ds4.kvstore.xǁKVStoreǁdiscard__mutmut_*' 'ds4.kvstore.indexed.xǁDirIndexǁindex_file__mutmut_*'
  'ds4.kvstore.indexed.xǁDirIndexǁrefresh__mutmut_*' 'ds4.kvstore.xǁKVStoreǁlookup__mutmut_*'
  'ds4.kvstore.save.x_existing_file__mutmut_*' 'ds4.kvstore.indexed.xǁDirIndexǁopen__mutmut_*'
  'ds4.kvstore.indexed.xǁDirIndexǁ_read_index__mutmut_*' 'ds4.kvstore.indexed.xǁDirIndexǁ_recheck__mutmut_*'
  'ds4.kvstore.files.x_remove_orphaned_temp__mutmut_*' 'ds4.kvstore.files.x_temp_is_orphaned__mutmut_*'
  'ds4.kvstore.files.x_temp_writer_pid__mutmut_*' 'ds4.kvstore.files.x_is_checkpoint_name__mutmut_*'
  'ds4.kvstore.named.*' 'ds4.kvstore.remove.*')
# The engines are mutated only where a checkpoint's arrays enter them: the
# reference engine's import_state and its checks, and the llama.cpp engine's
# import_state with the payload checks and the state-blob walker
# (llamacpp_state.py, all of it). The llama.cpp tests once died with SIGILL
# inside llama_decode (a native build using AMX, which these VMs cannot
# execute); scripts/setup.sh now builds it for generic x86-64 and
# scripts/llama_probe.py checks the installed build: run it first.
PY_ENGINE_FILES=(engines/reference.py engines/llamacpp.py engines/llamacpp_state.py)
PY_ENGINE_FUNCS=(
  'ds4.engines.reference.xǁReferenceContextǁimport_state__mutmut_*'
  'ds4.engines.reference.xǁReferenceContextǁ_check_state__mutmut_*'
  'ds4.engines.reference.xǁReferenceContextǁ_stage_kv__mutmut_*'
  'ds4.engines.reference.x__check_array__mutmut_*'
  'ds4.engines.reference.x__check_values__mutmut_*'
  'ds4.engines.llamacpp.xǁLlamaCppContextǁimport_state__mutmut_*'
  'ds4.engines.llamacpp_state.*'
)
# The tests that exercise those paths (the HTTP, CLI and crash suites run
# subprocesses, which import the unmutated package and cannot kill anything).
# tests/test_loading_remote.py needs redis-server (scripts/setup.sh).
PY_TESTS=(tests/test_invalidation.py tests/test_session.py tests/test_recovery_report.py tests/test_kvstore.py tests/test_kvstore_policy.py tests/test_ladder.py
          tests/test_load_named.py tests/test_loading_remote.py tests/test_store_verdicts.py
          tests/test_errors.py tests/test_core_format.py tests/test_engine_reference.py tests/test_reliability.py
          tests/test_engine_llamacpp.py tests/test_engine_llamacpp_state.py)

need_tool() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "== installing $1 ($2)"
    eval "$2"
  fi
}

run_rust() {
  need_tool cargo-mutants "cargo install --locked cargo-mutants@27.1.0"
  local args=()
  for f in "${RUST_FILES[@]}"; do args+=(--file "$f"); done
  echo "== cargo-mutants over ${RUST_FILES[*]}"
  # Exit codes 2 (missed) and 3 (timeouts) are results, not failures.
  # nextest runs each test in its own process and skips doctests: faster.
  mkdir -p "$OUT/rust"
  cargo mutants --no-shuffle -j "${DS4_MUTANTS_JOBS:-1}" --test-tool nextest --timeout 240 --build-timeout 600 \
    --output "$OUT/rust" "${args[@]}" "$@" || [ $? -le 3 ]
}

run_python() {
  "$PY" -m pip install -q -r requirements-dev.txt
  "$PY" -m pip install -q "mutmut==3.8.1"
  # mutmut copies the sources to mutants/ and imports them from there; it
  # knows the ./, src/ and source/ layouts, so stage python/ds4 as src/ds4
  # (with the built extension module) beside the tests.
  local core
  core=$("$PY" -c 'import ds4._core as c; print(c.__file__)')
  local work="$OUT/python"
  if [ -n "${DS4_MUTANTS_RESUME:-}" ] && [ -d "$work/mutants" ]; then
    # mutmut remembers finished mutants: go on where an earlier run stopped
    (cd "$work" && "$PY" -m mutmut run --max-children "${DS4_MUTMUT_CHILDREN:-$(nproc)}" "$@") || true
    return
  fi
  rm -rf "$work"
  mkdir -p "$work/src"
  cp -r python/ds4 "$work/src/ds4"
  find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
  [ -e "$work/src/ds4/$(basename "$core")" ] || cp "$core" "$work/src/ds4/"
  cp -r tests "$work/tests"
  cp -r docs "$work/docs"
  cp -r rust "$work/rust"
  local only="" t sel=""
  for m in "${PY_MODULES[@]}"; do only+="\"src/ds4/$m\", "; done
  for m in "${PY_ENGINE_FILES[@]}"; do only+="\"src/ds4/$m\", "; done
  local tests=("${PY_TESTS[@]}")
  # DS4_MUTANTS_TESTS: only these test files (e.g. the fast synthetic ones
  # first; re-run what survives them with the whole selection)
  [ -n "${DS4_MUTANTS_TESTS:-}" ] && read -r -a tests <<<"$DS4_MUTANTS_TESTS"
  for t in "${tests[@]}"; do [ -e "$t" ] && sel+="\"$t\", "; done
  cat > "$work/pyproject.toml" <<EOF
[tool.mutmut]
source_paths = ["src/ds4"]
only_mutate = [${only%, }]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-W", "ignore::DeprecationWarning"]
pytest_add_cli_args_test_selection = [${sel%, }]
also_copy = ["docs", "rust"]

[tool.pytest.ini_options]
timeout = 600
xfail_strict = true
EOF
  echo "== mutmut over ${PY_MODULES[*]} and the engines' import paths"
  (cd "$work" && "$PY" -m mutmut run --max-children "${DS4_MUTMUT_CHILDREN:-$(nproc)}" "$@") || true
}

py_patterns() {
  if [ -n "${DS4_MUTANTS_FUNCS:-}" ]; then tr -s ' ' '\n' <<<"$DS4_MUTANTS_FUNCS" | sed '/^$/d'; else printf '%s\n' "${PY_FUNCS[@]}" "${PY_ENGINE_FUNCS[@]}"; fi
}

case "$WHAT" in
  rust) run_rust "${@:3}" ;;
  python) mapfile -t P < <(py_patterns); run_python "${P[@]}" ;;
  all) run_rust; mapfile -t P < <(py_patterns); run_python "${P[@]}" ;;
  *) echo "usage: $0 [rust|python|all] [OUT]" >&2; exit 2 ;;
esac
"$PY" "$ROOT/scripts/mutants_report.py" "$OUT"
