"""Summarise a scripts/mutants.sh run: killed/total per module, and every
surviving mutant by name, from cargo-mutants' and mutmut's own result files.

usage: python scripts/mutants_report.py [OUT]   (OUT defaults to target/mutants)
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys


def rust_rows(out: str) -> tuple[dict, list[str]]:
    """cargo-mutants writes caught.txt, missed.txt, timeout.txt, unviable.txt,
    one mutant a line: ``rust/hash.rs:12:5: replace f -> bool with true``."""
    base = os.path.join(out, "rust", "mutants.out")
    rows: dict = collections.defaultdict(collections.Counter)
    survivors: list[str] = []
    for kind in ("caught", "missed", "timeout", "unviable"):
        try:
            with open(os.path.join(base, f"{kind}.txt"), encoding="utf-8") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except FileNotFoundError:
            continue
        for ln in lines:
            rows[ln.split(":", 1)[0]][kind] += 1
            if kind == "missed":
                survivors.append(ln)
    return rows, survivors


_RESULT = re.compile(r"^\s*(?P<key>\S+__mutmut_\d+): (?P<status>.+)$")


def python_rows(out: str) -> tuple[dict, list[str]]:
    work = os.path.join(out, "python")
    rows: dict = collections.defaultdict(collections.Counter)
    survivors: list[str] = []
    if not os.path.isdir(os.path.join(work, "mutants")):
        return rows, survivors
    r = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work, capture_output=True, text=True, check=False
    )
    for ln in r.stdout.splitlines():
        m = _RESULT.match(ln)
        if not m:
            continue
        key, status = m["key"], m["status"]
        module = re.split(r"\.(?:x_|xǁ)", key, maxsplit=1)[0]
        rows[module][status] += 1
        if status not in ("killed", "not checked", "timeout", "caught by type check"):
            survivors.append(f"{key}: {status}")
    return rows, survivors


def table(title: str, rows: dict, killed: tuple[str, ...], counted: tuple[str, ...]) -> str:
    lines = [f"### {title}", "", "| module | killed / total | " + " | ".join(counted) + " |",
             "|---|---|" + "---|" * len(counted)]
    tk = tt = 0
    for mod in sorted(rows):
        c = rows[mod]
        k = sum(c[s] for s in killed)
        t = sum(c[s] for s in counted)
        tk, tt = tk + k, tt + t
        lines.append(f"| `{mod}` | {k} / {t} | " + " | ".join(str(c[s]) for s in counted) + " |")
    lines.append(f"| all | {tk} / {tt} | |" + " |" * (len(counted) - 1))
    return "\n".join(lines)


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "target/mutants"
    rr, rs = rust_rows(out)
    pr, ps = python_rows(out)
    if rr:
        # unviable mutants do not build: they are not counted in the total
        print(table("Rust (cargo-mutants)", rr, ("caught", "timeout"), ("caught", "timeout", "missed")))
        print()
        print("unviable (do not compile, not counted):", sum(c["unviable"] for c in rr.values()))
        print()
    if pr:
        print(table("Python (mutmut)", pr, ("killed", "timeout"),
                    ("killed", "timeout", "survived", "no tests", "suspicious", "segfault")))
        print("not checked (outside the run's function patterns, not counted):", sum(c["not checked"] for c in pr.values()))
        print()
    for s in rs + ps:
        print("survivor:", s)
    if not rr and not pr:
        print(f"no results under {out}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
