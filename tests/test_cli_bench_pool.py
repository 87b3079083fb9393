"""``ds4 bench --concurrency K``: K conversations interleaved against a pool
of K sessions and against one session, in one run, on the reference engine."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ds4", "bench", *args], capture_output=True, text=True, timeout=600, check=False
    )


def test_bench_concurrency_drives_k_conversations_on_both_servers():
    p = _bench("--concurrency", "3", "--turns", "2", "--tokens", "400", "--max-tokens", "4", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["concurrency"] == 3 and out["replies_identical"] is True
    one, pool = out["runs"]
    assert (one["sessions"], pool["sessions"]) == (1, 3)
    for run in (one, pool):
        assert sum(run["levels"].values()) == 3 * 2, run["levels"]  # every turn of every conversation
        assert run["tokens_per_s"] > 0 and run["ttft_p95_ms"] >= run["ttft_p50_ms"] > 0
    # one session prefills the shared system prompt once and resumes the rest from disk;
    # the pool too (the lanes that start with it wait for that prefill)
    assert one["levels"].get("prefill") == 1 and pool["levels"].get("prefill") == 1, (one, pool)
    # the reference engine has no batched decode: two runs, one set of ratios
    assert set(out["ratios"]) == {"3 sessions"}
    assert set(out["ratios"]["3 sessions"]) == {"tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "prefilled_tokens"}


def test_bench_concurrency_prints_a_table_and_refuses_nonsense():
    p = _bench("--concurrency", "2", "--turns", "1", "--tokens", "300", "--max-tokens", "2")
    assert p.returncode == 0, p.stderr
    assert "2 sessions" in p.stdout and "replies identical: yes" in p.stdout
    bad = _bench("--concurrency", "0")
    assert bad.returncode == 2 and "--concurrency" in bad.stderr
