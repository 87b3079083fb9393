#!/usr/bin/env bash
# The main job: set up, then run ds4's end-to-end demo on the default engine
# (SmolLM2-135M through llama.cpp; the NumPy reference engine if it is absent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
exec "$PY" -m ds4.demo "$@"
