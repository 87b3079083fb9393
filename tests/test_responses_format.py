"""Issue 21, item 4: ``text.format`` on ``POST /v1/responses`` constrains
the reply as chat's ``response_format`` does (the reference engine under
the grammar: its random weights follow the schema only because decoding is
constrained), and the response object echoes the format. A real ``ds4
serve`` on loopback, driven by the official ``openai`` client (and the
OpenAI Agents SDK when it is installed)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from helpers.server import KV_FLAGS, assert_error, post_json, topic_chat
from openai.lib._parsing._responses import type_to_text_format_param
from test_server_constrain import SCHEMA, Trip


@pytest.fixture(scope="module")
def srv(serve_module):
    return serve_module(*KV_FLAGS, name="responses-format", kv=True)


@pytest.fixture
def c(srv):
    with srv.client() as client:
        yield client


def _ask(topic: str) -> tuple[str, str]:
    """(instructions, input) of the conversation test_server_constrain asks
    on chat (the same rendering: a system turn, then the user's)."""
    system, user = topic_chat(topic)
    return system["content"], user["content"]


def _format(schema=SCHEMA, name="trip", strict=True) -> dict:
    return {"type": "json_schema", "name": name, "schema": schema, "strict": strict}


def test_parse_with_a_pydantic_model(srv, c):
    """``client.responses.parse(text_format=Model)``: the client sends the
    model's strict schema, the reply follows it, and the response says so."""
    model = srv.model()
    for topic in ("harbours", "valleys"):
        instructions, user = _ask(topic)
        r = c.responses.parse(
            model=model, instructions=instructions, input=user, max_output_tokens=200, text_format=Trip
        )
        assert r.status == "completed", r.output_text
        trip = r.output_parsed
        assert isinstance(trip, Trip) and 1 <= trip.days <= 14, r.output_text
        fmt = r.text.format
        assert (fmt.type, fmt.name, fmt.strict) == ("json_schema", "Trip", True)
        assert fmt.schema_ == type_to_text_format_param(Trip)["schema"]  # what the client sent


def test_the_same_reply_as_chat_response_format(srv, c):
    """One conversation, one schema: chat's ``response_format`` and
    Responses' ``text.format`` decode the same JSON (greedy, the same
    rendering), stored and retrievable with its format."""
    model = srv.model()
    instructions, user = _ask("journeys")
    chat = c.chat.completions.create(
        model=model,
        messages=topic_chat("journeys"),
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}},
    )
    text = chat.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    raw = c.responses.with_raw_response.create(
        model=model,
        instructions=instructions,
        input=user,
        max_output_tokens=200,
        temperature=0,
        text={"format": _format()},
    )
    r = raw.parse()
    assert r.output_text == text
    want = {"type": "json_schema", "name": "trip", "schema": SCHEMA, "description": None, "strict": True}
    assert raw.http_response.json()["text"] == {"format": want}
    assert c.responses.with_raw_response.retrieve(r.id).http_response.json()["text"] == {"format": want}
    # streamed: the same JSON, and the format in the created and completed events
    events = list(
        c.responses.create(
            model=model,
            instructions=instructions,
            input=user,
            max_output_tokens=200,
            temperature=0,
            text={"format": _format()},
            stream=True,
        )
    )
    assert events[0].type == "response.created" and events[0].response.text.format.type == "json_schema"
    assert events[-1].type == "response.completed" and events[-1].response.output_text == text


def test_json_object_and_text(srv, c):
    """``json_object``: any JSON object, echoed; ``text`` (or no ``text``):
    no constraint, the unconstrained reply, echoed as ``text``."""
    model = srv.model()
    instructions, user = _ask("objects")
    r = c.responses.create(
        model=model,
        instructions=instructions,
        input=user,
        max_output_tokens=300,
        text={"format": {"type": "json_object"}},
    )
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict), r.output_text
    assert r.text.format.type == "json_object"
    plain = c.responses.create(model=model, instructions=instructions, input=user, max_output_tokens=8)
    fmt_text = c.responses.create(
        model=model, instructions=instructions, input=user, max_output_tokens=8, text={"format": {"type": "text"}}
    )
    assert plain.output_text == fmt_text.output_text
    assert plain.text.format.type == fmt_text.text.format.type == "text"


@pytest.mark.parametrize(
    "text, param, code",
    [
        ({"format": _format({"type": "object", "required": 5})}, "text.format.schema", "invalid_json_schema"),
        ({"format": _format({"type": "string", "pattern": "(("})}, "text.format.schema", "invalid_json_schema"),
        ({"format": _format({"type": "no-such-type"})}, "text.format.schema", "invalid_json_schema"),
        ({"format": _format(name="bad name!")}, "text.format.name", "invalid_value"),
        ({"format": _format(schema=[1])}, "text.format.schema", "invalid_type"),
        ({"format": {"type": "json_schema", "name": "x"}}, "text.format.schema", "missing_required_parameter"),
        ({"format": {"type": "json_schema", "schema": {}}}, "text.format.name", "missing_required_parameter"),
        ({"format": {**_format(), "strict": "yes"}}, "text.format.strict", "invalid_type"),
        ({"format": {"type": "yaml"}}, "text.format.type", "invalid_value"),
        ({"format": "json"}, "text.format", "invalid_type"),
        ("json", "text", "invalid_type"),
    ],
)
def test_a_bad_format_is_a_400_and_touches_nothing(srv, c, text, param, code):
    """A format the server cannot enforce (a schema llguidance rejects
    included) is a 400 in the Responses error shape, before any job."""
    model = srv.model()
    instructions, user = _ask("refusals")
    c.responses.create(model=model, instructions=instructions, input=user, max_output_tokens=2)
    h0 = srv.health()
    files0 = sorted(os.listdir(srv.kv_dir))
    body = {"model": model, "instructions": instructions, "input": user, "text": text}
    err = assert_error(post_json(srv, "/v1/responses", body), 400, param=param)
    assert (err["type"], err["code"]) == ("invalid_request_error", code)
    h1 = srv.health()
    assert h1["session"] == h0["session"] and h1["counters"]["requests"] == h0["counters"]["requests"]
    assert sorted(os.listdir(srv.kv_dir)) == files0


def test_a_rejected_schema_through_the_official_client(srv, c):
    with pytest.raises(openai.BadRequestError) as ei:
        c.responses.create(model=srv.model(), input="hi", text={"format": _format({"type": "object", "required": 5})})
    assert ei.value.status_code == 400 and "Invalid schema" in str(ei.value)
    assert ei.value.body["param"] == "text.format.schema" and ei.value.body["code"] == "invalid_json_schema"


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    reason: str = pydantic.Field(max_length=12)


def test_an_agent_with_an_output_type(srv):
    """The OpenAI Agents SDK: ``Agent(output_type=...)`` over the Responses
    model asks for a strict JSON schema and parses the final output."""
    import agents  # openai-agents, pinned in requirements-dev.txt (never skipped)

    agents.set_tracing_disabled(True)  # nothing is sent anywhere but the server

    async def run():
        async with openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0) as client:
            agent = agents.Agent(
                name="judge",
                instructions="Answer yes or no, with a short reason.",
                model=agents.OpenAIResponsesModel(model=srv.model(), openai_client=client),
                output_type=Verdict,
                model_settings=agents.ModelSettings(max_tokens=120),
            )
            return await agents.Runner.run(agent, "Is the harbour open on Sundays?")

    result = asyncio.run(run())
    assert isinstance(result.final_output, Verdict), result.final_output
    assert result.final_output.answer in ("yes", "no") and len(result.final_output.reason) <= 12
