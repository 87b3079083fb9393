"""``ds4 serve --sessions N``: the pool of resident sessions
(:mod:`ds4.server.pool`), end to end on loopback servers over the reference
engine (bit-exact: every reply is compared with a cold single-session
server's) and the scripted engine (tool loops).

Four conversations interleaved turn by turn on four residents are live hits
after their first turn, each on its own resident; on two residents the
least recently used is evicted (saved, reason ``evict``) and comes back
from disk with the same replies; two tenants sending one prompt never share
a resident's state; SIGTERM stores every resident.
"""

from __future__ import annotations

import signal

import httpx
import pytest
from helpers.agents import ATOOLS, ScriptedServer, cold_answer, cold_server, tool_results
from helpers.agents import SYSTEM as AGENT_SYSTEM
from helpers.server import TOPICS, cached_tokens, cold_chat, ds4_block, pool_server, stored_texts, topic_chat
from test_agents_call_ids import as_msg, cached_share, create
from test_agents_chat import ask, result_for, strip_ids

from ds4.server.pool import body_hint


@pytest.fixture(scope="module")
def cold(serve_module):
    return serve_module("--no-kv-cache", name="cold")


def _turn(srv, cold, msgs, turn):
    """One turn on ``srv``, checked against the cold server; the next history."""
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=2)
    ref = cold_chat(cold, msgs, max_tokens=2)
    text = r.choices[0].message.content
    assert text == ref.choices[0].message.content, f"turn {turn} differs from a cold prefill"
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    nxt = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": f"And then, part {turn}?"}]
    return r, nxt


def test_body_hint_reads_the_protocols_fields():
    assert body_hint({"prompt_cache_key": "k", "user": "u"}) == "k"
    assert body_hint({"user": "u"}) == "u"
    assert body_hint({"metadata": {"user_id": "m"}}) == "m"
    assert body_hint({"user": 3, "metadata": "x"}) is None and body_hint([]) is None


def test_four_interleaved_conversations_are_live_hits_on_four_sessions(tmp_path, serve, cold):
    srv = pool_server(serve, tmp_path, "pool4", 4)
    convs = {t: topic_chat(t, 100) for t in TOPICS}
    where: dict[str, str] = {}
    for turn in range(3):
        for t in TOPICS:
            r, convs[t] = _turn(srv, cold, convs[t], turn)
            x = ds4_block(r)
            if turn == 0:
                continue
            assert "\ufffd" not in convs[t][-2]["content"], "pick topics whose replies echo byte-exact"
            assert x["rung"] == "live", (t, turn, x)
            assert cached_tokens(r) >= 0.95 * r.usage.prompt_tokens, (t, turn, cached_tokens(r), r.usage.prompt_tokens)
            assert x["source"].startswith("session "), x
            assert where.setdefault(t, x["source"]) == x["source"], (t, turn, x)
    assert sorted(where.values()) == [f"session {k}" for k in range(4)]  # one resident each
    h = srv.health()
    assert [s["index"] for s in h["sessions"]] == [0, 1, 2, 3]
    assert all(s["valid"] and s["tokens"] > 0 and s["last_used"] for s in h["sessions"])
    srv.stop(signal.SIGTERM)
    shut = [n for (_, reason, n) in stored_texts(srv.kv_dir).values() if reason == "shutdown"]
    assert sorted(shut) == sorted(s["tokens"] for s in h["sessions"]), (shut, h["sessions"])


def test_two_sessions_four_conversations_evict_and_come_back_from_disk(tmp_path, serve, cold):
    srv = pool_server(serve, tmp_path, "pool2", 2)
    convs = {t: topic_chat(t, 100) for t in TOPICS}
    for turn in range(2):
        for t in TOPICS:
            r, convs[t] = _turn(srv, cold, convs[t], turn)
            x = ds4_block(r)
            if turn == 1:  # two residents held the last two conversations: this one was evicted
                assert x["rung"] == "disk" and cached_tokens(r) > 0, (t, x)
                assert x["evict_saved"], (t, x)  # the least recently used resident saved first
    evicts = [n for (_, reason, n) in stored_texts(srv.kv_dir).values() if reason == "evict"]
    assert len(evicts) >= 4, evicts
    assert len(srv.health()["sessions"]) == 2


def test_a_conversation_that_is_no_live_hit_keeps_its_own_resident(tmp_path, serve, cold):
    """A reply the client cannot echo byte-exact (the reference model's
    bytes are seldom valid UTF-8 over 24 tokens) makes the next turn no
    live hit; with no free resident it goes back to the resident sharing
    its history (rule 5), not to the least recently used one, which holds
    the other conversation: that one's next turn is still live."""
    srv = pool_server(serve, tmp_path, "pool-shared", 2)
    a, b = topic_chat(TOPICS[0], 100), topic_chat(TOPICS[1], 100)
    _, a = _turn(srv, cold, a, 0)
    _, b = _turn(srv, cold, b, 0)
    r = srv.client().chat.completions.create(model=srv.model(), messages=a, max_tokens=24)
    text = r.choices[0].message.content
    assert "\ufffd" in text, "the precondition: a reply the client echoes in other bytes"
    a = [*a, {"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    r, _ = _turn(srv, cold, a, 2)  # b's resident is the least recently used one
    x = ds4_block(r)
    assert x["rung"] in ("rewrite", "disk") and cached_tokens(r) > 0, x
    assert "shares this conversation's" in srv.text_log()
    rb, _ = _turn(srv, cold, b, 1)
    assert ds4_block(rb)["rung"] == "live", ds4_block(rb)


def test_tenants_never_share_a_resident(tmp_path, serve, cold):
    ka, kb = "sk-pool-alice", "sk-pool-bob"
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{ka}\nbob:{kb}\n", encoding="utf-8")
    srv = pool_server(
        serve, tmp_path, "pool-tenants", 2, "--api-key-file", str(keys), "--admin-tenant", "alice", key=ka
    )
    msgs = topic_chat("orchards", 100)
    hint = {"X-Session-Id": "shared-hint"}
    c_a, c_b, model = srv.client(ka), srv.client(kb), srv.model()
    text = c_a.chat.completions.create(model=model, messages=msgs, max_tokens=2, extra_headers=hint)
    text = text.choices[0].message.content
    assert "\ufffd" not in text
    nxt = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    # bob, a prompt alice's resident holds the start of, alice's hint: nothing of alice's reused
    rb = c_b.chat.completions.create(model=model, messages=nxt, max_tokens=2, extra_headers=hint)
    assert cached_tokens(rb) == 0 and ds4_block(rb)["rung"] == "prefill", ds4_block(rb)
    # ... nor taken from her: her next turn is still a live hit on her resident
    ra = c_a.chat.completions.create(model=model, messages=nxt, max_tokens=2, extra_headers=hint)
    assert ds4_block(ra)["rung"] == "live" and ds4_block(ra)["source"] == "session 0", ds4_block(ra)
    assert ra.choices[0].message.content == rb.choices[0].message.content
    assert ra.choices[0].message.content == cold_chat(cold, nxt, max_tokens=2).choices[0].message.content
    # a third namespace (alice's cache salt) takes the least recently used resident (bob's): nothing reused
    rc = c_a.chat.completions.create(model=model, messages=nxt, max_tokens=2, extra_body={"cache_salt": "s1"})
    assert cached_tokens(rc) == 0 and ds4_block(rc)["rung"] == "prefill", ds4_block(rc)
    assert [s["tenant"] for s in srv.health()["sessions"]] == ["alice", "alice"]
    # bob's own /health shows no resident
    assert "sessions" not in httpx.get(srv.base + "/health", headers={"Authorization": f"Bearer {kb}"}).json()


# -- tool loops: a continuation follows the resident that made the calls -------
cold_agent = pytest.fixture(scope="module", name="cold_agent")(cold_server)


def test_interleaved_tool_loops_continue_on_their_own_residents(tmp_path, serve, cold_agent):
    srv = serve(
        "--sessions", "2", "--kv-disk-dir", str(tmp_path / "kv"), name="pool-agents", cls=ScriptedServer, tmp=tmp_path
    )
    convs = [
        [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"Look up {n}."}] for n in (7, 9)
    ]
    for turn in range(4):
        for msgs in convs:
            msg, finish, usage, x = ask(srv, msgs)
            cold_msg, cold_finish = cold_answer(ask, cold_agent, msgs)
            assert strip_ids(msg) == strip_ids(cold_msg) and finish == cold_finish, turn
            if turn:
                cached = usage.prompt_tokens_details.cached_tokens
                assert cached >= 0.95 * usage.prompt_tokens, (turn, cached, usage.prompt_tokens)
                assert x["rung"] == "live" and x["source"].startswith("session "), x
            msgs.append(msg)
            if finish == "tool_calls":
                msgs += result_for(msg)
            else:
                msgs.append({"role": "user", "content": f"Now look up {turn}."})
    assert "pool: continuation of session" in srv.text_log()


def test_results_without_their_calls_are_served_by_the_resident_that_made_them(tmp_path, serve):
    """Anthropic's live-only continuation (the results alone, their calls left
    out of the history) on two residents: each conversation's results go to
    the resident holding its calls, never to the other's state; once both
    residents moved on, a 409."""
    srv = serve(
        "--sessions",
        "2",
        "--kv-disk-dir",
        str(tmp_path / "kv"),
        name="pool-live-only",
        cls=ScriptedServer,
        tmp=tmp_path,
    )
    firsts = [[{"role": "user", "content": text}] for text in ("Look up 21.", "Please look up 58 for me.")]
    calls = []
    for first in firsts:
        r = create(srv, first)
        assert r.stop_reason == "tool_use"
        calls.append(as_msg(r))
    ns = [next(b["input"]["n"] for b in c["content"] if b["type"] == "tool_use") for c in calls]
    assert ns[0] != ns[1], ns  # the replies tell which state a continuation rendered against
    for n, first, call in zip(ns, firsts, calls, strict=True):
        r2 = create(srv, [*first, tool_results(call)])
        assert r2.content[0].text.startswith(f"Result: value of n={n} "), (n, r2.content)
        assert cached_share(r2.usage) >= 0.95, r2.usage
    assert srv.text_log().count("pool: continuation of session") == 2
    # both residents taken by other conversations: the state is gone, 409
    r = create(srv, [{"role": "user", "content": "Look up 77."}])
    call = as_msg(r)
    for n in (5, 6):
        create(srv, [{"role": "user", "content": f"Look up {n}."}])
    resp = httpx.post(
        srv.base + "/v1/messages",
        headers={"anthropic-version": "2023-06-01"},
        json={
            "model": "m",
            "max_tokens": 50,
            "system": AGENT_SYSTEM,
            "tools": ATOOLS,
            "messages": [{"role": "user", "content": "Look up 77."}, tool_results(call)],
        },
        timeout=120,
    )
    assert resp.status_code == 409, resp.text


def test_sessions_below_one_is_refused_at_start():
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--sessions", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--sessions must be >= 1" in p.stderr, (p.returncode, p.stderr)


def test_sessions_auto_takes_as_many_contexts_as_the_budget_holds(tmp_path, serve):
    from helpers.server import CTX

    from ds4.engines.reference import ReferenceEngine
    from ds4.server.sizing import context_bytes, sessions_for

    per = context_bytes(ReferenceEngine(), CTX)
    assert context_bytes(ReferenceEngine(), 2 * CTX) > per > 0  # measured, and it grows with the context
    assert sessions_for(10 * per, per) == 8 and sessions_for(per // 2, per) == 1 and sessions_for(3 * per, per) == 3
    budget_mb = 3.5 * per / 2**20  # three contexts fit, not four
    srv = serve("--sessions", "auto", "--sessions-mem-mb", f"{budget_mb:.4f}", name="auto", tmp=tmp_path)
    assert len(srv.health()["sessions"]) == 3
    assert "--sessions auto: 3 (" in srv.text_log()


def test_the_default_is_a_pool_sized_from_memory(tmp_path, serve):
    """With no --sessions, ds4 serve sizes its pool from memory (auto): at
    least two residents when two fit, and batched decode where the engine
    has it (the reference engine has not)."""
    from ds4.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.sessions, args.batch_decode) == ("auto", "auto")
    srv = serve(name="default", tmp=tmp_path, start=False)
    at = srv.args.index("--sessions")
    del srv.args[at : at + 2]  # the harness's pin to one session
    assert "--sessions" not in srv.args
    srv.start()
    h = srv.health()
    assert len(h["sessions"]) >= 2, h  # this machine holds two reference contexts many times over
    assert "--sessions auto: " in srv.text_log()
    assert "batched" not in h


def test_sessions_that_do_not_fit_the_budget_are_refused_at_start():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--sessions", "4", "--sessions-mem-mb", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--sessions 4 needs about" in p.stderr, (p.returncode, p.stderr)
    bad = subprocess.run([*cmd[:6], "--sessions", "many"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "expected a number or auto" in bad.stderr, bad.stderr


def test_a_keepalive_that_is_not_positive_is_refused_at_start():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ds4", "serve", "--engine", "reference", "--sse-keepalive", "0"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--sse-keepalive must be > 0" in p.stderr, (p.returncode, p.stderr)
