#!/usr/bin/env bash
# The artifacts users get, built and installed the way users install them:
#   target/dist/ds4-<version>.tar.gz             the sdist (maturin)
#   target/dist/ds4-<version>-cp311-abi3-*.whl   the wheel, built FROM the sdist in an
#                                                isolated build (maturin from PyPI, the
#                                                crates from crates.io): the sdist builds
#                                                from nothing
#   target/wheel-venv                            a new virtual environment with that wheel
# The venv sees the system site-packages for the pinned dependencies
# (scripts/setup.sh installed and probed them, llama.cpp included); ds4
# itself comes from the wheel, which shadows the editable install. The script
# checks that, and prints the venv's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIST=target/dist
VENV=target/wheel-venv
rm -rf "$DIST" "$VENV"
mkdir -p "$DIST"
echo "== wheel: sdist" >&2
"$PY" -m maturin sdist --out "$DIST" >&2
echo "== wheel: building the abi3 wheel from the sdist (isolated)" >&2
"$PY" -m pip wheel -q --no-deps --wheel-dir "$DIST" "$DIST"/ds4-*.tar.gz >&2
wheel=$(ls "$DIST"/ds4-*-cp311-abi3-*.whl)
echo "== wheel: fresh venv with $(basename "$wheel")" >&2
"$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --no-deps --disable-pip-version-check "$wheel" >&2
# From outside the checkout, so that nothing of the tree can be imported.
(cd / && "$OLDPWD/$VENV/bin/python" - "$OLDPWD/$VENV" <<'PY'
import sys, os, ds4, ds4._core
venv = os.path.realpath(sys.argv[1])
for mod in (ds4, ds4._core):
    path = os.path.realpath(mod.__file__)
    if not path.startswith(venv + os.sep):
        sys.exit(f"wheel: {mod.__name__} imports from {path}, not from the venv {venv}")
if not ds4._core.__file__.endswith(".abi3.so"):
    sys.exit(f"wheel: the extension is not abi3: {ds4._core.__file__}")
# the /ui page's files (ds4/server/static) are package data: the wheel must carry them
from importlib import resources
static = resources.files("ds4.server").joinpath("static")
missing = [f for f in ("index.html", "ui.js", "ui.css") if not static.joinpath(f).is_file()]
if missing:
    sys.exit(f"wheel: ds4/server/static lacks {', '.join(missing)}")
print(f"wheel: ds4 {ds4.__version__} from {os.path.dirname(ds4.__file__)}", file=sys.stderr)
PY
)
echo "$(pwd)/$VENV/bin/python"
