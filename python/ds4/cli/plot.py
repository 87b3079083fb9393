"""``ds4 kv stats DIR --plot FILE.png`` and ``--plot -``: pictures of a
checkpoint directory. Bytes by reason and by tenant, and how old the
checkpoints are and how often they were hit, from the headers ``kv stats``
read.

``--plot FILE`` draws a PNG with matplotlib (the optional extra
``ds4[plot]``), imported only here and only then, on the Agg canvas
(no display, no pyplot state). ``--plot -`` draws unicode bars and
sparklines on stdout and needs nothing."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from .kvinfo import Info
from .term import EXIT_FAIL, EXIT_OK, EXIT_USAGE, human_bytes, printable

__all__ = [
    "AGE_BINS",
    "DPI",
    "FIGSIZE",
    "HIT_BINS",
    "INSTALL_HINT",
    "PlotUnavailableError",
    "bar",
    "draw",
    "png",
    "refuse",
    "sparkline",
    "text_chart",
]

#: the PNG's size in inches and its resolution: FIGSIZE x DPI pixels
FIGSIZE = (10.0, 7.5)
DPI = 100
#: what to install when matplotlib is absent
INSTALL_HINT = "pip install 'ds4[plot]'"
#: the age bins (upper bounds in seconds since the file was written) and their labels
AGE_BINS: tuple[tuple[float, str], ...] = (
    (60, "< 1m"),
    (3600, "< 1h"),
    (86400, "< 1d"),
    (7 * 86400, "< 1w"),
    (30 * 86400, "< 30d"),
    (math.inf, "older"),
)
#: the hit bins (upper bounds, inclusive) and their labels
HIT_BINS: tuple[tuple[float, str], ...] = (
    (0, "0"),
    (1, "1"),
    (3, "2-3"),
    (7, "4-7"),
    (15, "8-15"),
    (math.inf, "16+"),
)
#: bar cells: a full block, then the eighths a bar's end is drawn with
_FULL, _EIGHTHS = "█", " ▏▎▍▌▋▊▉"
_SPARK = "▁▂▃▄▅▆▇█"
_WIDTH = 40  # a bar's cells at the section's largest value


class PlotUnavailableError(RuntimeError):
    """matplotlib cannot be imported: ``--plot FILE`` needs ``ds4[plot]``."""


def refuse(args: argparse.Namespace) -> int | None:
    """The exit status when ``--plot`` cannot run with these flags or on
    this installation (after saying why on stderr), else None. Checked
    before the directory is read, so nothing is printed first."""
    where = getattr(args, "plot", None)
    if where is None:
        return None
    if where == "" or (where == "-" and args.json):
        why = "--plot - draws on stdout, as --json prints: choose one" if where == "-" else "--plot needs a file or -"
        print(f"ds4 kv stats: {why}", file=sys.stderr)
        return EXIT_USAGE
    if where != "-":
        try:
            _matplotlib()
        except PlotUnavailableError as e:
            print(f"ds4 kv stats --plot: {e}", file=sys.stderr)
            return EXIT_FAIL
    return None


def draw(where: str, st: Info, infos: Sequence[Info], now: float | None = None) -> int:
    """``--plot WHERE`` for the stats ``st`` of the readable files ``infos``:
    the terminal chart on stdout (``-``) or a PNG written to ``WHERE``."""
    now = time.time() if now is None else now
    if where == "-":
        print()
        sys.stdout.write(text_chart(st, infos, now))
        return EXIT_OK
    try:
        w, h = png(where, st, infos, now)
    except PlotUnavailableError as e:
        print(f"ds4 kv stats --plot: {e}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as e:
        print(f"ds4 kv stats --plot: cannot write {where}: {e.strerror or e}", file=sys.stderr)
        return EXIT_FAIL
    print(f"ds4 kv stats: plot written to {where} ({w}x{h} px)", file=sys.stderr)
    return EXIT_OK


# -- the figures, shared by both drawings ----------------------------------------
def bytes_by_reason(infos: Sequence[Info]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in infos:
        out[str(i["reason"])] = out.get(str(i["reason"]), 0) + int(i.get("size", 0))
    return dict(sorted(out.items()))


def bytes_by_tenant(st: Info) -> dict[str, int]:
    return {name: int(t["bytes"]) for name, t in st["tenants"].items()}


def age_of(i: Info, now: float) -> float:
    """Seconds since the file was written (0 for a header from the future)."""
    return max(0.0, now - float(i["created"] or now))


def binned(values: Sequence[float], bins: Sequence[tuple[float, str]], upper_inclusive: bool) -> list[int]:
    """How many ``values`` fall in each bin (below each upper bound, or at
    most it when ``upper_inclusive``)."""
    counts = [0] * len(bins)
    for v in values:
        k = next(k for k, (top, _) in enumerate(bins) if (v <= top if upper_inclusive else v < top))
        counts[k] += 1
    return counts


def age_counts(infos: Sequence[Info], now: float) -> list[int]:
    return binned([age_of(i, now) for i in infos], AGE_BINS, upper_inclusive=False)


def hit_counts(infos: Sequence[Info]) -> list[int]:
    return binned([int(i["hits"]) for i in infos], HIT_BINS, upper_inclusive=True)


# -- the terminal ----------------------------------------------------------------
def bar(value: float, top: float, width: int = _WIDTH) -> str:
    """``value`` as a bar of unicode blocks, ``width`` cells at ``top``, to an
    eighth of a cell; a value above 0 shows at least an eighth."""
    if value <= 0 or top <= 0:
        return ""
    eighths = max(1, round(value / top * width * 8))
    full, rest = divmod(eighths, 8)
    return _FULL * full + (_EIGHTHS[rest] if rest else "")


def sparkline(counts: Sequence[int]) -> str:
    """One character per count, its height the count's share of the largest
    (``▁`` for none)."""
    top = max(counts, default=0)
    if top <= 0:
        return _SPARK[0] * len(counts)
    return "".join(_SPARK[0] if c <= 0 else _SPARK[max(1, math.ceil(c / top * (len(_SPARK) - 1)))] for c in counts)


def _bars(title: str, rows: Sequence[tuple[str, float, str]], out: list[str]) -> None:
    out.append(title)
    if not rows:
        out.append("  (none)")
        return
    top = max(v for _, v, _ in rows)
    lw = max(len(label) for label, _, _ in rows)
    for label, v, shown in rows:
        out.append(f"  {label.ljust(lw)}  {bar(v, top).ljust(_WIDTH)}  {shown}".rstrip())


def _label(s: str, n: int = 20) -> str:
    s = printable(s).replace("\n", " ").replace("\t", " ")
    return s if len(s) <= n else s[: n - 1] + "…"


def text_chart(st: Info, infos: Sequence[Info], now: float) -> str:
    """The ``--plot -`` drawing: bars of bytes by reason and by tenant, and
    sparklines and bars of the checkpoints by age and by hits."""
    out: list[str] = []
    reasons = bytes_by_reason(infos)
    _bars("bytes by reason", [(_label(k), v, human_bytes(v)) for k, v in reasons.items()], out)
    tenants = bytes_by_tenant(st)
    _bars("bytes by tenant", [(_label(k), v, human_bytes(v)) for k, v in tenants.items()], out)
    for title, counts, bins in (
        ("checkpoints by age (since written)", age_counts(infos, now), AGE_BINS),
        ("checkpoints by hits", hit_counts(infos), HIT_BINS),
    ):
        spark = sparkline(counts) if infos else ""
        rows = [(label, float(c), str(c)) for (_, label), c in zip(bins, counts, strict=True)] if infos else []
        _bars(f"{title}  {spark}".rstrip(), rows, out)
    return "\n".join(out) + "\n"


# -- the PNG ---------------------------------------------------------------------
def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas classes, or PlotUnavailableError."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailableError(f"drawing a PNG needs matplotlib ({e}): {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def _barh(ax: Any, title: str, values: dict[str, int]) -> None:
    ax.set_title(title)
    if not values:
        ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    labels = list(values)
    unit, scale = _unit(max(values.values()))
    xs = [values[k] / scale for k in labels]
    ax.barh(range(len(labels)), xs, color="tab:blue")
    ax.set_yticks(range(len(labels)), [_label(k) for k in labels])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.margins(x=0.2)  # room for the labels at the bars' ends
    for y, k in enumerate(labels):
        ax.annotate(f" {human_bytes(values[k])}", (xs[y], y), va="center", fontsize=8)


def _unit(top: int) -> tuple[str, int]:
    """The largest binary unit ``top`` holds at least one of."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= scale:
            return unit, scale
    return "bytes", 1


def _ages(ax: Any, infos: Sequence[Info], now: float) -> None:
    ax.set_title("checkpoints by age (since written)")
    hit = age_counts([i for i in infos if int(i["hits"]) > 0], now)
    never = age_counts([i for i in infos if int(i["hits"]) == 0], now)
    xs = range(len(AGE_BINS))
    ax.bar(xs, never, color="tab:gray", label="never hit")
    ax.bar(xs, hit, bottom=never, color="tab:green", label="hit")
    ax.set_xticks(xs, [label for _, label in AGE_BINS])
    ax.set_ylabel("checkpoints")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)


def _age_hits(ax: Any, infos: Sequence[Info], now: float) -> None:
    ax.set_title("hits by age (a dot per checkpoint, its area ~ bytes)", fontsize=10)
    ages = [max(1.0, age_of(i, now)) for i in infos]
    hits = [int(i["hits"]) for i in infos]
    top = max((int(i.get("size", 0)) for i in infos), default=1) or 1
    sizes = [12 + 200 * int(i.get("size", 0)) / top for i in infos]
    ax.scatter(ages, hits, s=sizes, alpha=0.6, color="tab:purple")
    ax.set_xscale("log")
    ax.set_xlabel("age (s, log)")
    ax.set_ylabel("hits")
    ax.yaxis.get_major_locator().set_params(integer=True)


def png(path: str, st: Info, infos: Sequence[Info], now: float) -> tuple[int, int]:
    """Write the four panels to ``path`` as a PNG of FIGSIZE x DPI pixels;
    returns its width and height."""
    figure, canvas = _matplotlib()
    fig = figure(figsize=FIGSIZE, dpi=DPI)
    canvas(fig)
    (a, b), (c, d) = fig.subplots(2, 2)
    _barh(a, "bytes by reason", bytes_by_reason(infos))
    _barh(b, "bytes by tenant", bytes_by_tenant(st))
    _ages(c, infos, now)
    _age_hits(d, infos, now)
    fig.suptitle(f"{printable(st['dir'])}: {len(infos)} checkpoints, {human_bytes(st['bytes'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=DPI)
    w, h = (round(x * DPI) for x in FIGSIZE)
    return w, h
