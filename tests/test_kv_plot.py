"""``ds4 kv stats DIR --plot FILE.png`` and ``--plot -`` (issue 25, item 3):
a valid PNG of the figure's size for a store of known contents, the
terminal bars and sparklines of that store character for character, the
message naming the extra when matplotlib cannot be imported, and the
flags that cannot go together."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from helpers.procs import ds4_cmd

from ds4 import _core
from ds4.cli import plot
from ds4.keytext import preamble

HOUR, DAY = 3600, 86400


def _known(write_ck, d, now: int) -> dict[str, str]:
    """Five checkpoints: their reasons, tenants, ages and hits are known, and
    their sizes follow from their tensors (returned: name -> path). The ages
    sit mid-bin, far from any edge, so the test's own run time moves none."""
    d.mkdir(exist_ok=True)
    big = {"kv": np.zeros(4096, np.float32)}  # 16 KiB of payload
    plan = [
        # text, namespace, reason, age (s), hits, arrays
        ("cold one", None, "cold", 30 * 60, 0, None),
        ("continued one", "alice", "continued", 12 * HOUR, 3, None),
        ("evicted one", "alice", "evict", 3 * DAY, 1, big),
        ("another cold", "bob", "cold", 14 * DAY, 0, None),
        ("an old one", None, "continued", 60 * DAY, 20, None),
    ]
    paths = {}
    for text, ns, reason, old, hits, arrays in plan:
        p = write_ck(d, preamble(ns) + text.encode(), arrays, reason=reason, created=now - old)
        for _ in range(hits):
            _core.touch(p, now - old)  # a hit stamps last_used only; created stays
        paths[text] = p
    return paths


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The chunks of a PNG, each CRC checked (AssertionError otherwise)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    chunks, at = [], 8
    while at < len(data):
        (n,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        (crc,) = struct.unpack(">I", data[at + 8 + n : at + 12 + n])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        chunks.append((kind, body))
        at += 12 + n
    assert at == len(data) and chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    return chunks


def test_the_png_is_valid_and_of_the_figures_size(tmp_path, write_ck):
    d = tmp_path / "kv"
    _known(write_ck, d, int(time.time()))
    out = tmp_path / "stats.png"
    p = ds4_cmd("kv", "stats", d, "--plot", out)
    assert "reasons        cold: 2, continued: 2, evict: 1" in p.stdout  # the stats are printed too
    chunks = _png_chunks(out.read_bytes())
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (width, height) == (1000, 750) == tuple(round(x * plot.DPI) for x in plot.FIGSIZE)
    assert depth == 8 and color in (2, 6)  # 8-bit RGB or RGBA
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    assert len(pixels) == height * (1 + width * (3 if color == 2 else 4))  # a filter byte per row
    assert len(set(pixels)) > 16  # drawn, not a blank page
    assert f"plot written to {out} (1000x750 px)" in p.stderr


def test_json_and_a_png_together(tmp_path, write_ck):
    d = tmp_path / "kv"
    _known(write_ck, d, int(time.time()))
    out = tmp_path / "s.png"
    p = ds4_cmd("kv", "stats", d, "--json", "--plot", out)
    assert p.stdout.startswith("{") and p.stdout.rstrip().endswith("}")  # stdout stays JSON
    _png_chunks(out.read_bytes())


EXPECTED = """\
bytes by reason
  cold       ██▋                                       1.1 KiB
  continued  ██▋                                       1.1 KiB
  evict      ████████████████████████████████████████  16.2 KiB
bytes by tenant
  alice      ████████████████████████████████████████  16.8 KiB
  anonymous  ██▍                                       1.0 KiB
  bob        █▍                                        584 B
checkpoints by age (since written)  ▁█████
  < 1m                                             0
  < 1h   ████████████████████████████████████████  1
  < 1d   ████████████████████████████████████████  1
  < 1w   ████████████████████████████████████████  1
  < 30d  ████████████████████████████████████████  1
  older  ████████████████████████████████████████  1
checkpoints by hits  █▅▅▁▁▅
  0     ████████████████████████████████████████  2
  1     ████████████████████                      1
  2-3   ████████████████████                      1
  4-7                                             0
  8-15                                            0
  16+   ████████████████████                      1
"""


def test_the_terminal_chart_of_a_known_store(tmp_path, write_ck):
    d = tmp_path / "kv"
    paths = _known(write_ck, d, int(time.time()))
    sizes = {t: os.path.getsize(p) for t, p in paths.items()}
    # the bars' lengths follow from these sizes: pin them, so a change of format shows here first
    assert sizes == {
        "cold one": 520,
        "continued one": 584,
        "evicted one": 16576,
        "another cold": 584,
        "an old one": 520,
    }
    p = ds4_cmd("kv", "stats", d, "--plot", "-")
    stats, chart = p.stdout.split("\n\n", 1)
    assert stats.startswith("directory ") and "tokens         35" in stats
    assert chart == EXPECTED, chart
    assert p.stderr == ""


def test_the_chart_of_an_empty_directory(tmp_path):
    (tmp_path / "kv").mkdir()
    chart = ds4_cmd("kv", "stats", tmp_path / "kv", "--plot", "-").stdout.split("\n\n", 1)[1]
    assert chart == (
        "bytes by reason\n  (none)\nbytes by tenant\n  (none)\n"
        "checkpoints by age (since written)\n  (none)\ncheckpoints by hits\n  (none)\n"
    )


def test_the_age_bins_edges_and_the_bars_eighths():
    now = 1_800_000_000.0
    infos = [{"created": now - a, "hits": 0} for a in (0, 59, 60, 3599, 3600, 30 * DAY)]
    infos.append({"created": now + 100, "hits": 0})  # a header from the future: age 0
    assert plot.age_counts(infos, now) == [3, 2, 1, 0, 0, 1]
    assert plot.hit_counts([{"hits": h} for h in (0, 1, 2, 3, 4, 7, 8, 15, 16, 1000)]) == [1, 1, 2, 2, 2, 2]
    assert [plot.bar(v, 8, width=1) for v in (0, 1, 4, 7, 8)] == ["", "▏", "▌", "▉", "█"]
    assert plot.bar(1e-9, 1) == "▏"  # anything above nothing shows
    assert plot.bar(3, 2, width=2) == "███"  # above the top: longer, never cut
    assert plot.sparkline([0, 1, 7, 0]) == "▁▂█▁" and plot.sparkline([0, 0]) == "▁▁"


def _without_matplotlib(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The CLI run in a fresh interpreter where ``import matplotlib`` fails."""
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n"
        "from ds4.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_without_matplotlib_the_message_names_the_extra(tmp_path, write_ck):
    d = tmp_path / "kv"
    _known(write_ck, d, int(time.time()))
    out = tmp_path / "x.png"
    p = _without_matplotlib(["kv", "stats", str(d), "--plot", str(out)])
    assert p.returncode == 1, p.stderr
    assert "pip install 'ds4[plot]'" in p.stderr and "matplotlib" in p.stderr
    assert p.stdout == "" and not out.exists()  # refused before anything was read or printed
    assert "Traceback" not in p.stderr
    # the terminal drawing needs no matplotlib
    p = _without_matplotlib(["kv", "stats", str(d), "--plot", "-"])
    assert p.returncode == 0 and "checkpoints by hits" in p.stdout, p.stderr


@pytest.mark.parametrize(
    ("extra", "rc", "message"),
    [
        (["--plot", "-", "--json"], 2, "--plot - draws on stdout, as --json prints"),
        (["--plot", ""], 2, "--plot needs a file or -"),
        (["--plot", "{tmp}/no/such/dir/x.png"], 1, "cannot write {tmp}/no/such/dir/x.png"),
    ],
)
def test_plot_flag_errors(tmp_path, write_ck, extra, rc, message):
    d = tmp_path / "kv"
    _known(write_ck, d, int(time.time()))
    p = ds4_cmd("kv", "stats", d, *[e.format(tmp=tmp_path) for e in extra], check=False)
    assert p.returncode == rc and message.format(tmp=tmp_path) in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_plot_is_a_directorys_not_the_remote_tiers():
    p = ds4_cmd("kv", "stats", "--remote", "redis://127.0.0.1:1/0", "--plot", "-", check=False)
    assert p.returncode == 2 and "--plot draws a directory's checkpoints" in p.stderr
