"""The prefill bar of ``ds4 run``, ``ds4 chat`` and ``ds4 bench`` (issue
25, item 4) through the real commands: under a pty the bar shows tokens
done/total, tokens/s and the rung that served the rest (the number the
recovery report gives), and is erased before the answer; with the output
piped the commands print what they printed before, nothing more.

``DS4_PROGRESS_DELAY=0`` shows the bar at once, so a prefill of a few
chunks on the reference engine does (no test waits for the 1 s delay)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pexpect
from helpers.procs import ds4_cmd
from test_cli import KV

from ds4.cli.term import printable

ENV = dict(os.environ, DS4_PROGRESS_DELAY="0")
LONG = "The tide comes in and the tide goes out, and the harbour master writes it down. " * 20
MORE = LONG + "What does he write when the boats stay out all night?"
ERASE = "\r\x1b[K"
BAR = r"(?P<label>[a-z -]+) \[#*\.*\] +(?P<done>\d+)/(?P<total>\d+) tok +(?P<rate>\d+) tok/s eta +\d+s"
RUNG = r", rung=(?P<rung>\w+) cached=(?P<cached>\d+)"


def _pty(*args: str, timeout: int = 120) -> tuple[int, str]:
    """``python -m ds4 ARGS`` on a pty (stdout and stderr both the
    terminal): its exit status and everything it wrote."""
    seen = io.StringIO()
    c = pexpect.spawn(
        sys.executable,
        ["-m", "ds4", *args],
        encoding="utf-8",
        codec_errors="replace",
        timeout=timeout,
        env=ENV,
        dimensions=(40, 200),
    )
    c.logfile_read = seen
    try:
        c.expect(pexpect.EOF)
    finally:
        c.close()
    return c.exitstatus, seen.getvalue()


def _bars(out: str) -> list[dict[str, str]]:
    """Every bar drawn in ``out`` (each after an erase)."""
    return [m.groupdict() for m in re.finditer(re.escape(ERASE) + BAR + f"(?:{RUNG})?", out)]


def _run(kv, prompt: str, *extra: str) -> list[str]:
    return ["run", "-p", prompt, "--engine", "reference", "--max-tokens", "6", "--kv-disk-dir", str(kv), *KV, *extra]


def test_run_on_a_terminal_shows_the_bar_with_the_rung_then_the_answer(tmp_path):
    kv = tmp_path / "kv"
    rc, out = _pty(*_run(kv, LONG))
    assert rc == 0, out
    bars = _bars(out)
    assert bars and {b["rung"] for b in bars} == {"prefill"} and {b["cached"] for b in bars} == {"0"}, out
    for b in bars:
        assert b["label"] == "prefill" and 0 < int(b["done"]) <= int(b["total"]) and int(b["rate"]) > 0
    # the bar is erased, and the answer starts on a clean line after it
    answer = json.loads(ds4_cmd(*_run(tmp_path / "other", LONG, "--json")).stdout)["text"]
    tail = out[out.rindex(ERASE) + len(ERASE) :]
    assert tail == printable(answer).replace("\n", "\r\n") + "\r\n", (tail, answer)

    # the next, longer prompt: resumed from the stored prefix, the bar says so,
    # with the number of tokens the recovery report says were cached
    snapshot = tmp_path / "kv-before"
    shutil.copytree(kv, snapshot)
    rc, out = _pty(*_run(kv, MORE))
    assert rc == 0, out
    report = json.loads(ds4_cmd(*_run(snapshot, MORE, "--json")).stdout)["report"]
    assert report["rung"] == "disk" and report["reused_tokens"] > 0
    bars = _bars(out)
    assert bars and all((b["rung"], int(b["cached"])) == ("disk", report["reused_tokens"]) for b in bars), out
    assert int(bars[-1]["total"]) == report["prompt_tokens"] - report["reused_tokens"]


def test_run_piped_prints_the_answer_alone(tmp_path):
    """Piped, the bar writes nothing: stdout is the answer and a newline,
    byte for byte, stderr empty; ``-v``'s one report line is all it adds."""
    answer = json.loads(ds4_cmd(*_run(tmp_path / "a", LONG, "--json")).stdout)["text"]
    p = subprocess.run(
        [sys.executable, "-m", "ds4", *_run(tmp_path / "b", LONG)], capture_output=True, env=ENV, timeout=120
    )
    assert p.returncode == 0 and p.stderr == b"" and p.stdout == answer.encode() + b"\n", p
    p = subprocess.run(
        [sys.executable, "-m", "ds4", *_run(tmp_path / "c", LONG, "-v")], capture_output=True, env=ENV, timeout=120
    )
    assert p.stdout == answer.encode() + b"\n"
    assert re.fullmatch(
        rb"\[rung=prefill source=full cached=0 prompt=\d+ gen=\d+ finish=\w+ ttft=\d+ ms [\d.]+ tok/s\]\n", p.stderr
    )


def _chat(kv) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        ["-m", "ds4", "chat", "--engine", "reference", "--kv-disk-dir", str(kv), "--max-tokens", "4", *KV],
        encoding="utf-8",
        codec_errors="replace",
        timeout=60,
        env=ENV,
        dimensions=(40, 200),
    )


def test_chat_on_a_terminal_shows_the_bar_of_a_turn_with_its_rung(tmp_path):
    c = _chat(tmp_path / "kv")
    try:
        c.expect(">>> ")
        c.sendline(LONG)
        c.expect(re.escape(ERASE) + BAR + RUNG)
        rung, cached = c.match.group("rung"), int(c.match.group("cached"))
        c.expect(r"\[(\w+)/\S+ cached=(\d+) prompt=(\d+)")
        assert (c.match.group(1), int(c.match.group(2))) == (rung, cached)  # the turn's report says the same
        assert rung == "live" and cached > 0  # the system prompt's live state served it
        c.expect(">>> ")
        c.sendline("/quit")
        c.expect(pexpect.EOF)
    finally:
        c.close()
    assert c.exitstatus == 0


def test_chat_piped_writes_no_bar(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "ds4", "chat", "--engine", "reference", "--kv-disk-dir", str(tmp_path), *KV],
        input=LONG + "\n/quit\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout + p.stderr and "\r" not in p.stdout + p.stderr
    assert "tok/s eta" not in p.stdout + p.stderr


def test_bench_on_a_terminal_shows_its_three_prefills(tmp_path):
    rc, out = _pty("bench", "--tokens", "2048", "--sha-mb", "1", "--kv-disk-dir", str(tmp_path))
    assert rc == 0, out
    bars = _bars(out)
    assert {b["label"] for b in bars} == {"cold prefill", "resumed", "cold follow-up"}, out
    resumed = [b for b in bars if b["label"] == "resumed"]
    assert {b["rung"] for b in resumed} == {"disk"}
    new = int(re.search(r"TTFT resumed from disk \(\+(\d+) new tokens, rung=disk\)", out).group(1))
    assert int(resumed[-1]["total"]) == new and int(resumed[-1]["done"]) == new
    cold = [b for b in bars if b["label"] == "cold prefill"]
    assert int(cold[-1]["total"]) == 2048 and cold[-1]["rung"] is None  # a bare prefill: no ladder, no rung
    assert out.index("measure") > out.rindex(ERASE)  # the table comes after the last bar is erased


def test_bench_piped_writes_no_bar(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "ds4", "bench", "--tokens", "1024", "--sha-mb", "1", "--kv-disk-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith("measure") and "\x1b" not in p.stdout and "\r" not in p.stdout
