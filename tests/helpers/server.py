"""``ds4 serve`` in a subprocess for the server tests (and the benches that
drive one): :class:`Server`, one process on a free port; :class:`Servers`,
the factory behind conftest's ``serve`` and ``serve_module`` fixtures (each
server in a directory of its own, every one still running stopped at the
end); and what the server tests share: the store's flags, a system prompt,
a conversation about a topic, a cold server's answer, a reply's ``ds4``
block and cached tokens, an error's shape, and the checkpoints a server's
directory holds."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import openai

from ds4.checkpoint import open_checkpoint
from ds4.kvstore import is_checkpoint_name
from helpers.ports import free_port

MIN_TOKENS = 32
ALIGN = 64
INTERVAL = 128
CTX = 2048
KV_FLAGS = [
    "--kv-cache-min-tokens",
    str(MIN_TOKENS),
    "--kv-cache-boundary-align-tokens",
    str(ALIGN),
    "--kv-cache-continued-interval-tokens",
    str(INTERVAL),
]
SYSTEM = "You are a careful assistant who answers briefly, precisely and politely."
#: topics whose greedy replies (:func:`topic_chat` with 100 words, reference
#: engine) are valid UTF-8 for three turns (the client echoes them byte-exact)
TOPICS = ("orchards", "rivers", "deserts", "forests")


class Server:
    """A ``python -m ds4 serve`` subprocess."""

    def __init__(self, tmp, name, *args, engine="reference", ctx=CTX, key=None, env=None, host="127.0.0.1"):
        self.port = free_port()
        self.key = key  # the key the helpers send (None: none)
        self.env = env
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.args = [
            sys.executable,
            "-m",
            "ds4",
            "serve",
            "--engine",
            engine,
            "--host",
            host,
            "--port",
            str(self.port),
            "--ctx",
            str(ctx),
            "--default-max-tokens",
            "16",
            # one live session, as the tests here are written for (a switch
            # saves and resumes from disk); a test of the pool gives its own
            # --sessions, which comes later and wins
            "--sessions",
            "1",
            *args,
        ]
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout=90.0):
        self.log = open(self.log_path, "ab")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            self.args, stdout=self.log, stderr=subprocess.STDOUT, cwd=os.path.dirname(self.log_path), env=env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text_log()}")
            try:
                if httpx.get(self.base + "/health", headers=self.headers, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server did not become healthy:\n{self.text_log()}")

    def stop(self, sig=signal.SIGTERM, timeout=60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not stop on {sig}:\n{self.text_log()}") from None
        self.log.close()
        return rc

    def text_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, key=None) -> openai.OpenAI:
        key = key or self.key or "unused"
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", headers=self.headers, timeout=10).json()

    def model(self) -> str:
        return self.health()["model"]


class Servers:
    """Starts ``ds4 serve`` processes and stops, at :meth:`close`, every
    one still running (newest first): conftest's ``serve`` (stopped after
    the test) and ``serve_module`` (after the module's tests).

    ``servers(*flags, name=..., cls=Server, kv=False, tmp=None, key=None,
    start=True, timeout=90, **kw)`` builds ``cls(tmp, name, *flags, **kw)``
    (``kw``: ``ctx``, ``engine``, ``env`` ...) in ``tmp`` (default: a new
    directory named ``name``), its log ``<tmp>/<name>.log``; ``kv=True``
    adds ``--kv-disk-dir <tmp>/kv`` (as ``srv.kv_dir``); ``key``: the API
    key the server's helpers send; it returns the server healthy (within
    ``timeout`` seconds), or with ``start=False`` unstarted (the test
    starts it; it is still stopped at the end). The server's directory is
    ``srv.tmp``."""

    def __init__(self, mktemp: Callable[[str], pathlib.Path]):
        self._mktemp = mktemp
        self._servers: list[Server] = []

    def __call__(self, *flags, name="server", cls=Server, kv=False, tmp=None, key=None, start=True, timeout=90.0, **kw):
        tmp = pathlib.Path(tmp) if tmp is not None else self._mktemp(name)
        if kv:
            flags = ("--kv-disk-dir", str(tmp / "kv"), *flags)
        srv = cls(str(tmp), name, *flags, **kw)
        srv.tmp = tmp
        if kv:
            srv.kv_dir = str(tmp / "kv")
        if key is not None:
            srv.key = key
        self._servers.append(srv)
        return srv.start(timeout) if start else srv

    def close(self) -> None:
        failed: list[AssertionError] = []
        while self._servers:
            srv = self._servers.pop()
            try:
                srv.stop()
            except AssertionError as e:  # the others are stopped all the same
                failed.append(e)
            log = getattr(srv, "log", None)
            if log is not None and not log.closed:  # a process that ended on its own
                log.close()
        if failed:
            raise failed[0]


def pool_server(serve, tmp, name, n, *flags, **kw):
    """A pool of ``n`` residents with a store in ``tmp/kv`` and
    :data:`KV_FLAGS`, started through the ``serve`` factory."""
    return serve("--sessions", str(n), *KV_FLAGS, *flags, name=name, tmp=tmp, kv=True, **kw)


def ds4_block(resp) -> dict:
    """The ``ds4`` block of an official client's reply (``{}``: none)."""
    return (resp.model_extra or {}).get("ds4") or {}


def cached_tokens(resp) -> int:
    """The prompt tokens a chat or completion reply says were cached."""
    d = resp.usage.prompt_tokens_details
    return d.cached_tokens if d is not None else 0


def cold_chat(cold, messages, **kw):
    """The answer of a cold prefill (its live session replaced first)."""
    model = cold.model()
    with cold.client() as c:  # closed: no socket left to the collector
        # a raw prompt sharing no token with a chat prompt: nothing to rewind to
        c.completions.create(model=model, prompt="reset", max_tokens=1)
        r = c.chat.completions.create(model=model, messages=messages, **kw)
    assert cached_tokens(r) == 0, "the reference run was not cold"
    return r


def topic_chat(topic: str, n_words: int = 12) -> list:
    """A chat of :data:`SYSTEM` and a user asking about ``topic``, with
    ``n_words`` context words of its own."""
    words = " ".join(f"{topic}-{i}" for i in range(n_words))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Please explain {topic} to me in a few sentences; context words: {words}."},
    ]


def stored_texts(kv_dir):
    """``{path: (key text, reason name, tokens)}`` of the checkpoints in
    ``kv_dir``."""
    out = {}
    for name in os.listdir(kv_dir):
        if is_checkpoint_name(name):
            ck = open_checkpoint(os.path.join(kv_dir, name), load_payload=False)
            out[os.path.join(kv_dir, name)] = (ck.text, ck.reason_name, ck.tokens)
    return out


def post_json(srv, path, body, raw=False):
    """POST ``body`` (JSON-encoded, or as is with ``raw``) to ``srv``'s ``path``."""
    data = body if raw else json.dumps(body)
    return httpx.post(srv.base + path, content=data, headers={"Content-Type": "application/json"}, timeout=60)


def assert_error(resp, status, param=None, code=None):
    """``resp`` is an OpenAI-shaped error of ``status`` (and of ``param`` and
    ``code`` when given): its ``error`` object."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err
