"""What the store's and the session's tests share besides the ``eng``
fixture of conftest.py: a text's tokens, a session prefilled cold with a
text, and the text their prefixes are cut from."""

from __future__ import annotations

import ds4

__all__ = ["BASE", "prefilled", "toks"]

#: a text whose prefixes make checkpoints of several lengths
BASE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "


def toks(eng, text: str) -> list[int]:
    """``text``'s tokens, its markers as special tokens (how the tests write
    whole chat renderings)."""
    return eng.tokenize(text, special=True)


def prefilled(eng, text: str, ctx: int = 4096) -> ds4.Session:
    """A new session of ``eng`` holding ``text`` (its markers as special
    tokens), prefilled cold: what a load of its checkpoint must equal."""
    s = ds4.Session(eng, ctx=ctx)
    s.sync(toks(eng, text))
    return s
