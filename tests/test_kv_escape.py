"""Nothing a cache directory holds reaches a terminal raw: ``ds4 kv ls``,
``verify``, ``show``, ``stats`` and ``gc`` print file names, header strings
and error reasons escaped as ``ls`` does (``\\x1b``, ``\\n``), one record
per line, so a name holding an escape sequence and a newline neither drives
the terminal nor forges a ``FAIL``/``OK`` line; ``--json`` prints JSON whose
strings decode back to the exact bytes, with no control character raw."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ds4.cli.term import escaped, json_text, table

EVIL_NAME = "x\x1b[31m\nFAIL  forged.kv"
EVIL_ABI = "evil\x1b[2J\u202e\nOK    forged"
RAW = ("\x1b", "\u202e", "\x9b")


def _kv(*args):
    return subprocess.run(
        [sys.executable, "-m", "ds4", "kv", *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def hostile(tmp_path, write_ck):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    good = write_ck(d, "hello world text " * 5)
    forged_abi = write_ck(d, "other text here " * 5, abi=EVIL_ABI)
    (d / EVIL_NAME).write_bytes(b"junk that is no checkpoint")
    assert os.path.exists(good)
    return d, os.path.basename(forged_abi)


def _clean(out: str) -> None:
    for ch in RAW:
        assert ch not in out, repr(out)
    assert not any(line.startswith(("FAIL  forged", "OK    forged")) for line in out.splitlines()), out


def test_ls_shows_each_file_on_one_escaped_line(hostile):
    d, _ = hostile
    p = _kv("ls", d)
    assert p.returncode == 0, p.stderr
    _clean(p.stdout)
    lines = p.stdout.splitlines()
    assert len(lines) == 1 + 3 + 2  # the header, one line per file, the total, the "unverified" note
    assert sum(line.startswith("x\\x1b[31m\\nFAIL") for line in lines) == 1  # the name's first 12 characters
    p = _kv("ls", d, "--json")
    files = json.loads(p.stdout)["files"]
    assert EVIL_NAME in {f["name"] for f in files} and EVIL_ABI in {f.get("abi") for f in files}
    _clean(p.stdout)


def test_verify_prints_one_line_per_file_and_forges_none(hostile):
    d, _ = hostile
    p = _kv("verify", d)
    _clean(p.stdout)
    lines = p.stdout.splitlines()
    assert len(lines) == 3 + 1, lines  # one per file, the summary
    assert sum(line.startswith("FAIL  ") for line in lines) == 3  # the test files hold no engine's state
    assert any(line.startswith("FAIL  x\\x1b[31m\\nFAIL  forged.kv  ") for line in lines)
    p = _kv("verify", d, "--json")
    assert EVIL_NAME in {f["name"] for f in json.loads(p.stdout)["files"]}
    _clean(p.stdout)


def test_show_and_stats_escape_the_header_strings(hostile):
    d, forged = hostile
    p = _kv("show", d, forged[:12])
    _clean(p.stdout)
    abi_lines = [line for line in p.stdout.splitlines() if line.startswith("abi ")]
    assert len(abi_lines) == 1 and "evil\\x1b[2J\\u202e\\nOK    forged" in abi_lines[0]
    p = _kv("show", d, forged[:12], "--json")
    assert json.loads(p.stdout)["abi"] == EVIL_ABI
    _clean(p.stdout)
    p = _kv("stats", d)
    _clean(p.stdout)
    assert "evil\\x1b[2J" in p.stdout


def test_gc_reports_escaped_names(hostile):
    d, _ = hostile
    p = _kv("gc", d, "--budget-mb", "0.000001", "--dry-run")
    assert p.returncode == 0, p.stderr
    _clean(p.stdout + p.stderr)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain name.kv", "plain name.kv"),
        ("a\nb", "a\\nb"),
        ("back\\slash", "back\\\\slash"),
        ("\x1b[31m", "\\x1b[31m"),
        ("\x9b2J", "\\x9b2J"),
        ("rtl\u202eoverride", "rtl\\u202eoverride"),
        ("日本語 é", "日本語 é"),
        ("tab\there\r", "tab\\there\\r"),
    ],
)
def test_escaped_is_one_printable_line(raw, shown):
    assert escaped(raw) == shown
    assert escaped(raw).isprintable()


def test_json_text_round_trips_and_escapes_what_json_leaves_raw():
    doc = {"name": EVIL_NAME, "abi": EVIL_ABI + "\x9b", "ok": "日本語"}
    s = json_text(doc)
    assert json.loads(s) == doc
    assert "日本語" in s and all(ch not in s for ch in RAW)


def test_table_escapes_every_cell(capsys):
    table([["a\nb", "\x1b[0m"]], ["N\x1b", "M"], sys.stdout)
    out = capsys.readouterr().out
    assert out.count("\n") == 2 and "\x1b" not in out
