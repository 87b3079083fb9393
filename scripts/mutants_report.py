"""Summarise a scripts/mutants.sh run: killed/total per module, and every
surviving mutant by name, from cargo-mutants' and mutmut's own result files.

usage: python scripts/mutants_report.py [OUT]   (OUT defaults to target/mutants)
"""

from __future__ import annotations

import ast
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
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
    )
    cache: dict = {}
    for ln in r.stdout.splitlines():
        m = _RESULT.match(ln)
        if not m:
            continue
        key, status = m["key"], m["status"]
        module = re.split(r"\.(?:x_|xǁ)", key, maxsplit=1)[0]
        if status == "survived" and log_only(work, key, cache):
            status = "survived (log text)"
        rows[module][status] += 1
        if status not in (*_CAUGHT, "not checked", "caught by type check", "survived (log text)"):
            survivors.append(f"{key}: {status}")
    return rows, survivors


# A mutant that crashes the test process (a NULL pointer handed to llama.cpp)
# failed the tests as surely as an assertion: caught, like a timeout.
_CAUGHT = ("killed", "timeout", "segfault")

_LOG_CALLS = {"debug", "info", "warning", "error", "exception", "_event"}


def _is_log_call(stmt) -> bool:
    """A statement that only emits a log line or a report event."""
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False
    f = stmt.value.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in _LOG_CALLS
        and (f.attr == "_event" or (isinstance(f.value, ast.Name) and f.value.id == "log"))
    )


def log_only(work: str, key: str, cache: dict) -> bool:
    """True when the mutant changes nothing but the text or arguments of a
    log call (found by comparing the mutant's function with mutmut's copy of
    the original, statement by statement)."""
    module, _, fname = key.partition(".x")
    fname = "x" + fname
    path = os.path.join(work, "mutants", "src", *module.split(".")) + ".py"
    if not os.path.exists(path):  # a package's own module: its __init__.py
        path = os.path.join(path[: -len(".py")], "__init__.py")
    if path not in cache:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        cache[path] = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defs = cache[path]
    mut, orig = defs.get(fname), defs.get(fname.rpartition("__mutmut_")[0] + "__mutmut_orig")
    if mut is None or orig is None:
        return False
    ms = [n for n in ast.walk(mut) if isinstance(n, ast.stmt)][1:]
    os_ = [n for n in ast.walk(orig) if isinstance(n, ast.stmt)][1:]
    if len(ms) != len(os_):
        return False
    diff = [m for m, o in zip(ms, os_, strict=True) if ast.dump(m) != ast.dump(o)]
    if not diff:
        return False
    inner = min(diff, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)
    return _is_log_call(inner)


def table(title: str, rows: dict, killed: tuple[str, ...], counted: tuple[str, ...]) -> str:
    lines = [
        f"### {title}",
        "",
        "| module | killed / total | " + " | ".join(counted) + " |",
        "|---|---|" + "---|" * len(counted),
    ]
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
        print(
            table(
                "Python (mutmut)",
                pr,
                _CAUGHT,
                ("killed", "timeout", "segfault", "survived", "survived (log text)", "no tests", "suspicious"),
            )
        )
        print(
            "not checked (outside the run's function patterns, not counted):",
            sum(c["not checked"] for c in pr.values()),
        )
        print()
    for s in rs + ps:
        print("survivor:", s)
    if not rr and not pr:
        print(f"no results under {out}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
