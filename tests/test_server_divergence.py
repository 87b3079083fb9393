"""Issue 21, item 2: every response's ``ds4`` block says where the prompt
left the best candidate the server had (``divergence``), and the log says
it too, so a nonce in a system prompt shows without reading request
bodies. Real ``ds4 serve`` processes on 127.0.0.1 (the reference engine),
driven with the official ``openai`` and ``anthropic`` clients.

The expected bytes are counted in the reference engine's chat rendering,
spelled out here: ``<|im_start|>role\\n...<|im_end|>\\n`` per turn, one
token a byte and one a marker."""

from __future__ import annotations

import json

import anthropic
import pytest
from helpers.server import KV_FLAGS, ds4_block

SYSTEM = "You are a careful assistant who answers briefly. Session tag cch=abc12; follow the house rules."
USER = "Please explain the harbour timetable to me in a few sentences, with the ferry names."
NONCE_AT = len("<|im_start|>system\n") + SYSTEM.index("abc12")


def _system(nonce: str) -> str:
    return SYSTEM.replace("abc12", nonce)


def _render(turns: list[tuple[str, str]]) -> str:
    """The reference engine's chat rendering, with the assistant's turn opened."""
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


def _tokens(text: str) -> int:
    return len(text.encode()) - 11 * text.count("<|im_start|>") - 9 * text.count("<|im_end|>")


def _want(against: str, cached: str, prompt: str, at: int) -> dict:
    """The divergence of two renderings that part at byte ``at`` (ASCII)."""
    assert cached[:at] == prompt[:at] and cached[at] != prompt[at]
    return {
        "against": against,
        "token": _tokens(prompt[:at]),
        "byte": at,
        "cached": cached[at : at + 32],
        "prompt": prompt[at : at + 32],
    }


def _chat(c, system: str, *more: dict, **kw):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": USER}, *more]
    return c.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0, **kw)


def test_divergence_null_on_a_fresh_server_then_against_live(tmp_path, serve):
    """A fresh server: null. The next turn changes the system prompt's
    nonce: the prompt left the live state there (byte, token and both
    texts exact; the same in the log at info level)."""
    srv = serve("--kv-disk-dir", str(tmp_path / "kv"), *KV_FLAGS, name="divergence", tmp=tmp_path)
    c = srv.client()
    first = _chat(c, _system("abc12"))
    assert "divergence" in ds4_block(first) and ds4_block(first)["divergence"] is None
    second = _chat(c, _system("def34"))
    p1 = _render([("system", _system("abc12")), ("user", USER)])
    p2 = _render([("system", _system("def34")), ("user", USER)])
    want = _want("live", p1, p2, NONCE_AT)
    assert ds4_block(second)["divergence"] == want
    line = (
        f"kv cache miss at byte {NONCE_AT} (token {want['token']}) against live: "
        f"{json.dumps(want['cached'])} vs {json.dumps(want['prompt'])}"
    )
    assert line in srv.text_log()


def test_divergence_against_a_checkpoint_after_a_restart(tmp_path, serve):
    """A turn, a restart (the live state stored at shutdown, none live
    after it), then the conversation grown under another nonce: the
    prompt left the stored turn at the nonce, which the block shows."""
    srv = serve("--kv-disk-dir", str(tmp_path / "kv"), *KV_FLAGS, name="restart", tmp=tmp_path)
    first = _chat(srv.client(), _system("abc12"))
    srv.stop()  # stores the live state (the prompt and its reply): reason shutdown
    srv.start()
    reply = first.choices[0].message.content
    more = ({"role": "assistant", "content": reply}, {"role": "user", "content": "And on Sundays?"})
    second = _chat(srv.client(), _system("def34"), *more)
    p1 = _render([("system", _system("abc12")), ("user", USER)])
    p2 = _render([("system", _system("def34")), ("user", USER), ("assistant", reply), ("user", "And on Sundays?")])
    assert ds4_block(second)["rung"] == "prefill"
    assert ds4_block(second)["divergence"] == _want("checkpoint", p1, p2, NONCE_AT)


def test_every_protocol_carries_the_divergence(tmp_path, serve):
    """Chat, Anthropic Messages and Responses: the same ``divergence``
    field in the ``ds4`` block (a live hit on the agent protocols' next
    turn: the live state held whole, ``cached`` empty)."""
    srv = serve("--no-kv-cache", name="protocols", tmp=tmp_path)
    r = srv.client().responses.create(
        model="m", instructions=_system("abc12"), input=USER, max_output_tokens=4, store=False
    )
    assert r.model_extra["ds4"]["divergence"] is None  # the server's first turn
    a = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0)
    m = a.messages.create(
        model="m", system=_system("def34"), max_tokens=4, messages=[{"role": "user", "content": USER}]
    )
    p1 = _render([("system", _system("abc12")), ("user", USER)])
    p2 = _render([("system", _system("def34")), ("user", USER)])
    assert m.model_extra["ds4"]["divergence"] == _want("live", p1, p2, NONCE_AT)
    # the same prompt again: the live state (the prompt, then the
    # reply) is not a prefix of it; the prompt ends inside it
    m2 = a.messages.create(
        model="m", system=_system("def34"), max_tokens=4, messages=[{"role": "user", "content": USER}]
    )
    d = m2.model_extra["ds4"]["divergence"]
    assert (d["against"], d["byte"], d["token"], d["prompt"]) == ("live", len(p2), _tokens(p2), "")


# -- tenants and salts -----------------------------------------------------------

KA, KB, KOPS = "sk-div-alice", "sk-div-bob", "sk-div-ops"
BOB_1 = "What is the weather like on the coast today, in a word?"
#: longer than B's first turn, and sharing more with B's second
SECRET = "Tell me about ALICE-SECRET-7731 and keep it private, between the two of us, please."
BOB_2 = "Tell me about BOB-PUBLIC-0000, and then much more about the coast, the ferries, the tides and the rain."


@pytest.fixture(scope="module")
def keyed(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("divergence-tenants")
    keys = tmp / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\n", encoding="utf-8")
    # every text a tenant may see (all): what is shown is still its namespace's only
    flags = ["--api-key-file", str(keys), "--kv-disk-dir", str(tmp / "kv"), *KV_FLAGS, "--divergence-text", "all"]
    return serve_module(*flags, name="tenants", tmp=tmp, key=KA)


def _ask(srv, key: str | None, user: str, salt: str | None = None, hint: str | None = None) -> dict:
    """One chat turn (the system text, ``user``) with ``key``, a
    ``cache_salt`` and a ``prompt_cache_key`` when given: its divergence."""
    extra = {**({"cache_salt": salt} if salt else {}), **({"prompt_cache_key": hint} if hint else {})} or None
    with srv.client(key) as c:
        r = c.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            max_tokens=4,
            temperature=0,
            extra_body=extra,
        )
    return ds4_block(r)["divergence"]


@pytest.mark.parametrize(
    "mine, theirs",
    [((KB, None), (KA, None)), ((KA, "salt-one"), (KA, "salt-two"))],
    ids=["two-keys", "two-salts"],
)
def test_divergence_never_shows_another_tenants_or_salts_text(keyed, mine, theirs):
    """B's first turn, then A's secret turn (B's live state saved in B's
    namespace and dropped), then B's longer turn, which shares more with
    A's stored turn than with B's own: B is shown where it left its own
    stored turn, never A's text (nor, with A's secret, anything of it)."""
    _ask(keyed, mine[0], BOB_1, mine[1])
    _ask(keyed, theirs[0], SECRET, theirs[1])
    d = _ask(keyed, mine[0], BOB_2, mine[1])
    b1 = _render([("system", SYSTEM), ("user", BOB_1)])
    b2 = _render([("system", SYSTEM), ("user", BOB_2)])
    assert d == _want("checkpoint", b1, b2, len(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"))
    assert "ALICE" not in json.dumps(d)
    # A sees her own stored text where her next (longer) turn leaves it
    d = _ask(keyed, theirs[0], SECRET.replace("7731", "0042") + " And tell me about the tides too.", theirs[1])
    assert d is not None and d["cached"].startswith("7731") and d["prompt"].startswith("0042")


OTHER = "Please explain the harbour timetable to me in one sentence, with the fares."


def test_divergence_text_own_shows_another_conversations_bytes_to_nobody_but_the_operator(tmp_path, serve):
    """--divergence-text own (the default), two tenants' keys and an admin:
    within one tenant, a turn that parts from another conversation's state
    gets the offsets and its own prompt's bytes, never the stored side's
    (``cached`` None); the same conversation (its routing hint) gets both
    texts; the operator's key gets both texts whatever it parts from."""
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KA}\nbob:{KB}\nops:{KOPS}\n", encoding="utf-8")
    flags = ["--api-key-file", str(keys), "--admin-tenant", "ops", "--no-kv-cache"]
    srv = serve(*flags, name="own", tmp=tmp_path, key=KA)
    _ask(srv, KA, USER, hint="conv-1")
    d = _ask(srv, KA, OTHER, hint="conv-2")  # another conversation of alice's, same resident
    assert d["against"] == "live" and d["cached"] is None and d["prompt"] and d["byte"] > 0, d
    d = _ask(srv, KA, USER, hint="conv-2")  # conv-2 again: its own last turn is the live state
    assert d["cached"] and d["prompt"] and d["cached"] != d["prompt"], d
    d = _ask(srv, KA, OTHER)  # no hint: nothing says it is the same conversation
    assert d["cached"] is None and d["prompt"], d
    _ask(srv, KOPS, USER)
    d = _ask(srv, KOPS, OTHER)  # the operator's
    assert d["cached"] and d["prompt"], d


def test_divergence_text_off_shows_offsets_only(tmp_path, serve):
    srv = serve("--no-kv-cache", "--divergence-text", "off", name="off", tmp=tmp_path)
    _ask(srv, None, USER, hint="conv-1")
    d = _ask(srv, None, OTHER, hint="conv-1")
    assert d["against"] == "live" and d["byte"] > 0 and d["token"] > 0
    assert d["cached"] is None and d["prompt"] is None
