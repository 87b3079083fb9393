"""What the store's tests (tests/test_kvstore*.py) share besides the
``eng`` fixture of conftest.py: a session prefilled cold with a text, and
the text their prefixes are cut from."""

from __future__ import annotations

import ds4

__all__ = ["BASE", "prefilled"]

#: a text whose prefixes make checkpoints of several lengths
BASE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "


def prefilled(eng, text: str, ctx: int = 4096) -> ds4.Session:
    """A new session of ``eng`` holding ``text`` (its markers as special
    tokens), prefilled cold: what a load of its checkpoint must equal."""
    s = ds4.Session(eng, ctx=ctx)
    s.sync(eng.tokenize(text, special=True))
    return s
