"""``response_format`` on ``/v1/chat/completions`` against a real ``ds4
serve`` on loopback, driven by the official ``openai`` client (the reference
engine): JSON under a schema, any JSON object, the client's own structured
output helper, and bad formats answered 400 with nothing touched."""

from __future__ import annotations

import json
import os
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from helpers.server import KV_FLAGS, assert_error, cached_tokens, ds4_block, post_json, topic_chat

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "mode": {"enum": ["train", "bike", "boat"]},
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["city", "days", "mode", "stops"],
    "additionalProperties": False,
}


def _fmt(schema=SCHEMA, name="trip", strict=True):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def srv(serve_module):
    return serve_module(*KV_FLAGS, name="constrain", kv=True)


@pytest.fixture
def c(srv):
    """An official client, closed after the test (no socket left to the GC)."""
    with srv.client() as client:
        yield client


def test_json_schema_with_the_official_client(srv, c):
    model = srv.model()
    msgs = topic_chat("journeys")
    r = c.chat.completions.create(model=model, messages=msgs, max_tokens=200, response_format=_fmt())
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    n_live = srv.health()["session"]["n_past"]
    # streamed: the same text in pieces, the same finish
    s = c.chat.completions.create(model=model, messages=msgs, max_tokens=200, response_format=_fmt(), stream=True)
    parts, finish = [], None
    for ch in s:
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == text and finish == "stop"
    assert srv.health()["session"]["n_past"] == n_live
    # the next turn (the JSON echoed back) continues from the live tokens
    msgs2 = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "Another trip?"}]
    r2 = c.chat.completions.create(model=model, messages=msgs2, max_tokens=200, response_format=_fmt(strict=False))
    assert ds4_block(r2)["rung"] == "live" and cached_tokens(r2) == n_live
    jsonschema.validate(json.loads(r2.choices[0].message.content), SCHEMA)


class Trip(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    days: int = pydantic.Field(ge=1, le=14)
    mode: Literal["train", "bike", "boat"]


def test_the_clients_structured_output_helper(srv, c):
    """``client.chat.completions.parse(response_format=Model)``: the client
    builds a strict schema from the pydantic model and parses the answer."""
    model = srv.model()
    for topic in ("harbours", "valleys"):
        r = c.chat.completions.parse(model=model, messages=topic_chat(topic), max_tokens=200, response_format=Trip)
        trip = r.choices[0].message.parsed
        assert isinstance(trip, Trip) and 1 <= trip.days <= 14, r.choices[0].message.content


def test_json_object(srv, c):
    model = srv.model()
    r = c.chat.completions.create(
        model=model, messages=topic_chat("objects"), max_tokens=300, response_format={"type": "json_object"}
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    # {"type": "text"} is no constraint at all: the unconstrained answer
    plain = c.chat.completions.create(model=model, messages=topic_chat("objects"), max_tokens=8)
    text_fmt = c.chat.completions.create(
        model=model, messages=topic_chat("objects"), max_tokens=8, response_format={"type": "text"}
    )
    assert plain.choices[0].message.content == text_fmt.choices[0].message.content


@pytest.mark.parametrize(
    "rf, param",
    [
        (_fmt({"type": "no-such-type"}), "response_format"),
        (_fmt({"type": "string", "pattern": "(("}), "response_format"),
        (_fmt({"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "response_format"),
        (_fmt({"type": "string", "minLength": 4, "maxLength": 2}), "response_format"),
        (_fmt(name="bad name!"), "response_format.json_schema.name"),
        (_fmt(schema=[1]), "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}, None),
        ({"type": "yaml"}, "response_format.type"),
        ("json", "response_format"),
    ],
)
def test_bad_response_format_is_a_400_and_touches_nothing(srv, c, rf, param):
    model = srv.model()
    msgs = topic_chat("refusals")
    c.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    h0 = srv.health()
    files0 = sorted(os.listdir(srv.kv_dir))
    resp = post_json(srv, "/v1/chat/completions", {"model": model, "messages": msgs, "response_format": rf})
    err = assert_error(resp, 400, param=param)
    assert err["type"] == "invalid_request_error"
    h1 = srv.health()
    assert h1["session"] == h0["session"] and h0["session"]["valid"]
    assert h1["counters"]["requests"] == h0["counters"]["requests"]  # refused before a job existed
    assert sorted(os.listdir(srv.kv_dir)) == files0


def test_bad_schema_through_the_official_client(srv, c):
    model = srv.model()
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(
            model=model, messages=topic_chat("errors"), response_format=_fmt({"type": "object", "required": 5})
        )
    assert ei.value.status_code == 400 and "Invalid schema" in str(ei.value)
    assert httpx.get(srv.base + "/health", timeout=10).json()["counters"]["errors"] == 0


def test_the_request_is_parsed_off_the_event_loop(monkeypatch):
    """Compiling a response_format schema can take seconds (5,000 properties
    with patterns: about 2.7 s here), so /v1/chat/completions parses its
    body on a worker thread, never on the event loop: while the parser runs,
    no loop is running in its thread."""
    import asyncio

    from starlette.testclient import TestClient

    import ds4
    from ds4.server.app import create_app
    from ds4.server.openai import RequestParser
    from ds4.server.worker import Service
    from ds4.turn import TurnDriver

    seen = []
    real = RequestParser.chat

    def spy(self, raw):
        try:
            asyncio.get_running_loop()
            seen.append("on the loop")
        except RuntimeError:
            seen.append("off the loop")
        return real(self, raw)

    monkeypatch.setattr(RequestParser, "chat", spy)
    service = Service(TurnDriver(ds4.ReferenceEngine(), 512), "ds4-reference")
    with TestClient(create_app(service), base_url="http://127.0.0.1") as client:
        body = {"model": "any", "messages": topic_chat("threads"), "max_tokens": 2, "response_format": _fmt()}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        bad = {**body, "response_format": _fmt({"type": "nope"})}
        assert client.post("/v1/chat/completions", json=bad).status_code == 400
    assert seen == ["off the loop", "off the loop"]
