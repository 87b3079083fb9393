"""How many resident sessions fit (``ds4 serve --sessions auto`` and
``--sessions-mem-mb``).

Each resident is its own engine context of ``--ctx`` tokens. What one
costs is measured, not guessed from the model's shape: a throw-away context
prefills two short prompts and the engine's exported state is weighed at
both lengths; the growth per token times ``--ctx``, plus the fixed part,
is the state a full context holds (:func:`context_bytes`: the K/V cache of
every layer, the logits, whatever else the engine's state carries). That is
a lower bound of the context's memory: an engine's scratch buffers and a
sliding-window layer's unexported cells are not in it.

``--sessions auto`` takes as many as fit in the budget (``--sessions-mem-mb``,
or a quarter of the memory the kernel reports available), at least one and
at most :data:`MAX_AUTO`; an explicit ``--sessions N`` with
``--sessions-mem-mb`` is refused when N contexts do not fit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["MAX_AUTO", "SessionsDontFit", "available_bytes", "context_bytes", "resolve_sessions", "sessions_for"]


class SessionsDontFit(ValueError):
    """An explicit ``--sessions N`` does not fit ``--sessions-mem-mb``."""


#: the most residents ``--sessions auto`` picks (each a lane; two cores here)
MAX_AUTO = 8
_PROBE = (32, 96)  # the two prompt lengths weighed, in tokens


def _state_bytes(engine: Engine, tokens: list[int]) -> int:
    ctx = engine.new_context(max(_PROBE) + 1)
    try:
        ctx.eval(tokens)
        return sum(int(a.nbytes) for a in ctx.export_state().values())
    finally:
        close = getattr(ctx, "close", None)
        if close is not None:
            close()


def context_bytes(engine: Engine, n_ctx: int) -> int:
    """The exported state of a full ``n_ctx``-token context of ``engine``,
    from its growth between two short prefills (module docstring)."""
    text = "The quick brown fox jumps over the lazy dog. " * 64
    toks = [t for t in engine.tokenize(text)][: max(_PROBE)]
    if len(toks) < max(_PROBE):  # pragma: no cover - every tokenizer splits that text finer
        raise ValueError("the probe text is too short for this tokenizer")
    a, b = _PROBE
    sa, sb = _state_bytes(engine, toks[:a]), _state_bytes(engine, toks[:b])
    per_token = max(0, sb - sa) / (b - a)
    fixed = max(0, sa - per_token * a)
    return int(fixed + per_token * n_ctx)


def available_bytes() -> int:
    """The memory the kernel reports available (``MemAvailable``), else
    the physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def sessions_for(budget_bytes: int, per_context: int, cap: int = MAX_AUTO) -> int:
    """How many contexts of ``per_context`` bytes fit in ``budget_bytes``
    (at least one, at most ``cap``)."""
    if per_context <= 0:
        return cap
    return max(1, min(cap, budget_bytes // per_context))


def resolve_sessions(requested: int | str, mem_mb: float | None, engine: Engine, n_ctx: int) -> tuple[int, str]:
    """The pool's size for ``--sessions`` (an int or ``"auto"``) and
    ``--sessions-mem-mb``, and a line saying why; an error when an explicit
    N does not fit the budget (:class:`SessionsDontFit`)."""
    if requested != "auto" and mem_mb is None:
        return int(requested), ""
    per = context_bytes(engine, n_ctx)
    if mem_mb is not None:
        budget, of = int(mem_mb * 2**20), f"--sessions-mem-mb {mem_mb:g}"
    else:
        budget, of = available_bytes() // 4, "a quarter of the available memory"
    mib = 2**20
    why = f"{per / mib:.1f} MiB per context of {n_ctx} tokens, budget {budget / mib:.0f} MiB ({of})"
    if requested == "auto":
        n = sessions_for(budget, per)
        return n, f"--sessions auto: {n} ({why})"
    n = int(requested)
    if n * per > budget:
        raise SessionsDontFit(f"--sessions {n} needs about {n * per / mib:.0f} MiB: {why}")
    return n, f"--sessions {n} fits ({why})"
