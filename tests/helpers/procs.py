"""Child processes of the tests: the ``ds4`` command in a subprocess (what a
user types, ``python -m ds4 ...``), and the pid of a process that has
ended (a temp file's writer that died)."""

from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["dead_pid", "ds4_cmd", "ds4_json"]


def ds4_cmd(*args, check=True, input=None, timeout=120) -> subprocess.CompletedProcess[str]:
    """``python -m ds4 *args`` (each ``str()``-ed), its output captured as
    text. ``check``: fail the test (with the output) unless it exits 0, or
    with a tuple of codes unless it exits with one of them; ``False``: any
    exit code."""
    p = subprocess.run(
        [sys.executable, "-m", "ds4", *map(str, args)], capture_output=True, text=True, input=input, timeout=timeout
    )
    allowed = (0,) if check is True else check or ()
    if check and p.returncode not in allowed:
        raise AssertionError(f"ds4 {' '.join(map(str, args))} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def ds4_json(*args, check=True):
    """``ds4 *args --json``: (its JSON report, its exit code)."""
    p = ds4_cmd(*args, "--json", check=check)
    return json.loads(p.stdout), p.returncode


def dead_pid() -> int:
    """The pid of a child that has exited and been reaped: no process has it
    (until the kernel hands it out again, which a test does not wait for)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
