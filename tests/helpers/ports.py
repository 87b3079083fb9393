"""A free TCP port on 127.0.0.1: the one copy, for the tests' servers (ds4
serve, redis-server) and the benches' (which put ``tests/`` on their path to
import ``helpers.ports``, as they import ``helpers.redis_servers`` and
``helpers.server``). No pytest here, nothing of ds4: a bench can import it
as a plain module.

``DS4_TEST_PORTS=lo-hi`` (inclusive) keeps every port the tests' servers
take inside that range, for a machine where other ports are taken or
firewalled; without it the kernel picks."""

from __future__ import annotations

import os
import random
import re
import socket

__all__ = ["bindable", "free_port", "free_ports", "port_range"]


def port_range() -> range | None:
    """The ports ``DS4_TEST_PORTS=lo-hi`` allows (None: unset). A value that
    is not two ports, low first, within 1024-65535, is an error."""
    spec = os.environ.get("DS4_TEST_PORTS", "").strip()
    if not spec:
        return None
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", spec)
    if m is None or not 1024 <= int(m[1]) <= int(m[2]) <= 65535:
        raise ValueError(f"DS4_TEST_PORTS={spec!r}: want lo-hi, two ports in 1024-65535, low first")
    return range(int(m[1]), int(m[2]) + 1)


def bindable(port: int) -> bool:
    """Whether nothing holds ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports nothing listens on now: from ``DS4_TEST_PORTS``'s
    range (tried from a random place in it), else the kernel's picks.
    Another process may take one before the caller binds it, as with any
    such pick."""
    r = port_range()
    if r is None:
        out: list[int] = []
        while len(out) < n:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p: int = s.getsockname()[1]
            if p not in out:
                out.append(p)
        return out
    start = random.randrange(len(r))
    got = [p for p in (r[(start + i) % len(r)] for i in range(len(r))) if bindable(p)][:n]
    if len(got) < n:
        raise RuntimeError(f"fewer than {n} free ports in DS4_TEST_PORTS={r.start}-{r.stop - 1}")
    return got


def free_port() -> int:
    """A port nothing listens on now (see :func:`free_ports`)."""
    return free_ports(1)[0]
