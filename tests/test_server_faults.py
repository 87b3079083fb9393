"""Whose fault a failed job is: a refusal of the request's input is typed
where the input is judged (:class:`ds4.errors.PromptError` and its kinds,
the agent turn's ``LiveStateGone``) and answered 4xx, counted ``rejected``;
anything else raised in a turn is the server's, whatever its class (an
engine's ``ValueError`` of a bug included): 500, counted ``errors``, logged
with its traceback, and the next request is served as if it had not
happened.

In process (Starlette's test client over the app and one worker), on the
reference engine."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from ds4.engines.reference import ReferenceContext
from ds4.server.app import create_app
from ds4.server.conversation import new_call_id
from ds4.server.worker import Service
from ds4.turn import TurnDriver

CTX = 512


@pytest.fixture
def client(eng):
    service = Service(TurnDriver(eng, CTX), "ds4-reference")
    with TestClient(create_app(service), base_url="http://127.0.0.1") as c:
        c.service = service
        yield c


def _body(topic: str, max_tokens: int = 4) -> dict:
    return {
        "model": "any",
        "messages": [{"role": "user", "content": f"Tell me about {topic}."}],
        "max_tokens": max_tokens,
    }


def _counters(client) -> dict:
    # the worker's own (/health shows a snapshot taken after the reply)
    return client.service.gen.counters


# the session passes an engine's ValueError through (it was the one class a
# 400 was made of) and wraps any other exception in an EngineError
@pytest.mark.parametrize(("exc", "code"), [(ValueError, "internal_error"), (TypeError, "engine_error")])
def test_an_internal_error_in_the_engine_is_a_500_and_the_next_turn_is_served(client, monkeypatch, caplog, exc, code):
    body = _body("tides")
    want = client.post("/v1/chat/completions", json=body)
    assert want.status_code == 200
    answer = want.json()["choices"][0]["message"]["content"]

    real = ReferenceContext.eval
    armed = [True]

    def faulty(self, tokens, progress=None):
        if armed and len(tokens) == 1:  # a decode step of the next turn: an engine bug
            armed.clear()
            raise exc("an engine bug, not the client's input")
        return real(self, tokens, progress)

    monkeypatch.setattr(ReferenceContext, "eval", faulty)
    with caplog.at_level(logging.ERROR, logger="ds4.server"):
        r = client.post("/v1/chat/completions", json=_body("the moon"))
    assert not armed, "the fault was not reached"
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == code
    assert ("EngineError" if exc is TypeError else exc.__name__) in err["message"]
    assert "not the client's input" not in err["message"]  # the exception's text only with --debug
    assert any("failed" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    c = _counters(client)
    assert c["errors"] == 1 and c["rejected"] == 0

    # the failed turn's state is not kept; the next request is served, and
    # answers as before the fault (the reference engine is bit-exact)
    again = client.post("/v1/chat/completions", json=body)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == answer
    assert client.service.gen.sess.checkpoint_valid
    assert _counters(client)["errors"] == 1


def test_a_refused_prompt_is_still_a_400_counted_as_rejected(client):
    ok = client.post("/v1/chat/completions", json=_body("tides"))
    assert ok.status_code == 200
    live = client.service.gen.sess.tokens
    long = {"model": "any", "messages": [{"role": "user", "content": "x " * CTX}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=long)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    c = _counters(client)
    assert c["rejected"] == 1 and c["errors"] == 0
    assert client.service.gen.sess.checkpoint_valid and client.service.gen.sess.tokens == live  # untouched


def test_a_responses_continuation_without_live_state_is_still_a_409(client):
    # a call id this process issued (an unknown one is a 400: ds4-server's split)
    body = {
        "model": "any",
        "input": [{"type": "function_call_output", "call_id": new_call_id("call_"), "output": "42"}],
        "max_output_tokens": 2,
    }
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 409, r.text
    assert "replaying the full input history" in r.json()["error"]["message"]
    c = _counters(client)
    assert c["rejected"] == 1 and c["errors"] == 0
