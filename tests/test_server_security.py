"""``ds4 serve`` against an attacker (issue 11): keys, trusted hosts and
origins, hostile bodies and slow connections, and that none of it disturbs a
conversation running alongside. Real server processes on 127.0.0.1, driven
with the official ``openai`` client, ``httpx`` and raw sockets."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers.ports import free_port
from helpers.server import KV_FLAGS, Server, assert_error, topic_chat

from ds4.server.tenants import tenant_of

KEY, KEY2, KEY3 = "sk-ds4-first-key", "sk-ds4-from-the-file", "sk-ds4-from-the-env"


@pytest.fixture(scope="module")
def keyed(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "keys"
    key_file.write_text(f"# the team's key\n\n{KEY2}\n", encoding="utf-8")
    return serve_module(
        "--api-key",
        KEY,
        "--api-key-file",
        str(key_file),
        "--admin-tenant",
        tenant_of(KEY),  # health() reads the operator's counters and session
        "--cors-origin",
        "https://app.example",
        *KV_FLAGS,
        name="keyed",
        tmp=tmp,
        kv=True,
        key=KEY,
        env={"DS4_API_KEY": KEY3},
    )


def _endpoints(model):
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    return [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", f"/v1/models/{model}", None),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}),
    ]


def test_every_endpoint_needs_a_key(keyed):
    model = keyed.model()
    for method, path, body in _endpoints(model):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": KEY + "x"}, {"Authorization": KEY}):
            r = httpx.request(method, keyed.base + path, json=body, headers=headers, timeout=60)
            err = assert_error(r, 401, code="invalid_api_key")
            assert KEY not in r.text and "sk-wrong" not in r.text, err
            assert r.headers["www-authenticate"] == "Bearer"
        for headers in (
            {"Authorization": f"Bearer {KEY}"},
            {"authorization": f"bearer {KEY2}"},
            {"x-api-key": KEY3},
        ):
            r = httpx.request(method, keyed.base + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 200, (method, path, headers, r.text)
    # unknown paths too: no key, no 404 (nothing about the routes leaks)
    assert_error(httpx.get(keyed.base + "/v1/nothing"), 401)
    # the official client: a wrong key is an AuthenticationError, the right one works
    with pytest.raises(openai.AuthenticationError):
        keyed.client(key="sk-nope").models.list()
    r = keyed.client().chat.completions.create(model=model, messages=topic_chat("keys"), max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_non_loopback_host_without_a_key_refuses_to_start(tmp_path, serve):
    port = str(free_port())
    base = [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--port", port, "--host", "0.0.0.0"]
    p = subprocess.run(base, capture_output=True, text=True, timeout=120, env=_env_without_key())
    assert p.returncode == 2, p
    assert "--api-key" in p.stderr and "--insecure-no-auth" in p.stderr and "ready" not in p.stderr
    # with a key it starts (and checks it)
    srv = serve("--api-key", KEY, name="open", tmp=tmp_path, host="0.0.0.0", key=KEY)
    assert httpx.get(srv.base + "/health", timeout=10).status_code == 401


def _env_without_key():
    import os

    return {k: v for k, v in os.environ.items() if k != "DS4_API_KEY"}


def test_foreign_host_and_origin_are_refused(keyed):
    h = keyed.headers
    model = keyed.model()
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = keyed.base + "/v1/chat/completions"
    # a DNS-rebinding page: the browser sends the attacker's name as Host
    assert_error(httpx.post(url, json=chat, headers={**h, "Host": "evil.example"}), 400, code="invalid_host")
    assert_error(httpx.get(keyed.base + "/health", headers={**h, "Host": "evil.example:8000"}), 400)
    for ok_host in ("localhost", f"localhost:{keyed.port}", "127.0.0.1", "[::1]:80"):
        assert httpx.get(keyed.base + "/health", headers={**h, "Host": ok_host}).status_code == 200, ok_host
    # an origin that is not --cors-origin: refused, key or not
    r = httpx.post(url, json=chat, headers={**h, "Origin": "https://evil.example"})
    assert_error(r, 403, code="origin_not_allowed")
    assert "access-control-allow-origin" not in r.headers
    # the allowed origin: preflight 204 without a key, answers carry the header
    pre = httpx.options(
        url,
        headers={
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 204, pre.text
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "DELETE" in pre.headers["access-control-allow-methods"]  # client.responses.delete from a page
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.post(url, json=chat, headers={**h, "Origin": "https://app.example"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    # a 401 from the allowed origin is readable by the page (so it can tell the user)
    r = httpx.post(url, json=chat, headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_no_cors_without_cors_origin(tmp_path, serve):
    srv = serve(name="nocors", tmp=tmp_path)
    r = httpx.options(
        srv.base + "/v1/chat/completions",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.options(srv.base + "/v1/chat/completions")
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    h = httpx.get(srv.base + "/health")
    assert h.status_code == 200 and not any(k.startswith("access-control") for k in h.headers)
    assert json.loads(h.text)["status"] == "ok"


# -- hostile requests next to a running conversation -------------------------
def _raw(srv, head: bytes, body: bytes = b"", timeout=30.0) -> tuple[int, bytes]:
    """Send ``head`` (and ``body``) on a fresh socket; the status and body."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(srv, path, n, ctype=b"application/json", extra=b""):
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + srv.key.encode() + b"\r\n"
        b"Content-Type: " + ctype + b"\r\nContent-Length: " + str(n).encode() + b"\r\n" + extra + b"\r\n"
    )


def _hostile(srv, model):
    """(what, status, code, response) for every hostile request."""
    chat, comp = b"/v1/chat/completions", b"/v1/completions"
    out = []

    def post_raw(what, path, body: bytes, status, code, ctype=b"application/json"):
        st, resp = _raw(srv, _head(srv, path, len(body), ctype), body)
        out.append((what, st, status, code, resp))

    sur = '"\\ud800"'  # a lone surrogate: valid JSON, not encodable
    m = f'"model": "{model}"'
    for field, body in {
        "messages[0].content": f'{{{m}, "messages": [{{"role": "user", "content": {sur}}}]}}',
        "messages[0].content[0].text": (
            f'{{{m}, "messages": [{{"role": "user", "content": [{{"type": "text", "text": {sur}}}]}}]}}'
        ),
        "messages[0].name": f'{{{m}, "messages": [{{"role": "user", "content": "hi", "name": {sur}}}]}}',
        "stop": f'{{{m}, "messages": [{{"role": "user", "content": "hi"}}], "stop": {sur}}}',
        "stop[1]": f'{{{m}, "messages": [{{"role": "user", "content": "hi"}}], "stop": ["a", {sur}]}}',
        "model": f'{{"model": {sur}, "messages": [{{"role": "user", "content": "hi"}}]}}',
        "user": f'{{{m}, "messages": [{{"role": "user", "content": "hi"}}], "user": {sur}}}',
    }.items():
        post_raw(f"surrogate in {field}", chat, body.encode(), 400, "invalid_string")
    post_raw("surrogate in prompt", comp, f'{{{m}, "prompt": {sur}}}'.encode(), 400, "invalid_string")
    post_raw("10,000-deep JSON", chat, b"[" * 10_000 + b"]" * 10_000, 400, "invalid_json")
    deep = f'{{{m}, "messages": [{{"role": "user", "content": "hi"}}], "metadata": ' + "[" * 100 + "]" * 100 + "}"
    post_raw("100-deep JSON", chat, deep.encode(), 400, "invalid_json")
    good = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    post_raw("text/plain", chat, good, 415, "unsupported_media_type", b"text/plain")
    post_raw("form", chat, good, 415, "unsupported_media_type", b"application/x-www-form-urlencoded")
    # 100 MiB announced: refused on the header, before one byte is read
    st, resp = _raw(srv, _head(srv, chat, 100 * 1024 * 1024))
    out.append(("100 MiB Content-Length", st, 413, "request_too_large", resp))
    # a prompt whose bytes alone cannot fit the context: refused before tokenizing
    huge = json.dumps({"model": model, "prompt": "x" * 200_000}).encode()
    post_raw("200 kB prompt", comp, huge, 400, "context_length_exceeded")
    r = httpx.post(srv.base + "/v1/chat/completions", content=good, headers={**srv.headers, "Host": "evil.example"})
    out.append(("foreign Host", r.status_code, 400, "invalid_host", r.content))
    return out


def _chunked_100mib(srv):
    """100 MiB sent chunked (no Content-Length): 413 after 16 MiB."""

    def gen():
        block = b"x" * (1024 * 1024)
        for _ in range(100):
            yield block

    try:
        r = httpx.post(
            srv.base + "/v1/completions",
            content=gen(),
            headers={**srv.headers, "Content-Type": "application/json"},
            timeout=60,
        )
    except httpx.HTTPError as e:  # the server may close before the client is done writing
        return None, repr(e)
    return r.status_code, r.text


def test_hostile_requests_get_4xx_and_never_touch_the_conversation(keyed):
    c, model = keyed.client(), keyed.model()
    msgs = topic_chat("hostility")
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    for turn in range(3):
        h0 = keyed.health()
        assert h0["session"]["valid"]
        for what, st, status, code, resp in _hostile(keyed, model):
            assert st == status, (what, st, resp[:300])
            err = json.loads(resp)["error"]
            assert err["code"] == code, (what, err)
        st, text = _chunked_100mib(keyed)
        assert st == 413, (st, text[:300])
        h1 = keyed.health()
        # no job was created, nothing was saved or evicted, the session is as it was
        assert h1["session"] == h0["session"]
        assert h1["counters"] == h0["counters"]
        assert h1["kv"]["stores"] == h0["kv"]["stores"] and h1["kv"]["files"] == h0["kv"]["files"]
        msgs = [
            *msgs,
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And part {turn}?"},
        ]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=1)
        x = r.model_extra["ds4"]
        assert x["rung"] == "live" and r.usage.prompt_tokens_details.cached_tokens == h0["session"]["n_past"], x


def test_slow_and_idle_connections_are_closed(tmp_path, serve):
    srv = serve(
        "--header-timeout", "2", "--body-timeout", "2", "--keep-alive-timeout", "1", name="timeouts", tmp=tmp_path
    )
    socks: list[socket.socket] = []
    try:
        # 300 slowloris connections: a request line, then one header byte at a time
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
            socks.append(s)
        for s in socks[:50]:
            s.sendall(b"b")  # bytes keep arriving: still closed at the deadline
        for _ in range(3):  # the server keeps answering meanwhile
            assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
        # a head that never ends, and a body that never comes
        body_sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        socks.append(body_sock)
        body_sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        # an idle keep-alive connection after a complete request
        idle = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        socks.append(idle)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for s in socks:
            if s is body_sock:
                continue
            assert _closed_by_server(s, 30), "a slow or idle connection stayed open"
        status, resp = _read_response(body_sock, 30)
        assert status == 408 and json.loads(resp)["error"]["code"] == "request_timeout"
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    """True once the server closed ``s`` (what it sent before is read and dropped)."""
    deadline = time.monotonic() + timeout
    s.settimeout(1.0)
    while time.monotonic() < deadline:
        try:
            if s.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def _read_response(s: socket.socket, timeout: float) -> tuple[int, bytes]:
    s.settimeout(timeout)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        if b"\r\n\r\n" in data and len(data.split(b"\r\n\r\n", 1)[1]) >= _length(data):
            break
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


# -- what the server shows, and when it says it is ready ------------------------
def test_paths_only_with_debug_and_ready_only_after_the_bind(tmp_path, serve):
    kv = str(tmp_path / "kv")
    srv = serve("--debug", "--kv-disk-dir", kv, *KV_FLAGS, name="debug", tmp=tmp_path)
    assert srv.health()["kv"]["dir"] == kv
    assert f"ds4 server ready on 127.0.0.1:{srv.port}" in srv.text_log()
    # a second server on the same port: the bind fails, and it never says ready
    taken = Server(str(tmp_path), "taken", "--kv-disk-dir", kv)
    taken.args[taken.args.index("--port") + 1] = str(srv.port)
    p = subprocess.run(taken.args, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p
    out = p.stdout + p.stderr
    assert "server ready" not in out and "address already in use" in out.lower(), out


def test_error_bodies_show_no_absolute_path_unless_debug():
    from ds4.errors import EngineError
    from ds4.server.wire import exception_to_api

    e = EngineError("llama_decode failed for /home/alice/models/secret-model.gguf")
    body = exception_to_api(e, "messages").body()["error"]
    assert body["code"] == "engine_error" and "/home" not in body["message"] and "secret" not in body["message"]
    assert "EngineError" in body["message"]
    assert "/home/alice" in exception_to_api(e, "messages", debug=True).message
    from ds4.errors import PromptError

    bad = exception_to_api(PromptError("cannot read /var/lib/ds4/kv/ab12.kv: nope"), "prompt")
    assert bad.status == 400 and "/var/lib" not in bad.message and "ab12.kv" in bad.message
    bug = exception_to_api(ValueError("cannot read /var/lib/ds4/kv/ab12.kv: nope"), "prompt")  # not the client's
    assert bug.status == 500 and "/var/lib" not in bug.message
    crash = exception_to_api(KeyError("/etc/passwd"), None)
    assert crash.status == 500 and "/etc" not in crash.message and "passwd" not in crash.message
