"""The house's size rule, held by the lint gate (scripts/lint.sh): every
Python module of the package is at most 500 lines. A module that grows past
it is split by concern (docs/DESIGN.md's module table names each one), not
trimmed of its docstrings. Functions are held to McCabe 13 by ruff (C901,
pyproject.toml)."""

from __future__ import annotations

import pathlib
import sys

LIMIT = 500
ROOT = pathlib.Path(__file__).resolve().parent.parent / "python" / "ds4"


def main() -> int:
    over = []
    for path in sorted(ROOT.rglob("*.py")):
        with path.open(encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > LIMIT:
            over.append((n, path.relative_to(ROOT.parent.parent)))
    for n, path in over:
        print(f"{path}: {n} lines (the limit is {LIMIT}: split it by concern)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
