"""``ds4 serve`` against an attacker (issue 11): keys, trusted hosts and
origins, hostile bodies and slow connections, and that none of it disturbs a
conversation running alongside. Real server processes on 127.0.0.1, driven
with the official ``openai`` client, ``httpx`` and raw sockets."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from test_server import Server, _assert_error, _conv, _free_port

KEY, KEY2, KEY3 = "sk-ds4-first-key", "sk-ds4-from-the-file", "sk-ds4-from-the-env"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "keys"
    key_file.write_text(f"# the team's key\n\n{KEY2}\n", encoding="utf-8")
    srv = Server(
        str(tmp),
        "keyed",
        "--api-key",
        KEY,
        "--api-key-file",
        str(key_file),
        "--cors-origin",
        "https://app.example",
        key=KEY,
        env={"DS4_API_KEY": KEY3},
    ).start()
    yield srv
    srv.stop()


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
            err = _assert_error(r, 401, code="invalid_api_key")
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
    _assert_error(httpx.get(keyed.base + "/v1/nothing"), 401)
    # the official client: a wrong key is an AuthenticationError, the right one works
    with pytest.raises(openai.AuthenticationError):
        keyed.client(key="sk-nope").models.list()
    r = keyed.client().chat.completions.create(model=model, messages=_conv("keys"), max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_non_loopback_host_without_a_key_refuses_to_start(tmp_path):
    port = str(_free_port())
    base = [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--port", port, "--host", "0.0.0.0"]
    p = subprocess.run(base, capture_output=True, text=True, timeout=120, env=_env_without_key())
    assert p.returncode == 2, p
    assert "--api-key" in p.stderr and "--insecure-no-auth" in p.stderr and "ready" not in p.stderr
    # with a key it starts (and checks it)
    srv = Server(str(tmp_path), "open", "--api-key", KEY, host="0.0.0.0", key=KEY).start()
    try:
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 401
    finally:
        srv.stop()


def _env_without_key():
    import os

    return {k: v for k, v in os.environ.items() if k != "DS4_API_KEY"}


def test_foreign_host_and_origin_are_refused(keyed):
    h = keyed.headers
    model = keyed.model()
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = keyed.base + "/v1/chat/completions"
    # a DNS-rebinding page: the browser sends the attacker's name as Host
    _assert_error(httpx.post(url, json=chat, headers={**h, "Host": "evil.example"}), 400, code="invalid_host")
    _assert_error(httpx.get(keyed.base + "/health", headers={**h, "Host": "evil.example:8000"}), 400)
    for ok_host in ("localhost", f"localhost:{keyed.port}", "127.0.0.1", "[::1]:80"):
        assert httpx.get(keyed.base + "/health", headers={**h, "Host": ok_host}).status_code == 200, ok_host
    # an origin that is not --cors-origin: refused, key or not
    r = httpx.post(url, json=chat, headers={**h, "Origin": "https://evil.example"})
    _assert_error(r, 403, code="origin_not_allowed")
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
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.post(url, json=chat, headers={**h, "Origin": "https://app.example"}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    # a 401 from the allowed origin is readable by the page (so it can tell the user)
    r = httpx.post(url, json=chat, headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_no_cors_without_cors_origin(tmp_path):
    srv = Server(str(tmp_path), "nocors").start()
    try:
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
    finally:
        srv.stop()
