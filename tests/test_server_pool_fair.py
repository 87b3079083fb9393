"""Fair scheduling on a pool (``ds4 serve --sessions N``): concurrent
requests on different residents advance together, token by token and
prefill chunk by chunk (:class:`ds4.server.baton.Baton`), so a long
generation does not hold a short turn behind it, and every reply stays what
a cold single-session server gives.

The order of events is what is asserted, never a duration: each client
thread stamps its first token and its end from one shared counter, so "all
four produced a token before any finished" is a fact about the order the
server interleaved them in. The scripted engine's ``LONG n`` turns make
generations of a known length and text; the reference engine's real
transformer (random weights) checks that interleaving changes no logit.
"""

from __future__ import annotations

import itertools
import re
import threading

import httpx
import pytest
from helpers.agents import ScriptedServer
from helpers.server import TOPICS, cached_tokens, cold_chat, ds4_block, pool_server, topic_chat
from helpers.together import at_once

from ds4.server.baton import Baton

_order = itertools.count()
_order_lock = threading.Lock()


def _stamp() -> int:
    with _order_lock:
        return next(_order)


def _done_order(srv) -> list[int]:
    """The generated-token counts of the server's finished turns, in the
    order the server finished them (its log: the server's own order, not
    the clients' reading of it)."""
    return [int(m) for m in re.findall(r"request done .*? gen=(\d+) ", srv.text_log())]


def _long(n: int) -> str:
    return ("la " * (n // 3 + 1))[:n]


class Stream(threading.Thread):
    """One streamed chat in its own thread: its text, and the order stamps
    of its first content token and of its end."""

    def __init__(self, srv, content: str, max_tokens: int, stop_after: int | None = None):
        super().__init__(daemon=True)
        self.srv, self.content, self.max_tokens, self.stop_after = srv, content, max_tokens, stop_after
        self.text, self.first, self.end = "", None, None
        self.finish = None
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            c = self.srv.client()
            msgs = [{"role": "user", "content": self.content}]
            with c.chat.completions.create(
                model=self.srv.model(), messages=msgs, max_tokens=self.max_tokens, stream=True
            ) as s:
                for chunk in s:
                    if not chunk.choices:
                        continue
                    ch = chunk.choices[0]
                    if ch.delta.content:
                        if self.first is None:
                            self.first = _stamp()
                            self.started.set()
                        self.text += ch.delta.content
                        if self.stop_after is not None and len(self.text) >= self.stop_after:
                            break  # the client leaves mid-generation
                    if ch.finish_reason:
                        self.finish = ch.finish_reason
        except BaseException as e:  # reported by the test's join
            self.error = e
        finally:
            self.end = _stamp()
            self.started.set()

    def result(self, timeout: float = 240.0) -> Stream:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error
        return self


@pytest.fixture
def pool4(serve, tmp_path):
    return serve("--sessions", "4", "--no-kv-cache", name="fair4", cls=ScriptedServer, tmp=tmp_path)


def test_four_concurrent_streams_all_produce_tokens_before_any_finishes(pool4):
    n = 1500
    streams = [Stream(pool4, f"Conversation {k}: LONG {n}", max_tokens=n + 8) for k in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        s.result()
    for s in streams:
        assert s.text == _long(n) and s.finish == "stop", (s.content, len(s.text), s.finish)
    firsts, ends = [s.first for s in streams], [s.end for s in streams]
    assert max(firsts) < min(ends), (firsts, ends)
    h = pool4.health()
    assert h["levels"] == {"prefill": 4}, h["levels"]
    assert sorted(s["served"] for s in h["sessions"]) == [1, 1, 1, 1]  # one resident each
    assert not h["busy"] and h["running"] == 0


def test_a_short_request_behind_a_long_generation_gets_its_turn(pool4):
    long = Stream(pool4, "A long one: LONG 2000", max_tokens=2100)
    long.start()
    assert long.started.wait(120) and long.first is not None, "the long generation never started"
    short = Stream(pool4, "A short one.", max_tokens=32)
    short.start()
    short.result()
    long.result()
    assert short.text == "Hello from the script." and long.text == _long(2000)
    assert short.first < long.end and short.end < long.end, (short.first, short.end, long.end)
    assert _done_order(pool4) == [len(short.text), 2000], _done_order(pool4)


def test_one_session_serves_in_arrival_order(tmp_path, serve):
    """The default (one resident, one lane) is today's server: the short
    request waits for the whole long generation."""
    srv = serve("--no-kv-cache", name="fair1", cls=ScriptedServer, tmp=tmp_path)
    long = Stream(srv, "A long one: LONG 600", max_tokens=700)
    long.start()
    assert long.started.wait(120) and long.first is not None
    short = Stream(srv, "A short one.", max_tokens=32)
    short.start()
    long.result()
    short.result()
    assert short.text == "Hello from the script." and long.text == _long(600)
    assert _done_order(srv) == [600, len(short.text)], _done_order(srv)


def test_a_client_leaving_stops_only_its_own_session_which_stays_valid(pool4):
    n = 1200
    leaver = Stream(pool4, "The leaver: LONG 1200", max_tokens=n + 8, stop_after=40)
    stayers = [Stream(pool4, f"Stayer {k}: LONG {n}", max_tokens=n + 8) for k in range(2)]
    for s in [leaver, *stayers]:
        s.start()
    for s in [leaver, *stayers]:
        s.result()
    assert all(s.text == _long(n) and s.finish == "stop" for s in stayers)
    assert _long(n).startswith(leaver.text) and len(leaver.text) < n
    # the leaver's resident stopped at the next token, its state valid there
    sessions = pool4.health()["sessions"]
    assert all(s["valid"] for s in sessions if s["served"]), sessions
    assert "client disconnected; stopped after" in pool4.text_log()


def _at_once(srv, convs: dict[str, list], max_tokens: int) -> dict[str, object]:
    """One request per conversation, all sent at once; their responses."""
    model = srv.model()
    return at_once(
        lambda t: srv.client().chat.completions.create(model=model, messages=convs[t], max_tokens=max_tokens),
        convs,
        240,
    )


def test_concurrent_conversations_are_exact_and_live_on_the_reference_model(tmp_path, serve):
    """Four conversations of the reference transformer, each turn's four
    requests sent at once (their ~1,300-token prefills interleaved chunk by
    chunk): every reply equals a cold single-session server's, and every
    turn after the first is a live hit on its own resident. A last turn of
    48 tokens each, interleaved token by token, is exact too. (Two-token
    turns: the random model's longer replies are seldom valid UTF-8, so a
    client could not echo them byte-exact for a live hit.)"""

    (tmp_path / "c").mkdir()
    cold = serve("--no-kv-cache", name="cold", tmp=tmp_path / "c")
    srv = pool_server(serve, tmp_path, "pool4-concurrent", 4)
    convs = {t: topic_chat(t, 100) for t in TOPICS}
    for turn in range(4):
        last = turn == 3
        got = _at_once(srv, convs, 48 if last else 2)
        for t in TOPICS:
            r = got[t]
            ref = cold_chat(cold, convs[t], max_tokens=48 if last else 2)
            assert r.choices[0].message.content == ref.choices[0].message.content, (t, turn)
            if turn:
                assert "\ufffd" not in convs[t][-2]["content"], "pick topics whose replies echo byte-exact"
                assert ds4_block(r)["rung"] == "live", (t, turn, ds4_block(r))
                assert cached_tokens(r) >= 0.95 * r.usage.prompt_tokens
            text = r.choices[0].message.content
            convs[t] = [
                *convs[t],
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And then, part {turn}?"},
            ]
    h = srv.health()
    # the first turns: a prefill, or a disk hit on the shared system prompt another lane's prefill stored
    assert h["levels"]["live"] == 12 and h["levels"].get("prefill", 0) + h["levels"].get("disk", 0) == 4
    assert h["levels"]["prefill"] >= 1, h["levels"]
    assert sorted(s["served"] for s in h["sessions"]) == [4, 4, 4, 4]


# -- the baton itself ---------------------------------------------------------
def test_the_baton_hands_over_in_arrival_order_and_only_when_someone_waits():
    b = Baton()
    order: list[str] = []
    b.acquire()
    b.pass_()  # nobody waits: kept, no handover
    assert b.handovers == 0
    ready = [threading.Event() for _ in range(2)]

    def lane(name: str, k: int) -> None:
        ready[k].set()
        with b:
            order.append(name)

    ts = []
    for k, name in enumerate(("first", "second")):
        t = threading.Thread(target=lane, args=(name, k))
        t.start()
        ready[k].wait()
        while b.waiting < k + 1:  # the lane is queued behind the holder
            threading.Event().wait(0.001)
        ts.append(t)
    b.pass_()  # both run, in the order they queued, before the holder gets it back
    assert order == ["first", "second"] and b.handovers == 1
    b.release()
    for t in ts:
        t.join()
    with pytest.raises(RuntimeError):
        b.release()  # not held


def test_the_health_levels_count_the_rung_of_every_turn(tmp_path, serve):
    srv = pool_server(serve, tmp_path, "levels", 2)
    msgs = topic_chat("rivers", 100)
    r = srv.client().chat.completions.create(model=srv.model(), messages=msgs, max_tokens=2)
    nxt = [*msgs, {"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "?"}]
    srv.client().chat.completions.create(model=srv.model(), messages=nxt, max_tokens=2)
    h = httpx.get(srv.base + "/health").json()
    assert h["levels"] == {"prefill": 1, "live": 1}, h["levels"]
    assert [s["last_rung"] for s in h["sessions"]] == ["live", None], h["sessions"]


def test_agents_starting_together_prefill_their_shared_system_prompt_once(tmp_path, serve):
    """Four conversations with one long system prompt sent at once: one lane
    prefills it (storing its cold checkpoint), the other three wait for that
    prefill instead of prefilling the same tokens beside it, then resume from
    the checkpoint; every reply equals a cold server's."""
    from helpers.server import SYSTEM

    system = SYSTEM + " " + " ".join(f"Rule {i}: keep every answer short and exact." for i in range(30))
    convs = {
        t: [{"role": "system", "content": system}, {"role": "user", "content": f"Tell me of {t}."}] for t in TOPICS
    }
    (tmp_path / "c").mkdir()
    cold = serve("--no-kv-cache", name="cold", tmp=tmp_path / "c")
    srv = pool_server(serve, tmp_path, "pool4-shared", 4)
    got = _at_once(srv, convs, 4)
    for t in TOPICS:
        ref = cold_chat(cold, convs[t], max_tokens=4)
        assert got[t].choices[0].message.content == ref.choices[0].message.content, t
    levels = srv.health()["levels"]
    assert levels == {"prefill": 1, "disk": 3}, levels
    cached = sorted(cached_tokens(r) / r.usage.prompt_tokens for r in got.values())
    assert cached[0] == 0 and all(c >= 0.9 for c in cached[1:]), cached  # one full prefill, three resumes
