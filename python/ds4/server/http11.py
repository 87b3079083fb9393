"""uvicorn, adjusted: a deadline for the request head, and a server that
says "ready" only once it listens.

``ReadyServer`` logs ds4's ready line after uvicorn's startup has bound the
port (a failed bind exits before it, so the log never claims a server that
is not there).

The h11 protocol:

uvicorn closes a connection idle *between* requests after
``timeout_keep_alive``, but any byte resets that timer, and there is no
limit at all on how long the request line and headers may take: a client
sending one header byte every few seconds holds a connection (and a file
descriptor) forever (slowloris). This subclass arms a timer when the
connection is made and again after each response; unless h11 has parsed a
complete request head by then, the connection is closed. Once the head is
in, the body is the app's to bound (``read_timeout_s`` in
:mod:`ds4.server.body`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ReadyServer", "with_header_timeout"]

log = logging.getLogger("ds4.server")


class ReadyServer(uvicorn.Server):
    """``uvicorn.Server`` that logs ``ready_line`` once it listens; with
    ``on_stop`` (seconds, callback), the first SIGTERM/SIGINT schedules the
    callback that many seconds later on the server's loop (the requests
    still running then get their final event before uvicorn's graceful
    shutdown runs out and cuts them)."""

    def __init__(
        self, config: uvicorn.Config, ready_line: str, on_stop: tuple[float, Callable[[], object]] | None = None
    ):
        super().__init__(config)
        self.ready_line = ready_line
        self.on_stop = on_stop
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            log.info("%s", self.ready_line)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.on_stop is not None and self._loop is not None:
            delay, fn = self.on_stop
            loop = self._loop
            loop.call_soon_threadsafe(loop.call_later, delay, fn)


class _HeadDeadlineProtocol(H11Protocol):
    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ds4_head_timer: asyncio.TimerHandle | None = None
        self.ds4_transport: asyncio.BaseTransport | None = None

    def _ds4_arm(self) -> None:
        self._ds4_disarm()
        self.ds4_head_timer = self.loop.call_later(self.header_timeout_s, self._ds4_expire)

    def _ds4_disarm(self) -> None:
        if self.ds4_head_timer is not None:
            self.ds4_head_timer.cancel()
            self.ds4_head_timer = None

    def _ds4_expire(self) -> None:
        self.ds4_head_timer = None
        t = self.ds4_transport
        if t is not None and not t.is_closing() and self.conn.their_state is h11.IDLE:
            t.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.ds4_transport = transport
        super().connection_made(transport)  # type: ignore[arg-type]
        self._ds4_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._ds4_disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request head was parsed
            self._ds4_disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        t = self.ds4_transport
        if t is not None and not t.is_closing():
            self._ds4_arm()  # the next request's head has the same deadline


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: request heads
    must be complete within ``seconds`` of the connection (or of the
    previous response)."""
    return type("Ds4H11Protocol", (_HeadDeadlineProtocol,), {"header_timeout_s": float(seconds)})
