"""``ds4.server.http11`` subclasses uvicorn's private ``H11Protocol`` for
its request-head deadline. These tests pin what it relies on, in process:
the hooks it overrides are still the class's own, its constructor and the
attributes it reads are still there, and the deadline still closes a slow
head and keeps a prompt one. An upgrade of uvicorn that changes the class
fails here instead of silently dropping the deadline."""

from __future__ import annotations

import asyncio
import inspect
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from ds4.server.http11 import with_header_timeout

HOOKS = ("connection_made", "connection_lost", "data_received", "on_response_complete")


def test_the_hooks_the_deadline_overrides_are_uvicorns_own():
    for name in HOOKS:
        assert name in vars(H11Protocol), f"uvicorn's H11Protocol no longer defines {name}"
    params = list(inspect.signature(H11Protocol.__init__).parameters)
    assert params[:4] == ["self", "config", "server_state", "app_state"], params


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve(deadline: float):
    """A protocol instance of the deadline's class per connection, on this
    loop (what uvicorn's server does), and the attributes read checked."""
    config = uvicorn.Config(_app, http=with_header_timeout(deadline), timeout_keep_alive=30, log_level="error")
    config.load()
    state = ServerState()
    made = []

    def factory():
        p = config.http_protocol_class(config=config, server_state=state, app_state={})
        made.append(p)
        return p

    return factory, made


async def _closed_within(sock: socket.socket, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    try:
        got = await asyncio.wait_for(loop.sock_recv(sock, 1024), seconds)
    except TimeoutError:
        return False
    while got:  # a response first, then the close
        try:
            got = await asyncio.wait_for(loop.sock_recv(sock, 1024), seconds)
        except TimeoutError:
            return False
    return True


def test_a_slow_head_is_closed_and_a_prompt_one_served_then_idle_closed():
    async def run():
        loop = asyncio.get_running_loop()
        factory, made = _serve(0.3)
        server = await loop.create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            slow = socket.create_connection(("127.0.0.1", port))
            slow.setblocking(False)
            await loop.sock_sendall(slow, b"GET / HTTP/1.1\r\nHost: x\r\n")  # the head never completes
            assert await _closed_within(slow, 3.0), "a slow request head was not closed"
            fast = socket.create_connection(("127.0.0.1", port))
            fast.setblocking(False)
            await loop.sock_sendall(fast, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = await asyncio.wait_for(loop.sock_recv(fast, 1024), 3.0)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok")
            # kept alive for the next request, whose head has the same deadline (not uvicorn's 30 s)
            assert await _closed_within(fast, 3.0), "an idle kept-alive connection outlived the head deadline"
            slow.close()
            fast.close()
            assert made and all(isinstance(p.conn, h11.Connection) for p in made)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(run())
