"""``ds4 serve`` end to end: real server processes on 127.0.0.1, driven with
the official ``openai`` client (and raw ``httpx`` for malformed requests).

The reference engine is bit-exact, so every answer served from the live
session, from a checkpoint or after a restart is compared with the answer of
a cold run: a ``--no-kv-cache`` server whose live session is first replaced
by an unrelated request (the test checks that it reports 0 cached tokens).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from helpers.server import (
    CTX,
    INTERVAL,
    KV_FLAGS,
    assert_error,
    cached_tokens,
    cold_chat,
    ds4_block,
    post_json,
    stored_texts,
    topic_chat,
)

import ds4
from ds4.checkpoint import open_checkpoint


@pytest.fixture(scope="module")
def cold(serve_module):
    return serve_module("--no-kv-cache", name="cold")


@pytest.fixture(scope="module")
def warm(serve_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    srv = serve_module("--kv-quarantine-dir", str(tmp / "quarantine"), *KV_FLAGS, name="warm", tmp=tmp, kv=True)
    srv.quarantine = str(tmp / "quarantine")
    return srv


# ---------------------------------------------------------------------------
def test_models_and_health(warm):
    c = warm.client()
    models = c.models.list()
    assert [m.id for m in models.data] == ["ds4-reference"]
    h = warm.health()
    assert h["status"] == "ok" and h["engine"] == "reference" and h["kv"]["files"] >= 0
    # no absolute path without --debug (test_server_security.py: with it)
    assert "dir" not in h["kv"] and warm.kv_dir not in json.dumps(h)


def test_multi_turn_reports_cached_tokens(warm, cold):
    c, model = warm.client(), warm.model()
    # max_tokens=2 keeps the answers valid UTF-8 (the reference model emits
    # arbitrary bytes), so the client's echo of an answer is byte-exact and
    # later turns extend the live session; turn 4 uses longer, lossy answers.
    msgs = topic_chat("tides")
    rungs = []
    for turn, n_gen in enumerate((2, 2, 2, 12, 6)):
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=n_gen)
        ref = cold_chat(cold, msgs, max_tokens=n_gen)
        text = r.choices[0].message.content
        assert text == ref.choices[0].message.content, f"turn {turn} differs from a cold prefill"
        assert r.choices[0].finish_reason == ref.choices[0].finish_reason
        assert r.usage.prompt_tokens == ref.usage.prompt_tokens
        assert 1 <= r.usage.completion_tokens == ref.usage.completion_tokens <= n_gen
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        x = ds4_block(r)
        rungs.append(x["rung"])
        if turn > 0:
            assert cached_tokens(r) > 0, f"turn {turn} reused nothing: {x}"
            assert cached_tokens(r) == x["reused_tokens"]
            if "\ufffd" not in msgs[-2]["content"]:
                assert x["rung"] == "live", x
            else:  # the echo differs from the live bytes: a checkpoint serves it
                assert x["rung"] in ("disk", "rewrite"), x
        msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": f"And then, part {turn}?"}]
    assert rungs[0] in ("prefill", "disk") and "live" in rungs[1:] and "disk" in rungs[1:]


def test_streaming_chunks_concatenate_to_the_text(warm, cold):
    c, model = warm.client(), warm.model()
    msgs = topic_chat("streams")
    full = c.chat.completions.create(model=model, messages=msgs, max_tokens=20)
    stream = c.chat.completions.create(
        model=model, messages=msgs, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    parts, finish, usage, roles = [], None, None, []
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert roles == ["assistant"]
    assert len(parts) > 1
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: live
    assert full.choices[0].message.content == cold_chat(cold, msgs, max_tokens=20).choices[0].message.content

    # the legacy completions endpoint, both ways
    prompt = "Once upon a time, in a land of tides and streams, there lived"
    a = c.completions.create(model=model, prompt=prompt, max_tokens=12)
    b = c.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True)
    assert "".join(ch.choices[0].text for ch in b if ch.choices) == a.choices[0].text
    assert a.usage.completion_tokens == 12 and a.choices[0].finish_reason == "length"


def test_stop_sequence_leaves_no_tokens_past_the_stop(warm, cold):
    c, model = warm.client(), warm.model()
    msgs = topic_chat("stops")
    ref = cold_chat(cold, msgs, max_tokens=24).choices[0].message.content
    # a two-character ASCII stop inside the answer (ASCII bytes map 1:1 to text)
    stop = next(
        ref[i : i + 2] for i in range(3, len(ref) - 1) if ref[i : i + 2].isascii() and ref[i : i + 2].isprintable()
    )
    before = warm.health()["counters"]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, stop=[stop, "never-seen"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref[: ref.index(stop)]
    after = warm.health()
    # the first byte of the stop was evaluated; the reference engine cannot
    # rewind, so the session must have been invalidated (never left holding it)
    assert after["counters"]["stop_invalidated"] == before["stop_invalidated"] + 1
    assert after["session"]["valid"] is False
    # streaming with a stop gives the same text
    s = c.chat.completions.create(model=model, messages=msgs, max_tokens=24, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == ref[: ref.index(stop)]
    # and the conversation goes on exactly as a cold run
    msgs2 = [*msgs, {"role": "assistant", "content": ref[: ref.index(stop)]}, {"role": "user", "content": "go on"}]
    r2 = c.chat.completions.create(model=model, messages=msgs2, max_tokens=12)
    assert cached_tokens(r2) > 0
    assert r2.choices[0].message.content == cold_chat(cold, msgs2, max_tokens=12).choices[0].message.content


def test_continued_saves_during_prefill_and_generation(warm, cold):
    c, model = warm.client(), warm.model()
    msgs = topic_chat("lighthouses", n_words=2)  # ~200 tokens: frontiers at 128 (prefill) and 256, 384 (generation)
    prompt = ds4.ReferenceEngine().render_chat(msgs).encode()
    n_prompt = len(ds4.ReferenceEngine().tokenize(prompt.decode(), special=True))
    assert INTERVAL < n_prompt < 2 * INTERVAL
    before = warm.health()["counters"]["continued_saves"]
    superseded = warm.health()["kv"]["superseded"]
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=160)
    assert r.usage.completion_tokens == 160 and r.usage.prompt_tokens == n_prompt
    cont = {
        n: t
        for p, (t, reason, n) in stored_texts(warm.kv_dir).items()
        if reason == "continued" and (prompt.startswith(t) or t.startswith(prompt))
    }
    # during generation: the prompt and the tokens generated up to the frontier
    assert 256 in cont and cont[256].startswith(prompt) and len(cont[256]) > len(prompt)
    assert 384 not in cont  # 160 generated tokens end before it
    # during prefill: the aligned prefix of the prompt, saved, then superseded
    # by the longer continued snapshot of its text (issue #23 item 7)
    assert 128 not in cont and warm.health()["kv"]["superseded"] - superseded >= 1
    assert warm.health()["counters"]["continued_saves"] - before == 2
    assert r.choices[0].message.content == cold_chat(cold, msgs, max_tokens=160).choices[0].message.content


def test_corrupt_checkpoint_between_requests(warm, cold):
    c, model = warm.client(), warm.model()
    msgs = topic_chat("glaciers", n_words=18)
    r1 = c.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    # an unrelated request replaces the live session (evict save of this one)
    c.chat.completions.create(model=model, messages=topic_chat("volcanoes"), max_tokens=2)
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "More?"},
    ]
    prompt = ds4.ReferenceEngine().render_chat(msgs2).encode()
    cands = sorted(
        ((len(t), p) for p, (t, _, _) in stored_texts(warm.kv_dir).items() if prompt.startswith(t)), reverse=True
    )
    assert len(cands) >= 2, cands  # evict, continued and cold saves of this conversation
    target = cands[0][1]
    ck = open_checkpoint(target)
    with open(target, "r+b") as f:  # flip one payload bit
        off = ck.payload_offset + ck.payload_bytes // 2
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    del ck
    # read before the request: the turn's own continued save may supersede it
    fallback_tokens = open_checkpoint(cands[1][1], load_payload=False).tokens
    r2 = c.chat.completions.create(model=model, messages=msgs2, max_tokens=10)
    x = ds4_block(r2)
    assert not os.path.exists(target), "the corrupt checkpoint was not removed"
    assert [q.split(".")[0] for q in os.listdir(warm.quarantine)] == [os.path.basename(target)[: -len(".kv")]]
    assert os.listdir(warm.quarantine)[0].endswith(".payload_checksum")
    assert [(os.path.basename(j["path"]), j["code"]) for j in x["rejected"]] == [
        (os.path.basename(target), "payload_checksum")
    ]
    assert x["rung"] == "disk" and x["loaded_path"] == os.path.basename(cands[1][1])  # a name, never a path
    assert warm.kv_dir not in r2.model_dump_json()
    assert cached_tokens(r2) == fallback_tokens
    assert r2.choices[0].message.content == cold_chat(cold, msgs2, max_tokens=10).choices[0].message.content


def test_concurrent_clients(warm, cold):
    model = warm.model()
    topics = ["bread", "chess", "coffee", "rainbows"]
    results: dict = {}
    errors: list = []

    def client(topic):
        try:
            c = warm.client()
            msgs = topic_chat(topic, n_words=4)
            r1 = c.chat.completions.create(model=model, messages=msgs, max_tokens=8)
            msgs2 = [
                *msgs,
                {"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": "Why?"},
            ]
            r2 = c.chat.completions.create(model=model, messages=msgs2, max_tokens=8, stream=topic == "chess")
            if topic == "chess":
                t2 = "".join(ch.choices[0].delta.content or "" for ch in r2 if ch.choices)
            else:
                t2 = r2.choices[0].message.content
            results[topic] = (msgs, r1.choices[0].message.content, msgs2, t2)
        except Exception as e:  # pragma: no cover - reported below
            errors.append((topic, repr(e)))

    threads = [threading.Thread(target=client, args=(t,)) for t in topics]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results) == sorted(topics)
    for topic, (msgs, t1, msgs2, t2) in results.items():
        assert t1 == cold_chat(cold, msgs, max_tokens=8).choices[0].message.content, topic
        assert t2 == cold_chat(cold, msgs2, max_tokens=8).choices[0].message.content, topic
    assert warm.health()["counters"]["errors"] == 0


def test_any_model_name_is_accepted_and_answered_with_the_served_one(warm, cold):
    """Agents send their own model names (ds4-server and llama-server accept
    any): the answer is the served model's, identical to a request naming it."""
    c, model = warm.client(), warm.model()
    msgs = topic_chat("compasses")
    for name in ("gpt-4o", "claude-sonnet", "no-such-model"):
        r = c.chat.completions.create(model=name, messages=msgs, max_tokens=4)
        assert r.model == model
        assert r.choices[0].message.content == cold_chat(cold, msgs, max_tokens=4).choices[0].message.content
    assert [m.id for m in c.models.list().data] == [model]
    assert_error(httpx.get(warm.base + "/v1/models/gpt-4o"), 404, code="model_not_found")


def test_no_max_tokens_means_until_the_end_or_the_context():
    from ds4.server.openai import RequestParser

    body = {"model": "any", "messages": [{"role": "user", "content": "hi"}]}
    assert RequestParser(["m"], 0, ctx=512).chat(body).params.max_tokens == 512
    assert RequestParser(["m"], 16, ctx=512).chat(body).params.max_tokens == 16
    assert RequestParser(["m"], 0, ctx=512).chat({**body, "max_tokens": 3}).params.max_tokens == 3


def test_bad_requests_get_4xx_and_leave_the_server_intact(warm, cold):
    c, model = warm.client(), warm.model()
    msgs = topic_chat("bicycles")
    r0 = c.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    assert "\ufffd" not in r0.choices[0].message.content  # byte-exact echo: the next turn extends the live session
    h0 = warm.health()
    files0 = sorted(os.listdir(warm.kv_dir))
    chat = "/v1/chat/completions"
    assert_error(post_json(warm, chat, '{"model": "x", "messages": [', raw=True), 400, code="invalid_json")
    assert_error(post_json(warm, chat, b"\xff\xfe not json", raw=True), 400, code="invalid_json")
    assert_error(post_json(warm, chat, [1, 2]), 400)
    assert_error(post_json(warm, chat, {"model": model}), 400, param="messages")
    assert_error(post_json(warm, chat, {"messages": msgs}), 400, param="model")
    assert_error(post_json(warm, chat, {"model": model, "messages": "hi"}), 400, param="messages")
    assert_error(
        post_json(warm, chat, {"model": model, "messages": [{"role": "user"}]}), 400, param="messages[0].content"
    )
    assert_error(
        post_json(warm, chat, {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
        400,
        param="messages[0].role",
    )
    assert_error(
        post_json(warm, chat, {"model": model, "messages": msgs, "max_tokens": "ten"}), 400, param="max_tokens"
    )
    assert_error(post_json(warm, chat, {"model": model, "messages": msgs, "max_tokens": 0}), 400, param="max_tokens")
    assert_error(
        post_json(warm, chat, {"model": model, "messages": msgs, "temperature": "hot"}), 400, param="temperature"
    )
    assert_error(post_json(warm, chat, {"model": model, "messages": msgs, "stop": 5}), 400, param="stop")
    assert_error(post_json(warm, chat, {"model": model, "messages": msgs, "stream": "yes"}), 400, param="stream")
    assert_error(post_json(warm, chat, {"model": model, "messages": msgs, "n": 2}), 400, param="n")
    too_long = [{"role": "user", "content": "x" * (CTX + 100)}]
    assert_error(post_json(warm, chat, {"model": model, "messages": too_long}), 400, code="context_length_exceeded")
    assert_error(
        post_json(warm, chat, {"model": model, "messages": too_long, "stream": True}),
        400,
        code="context_length_exceeded",
    )
    assert_error(post_json(warm, "/v1/completions", {"model": model}), 400, param="prompt")
    assert_error(post_json(warm, "/v1/completions", {"model": model, "prompt": 7}), 400, param="prompt")
    assert_error(httpx.get(warm.base + "/v1/nothing-here"), 404)
    assert_error(httpx.get(warm.base + chat), 405)
    # the official client sees typed errors
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=msgs, n=3)
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model=model, prompt="y" * (CTX + 5))
    assert ei.value.code == "context_length_exceeded"
    # nothing was touched: same live session, same files, no engine errors
    h1 = warm.health()
    assert h1["session"] == h0["session"] and h0["session"]["valid"]
    assert sorted(os.listdir(warm.kv_dir)) == files0
    # only the prompts over the context reached the worker (it tokenizes), and were rejected
    assert h1["counters"]["requests"] - h0["counters"]["requests"] == 3
    assert h1["counters"]["rejected"] - h0["counters"]["rejected"] == 3
    assert h1["counters"]["errors"] == h0["counters"]["errors"]
    # and it keeps serving from its cache
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": r0.choices[0].message.content},
        {"role": "user", "content": "Go on."},
    ]
    r = c.chat.completions.create(model=model, messages=msgs2, max_tokens=6)
    assert ds4_block(r)["rung"] == "live" and cached_tokens(r) == h0["session"]["n_past"]
    assert r.choices[0].message.content == cold_chat(cold, msgs2, max_tokens=6).choices[0].message.content


def test_client_disconnect_mid_stream(warm, cold):
    model = warm.model()
    msgs = topic_chat("disconnects")
    c0 = warm.health()["counters"]
    with httpx.stream(
        "POST",
        warm.base + "/v1/chat/completions",
        timeout=60,
        json={"model": model, "messages": msgs, "max_tokens": 1500, "stream": True},
    ) as resp:
        assert resp.status_code == 200
        n = 0
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                n += 1
                if n >= 3:
                    break
    deadline = time.monotonic() + 30
    while True:
        h = warm.health()
        if (
            h["counters"]["requests"] > c0["requests"]
            and not h["busy"]
            and h["counters"]["cancelled"] > c0["cancelled"]
        ):
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    gen = h["counters"]["completion_tokens"] - c0["completion_tokens"]
    assert 1 <= gen < 1500, gen  # stopped early
    # the session is valid at exactly what was evaluated: the prompt and
    # every token generated before the cancel was seen
    prompt_n = h["counters"]["prompt_tokens"] - c0["prompt_tokens"]
    assert h["session"]["valid"] and h["session"]["n_past"] == prompt_n + gen
    # and the next request is served correctly
    msgs2 = topic_chat("after-disconnect")
    r = warm.client().chat.completions.create(model=model, messages=msgs2, max_tokens=8)
    assert r.choices[0].message.content == cold_chat(cold, msgs2, max_tokens=8).choices[0].message.content


def test_shutdown_save_and_restart_resume_from_disk(tmp_path, serve, cold):
    kv = str(tmp_path / "kv")
    srv = serve("--kv-disk-dir", kv, *KV_FLAGS, name="first", tmp=tmp_path)
    c, model = srv.client(), srv.model()
    msgs = topic_chat("harbours", n_words=6)
    r1 = c.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    live_n = srv.health()["session"]["n_past"]
    srv.stop(signal.SIGTERM)
    log = srv.text_log()
    assert f"persisting current KV cache before shutdown tokens={live_n}" in log, log
    shut = [p for p, (t, reason, n) in stored_texts(kv).items() if reason == "shutdown"]
    assert len(shut) == 1 and open_checkpoint(shut[0], load_payload=False).tokens == live_n
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Tell me more."},
    ]
    srv2 = serve("--kv-disk-dir", kv, *KV_FLAGS, name="second", tmp=tmp_path)
    r2 = srv2.client().chat.completions.create(model=model, messages=msgs2, max_tokens=12)
    srv2.stop(signal.SIGINT)
    x = ds4_block(r2)
    assert x["rung"] == "disk" and x["loaded_path"] == os.path.basename(shut[0]), x
    assert cached_tokens(r2) == live_n
    assert r2.choices[0].message.content == cold_chat(cold, msgs2, max_tokens=12).choices[0].message.content
    assert "persisting current KV cache before shutdown" in srv2.text_log()  # SIGINT too


def test_llamacpp_two_turns_match_a_cold_server(tmp_path, serve):
    import llama_cpp  # noqa: F401  (CI installs it; this test must not be skipped)

    warm = serve(*KV_FLAGS, "--threads", "2", name="llama-warm", tmp=tmp_path, kv=True, engine="llamacpp")
    cold = serve("--no-kv-cache", "--threads", "2", name="llama-cold", tmp=tmp_path, engine="llamacpp")
    model = warm.model()
    assert model == cold.model() and "SmolLM2" in model
    cw, cc = warm.client(), cold.client()
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    a1 = cw.chat.completions.create(model=model, messages=msgs, max_tokens=16)
    b1 = cc.chat.completions.create(model=model, messages=msgs, max_tokens=16)
    assert a1.choices[0].message.content == b1.choices[0].message.content
    assert "Paris" in a1.choices[0].message.content
    msgs2 = [
        *msgs,
        {"role": "assistant", "content": a1.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    # the cold server's live session is replaced first, so its turn 2 is a full prefill
    cc.completions.create(model=model, prompt="Hello", max_tokens=1)
    b2 = cc.chat.completions.create(model=model, messages=msgs2, max_tokens=16)
    assert cached_tokens(b2) == 0
    a2 = cw.chat.completions.create(model=model, messages=msgs2, max_tokens=16)
    assert cached_tokens(a2) > 0 and ds4_block(a2)["rung"] == "live"
    assert a2.choices[0].message.content == b2.choices[0].message.content
    assert "Rome" in a2.choices[0].message.content
