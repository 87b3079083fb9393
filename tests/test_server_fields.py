"""The request-field tests the three protocols share (ds4.server.fields)."""

from __future__ import annotations

import pytest

from ds4.server.anthropic import MessagesParser
from ds4.server.fields import int_from, is_int, is_num, num_in, utf8_len
from ds4.server.openai import RequestParser
from ds4.server.response_store import MemoryRecords, StoredResponses
from ds4.server.responses import ResponsesParser
from ds4.server.wire import ApiError


def test_a_boolean_is_neither_an_integer_nor_a_number():
    assert is_int(3) and is_num(3) and is_num(0.5)
    assert not is_int(True) and not is_num(False)
    assert not is_int(2.0) and not is_num("1") and not is_num(None)


def test_ranges_include_their_ends_and_reject_what_is_not_a_number():
    assert num_in(0, 0.0, 1.0) and num_in(1.0, 0.0, 1.0) and num_in(0.5, 0.0, 1.0)
    assert not num_in(1.01, 0.0, 1.0) and not num_in(-0.1, 0.0, 1.0) and not num_in(True, 0.0, 1.0)
    assert int_from(1, 1) and int_from(7, 0)
    assert not int_from(0, 1) and not int_from(True, 0) and not int_from(1.0, 1)


def test_utf8_len_counts_bytes_and_refuses_a_lone_surrogate():
    assert utf8_len("") == 0 and utf8_len("héllo") == 6 and utf8_len("\U0001f600") == 4
    assert utf8_len("ok \ud800") is None


# -- each protocol keeps its own wording and shape ------------------------------------
def _refusal(parse, body):
    with pytest.raises(ApiError) as ei:
        parse(body)
    e = ei.value
    return e.status, e.message, e.param, e.code


MSG = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
RESP = {"model": "m", "input": "hi"}


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"temperature": True}, "temperature: must be a number between 0.0 and 1.0"),
        ({"temperature": 1.5}, "temperature: must be a number between 0.0 and 1.0"),
        ({"top_k": False}, "top_k: must be an integer >= 0"),
        ({"max_tokens": 0}, "max_tokens: must be an integer >= 1"),
        ({"system": "a \ud800"}, "system: is not valid Unicode (a lone surrogate)"),
        ({"model": 3}, "model: must be a string"),
    ],
)
def test_anthropic_fields_are_refused_in_anthropics_words(extra, want):
    parse = MessagesParser(16, 512).messages
    assert _refusal(parse, {**MSG, **extra}) == (400, want, None, None)
    assert parse(MSG).params.max_tokens == 8


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"temperature": True}, ("'temperature' must be a number between 0.0 and 2.0", "temperature", "invalid_value")),
        ({"top_p": 1.5}, ("'top_p' must be a number between 0.0 and 1.0", "top_p", "invalid_value")),
        (
            {"max_output_tokens": True},
            ("'max_output_tokens' must be an integer >= 1", "max_output_tokens", "invalid_value"),
        ),
        (
            {"max_output_tokens": 0},
            ("'max_output_tokens' must be an integer >= 1", "max_output_tokens", "invalid_value"),
        ),
        (
            {"instructions": "a \ud800"},
            ("'instructions' is not valid Unicode (a lone surrogate)", "instructions", "invalid_string"),
        ),
        ({"model": None}, ("'model' must be a string", "model", "invalid_type")),
    ],
)
def test_responses_fields_are_refused_in_openais_shape(extra, want):
    parse = ResponsesParser(16, 512, StoredResponses(MemoryRecords(), "m")).parse
    assert _refusal(parse, {**RESP, **extra}) == (400, *want)
    assert parse({**RESP, "max_output_tokens": 3, "temperature": 2}).params.max_tokens == 3


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({"temperature": True}, ("'temperature' must be a number, got bool", "temperature", "invalid_type")),
        ({"temperature": 2.5}, ("'temperature' must be between 0.0 and 2.0, got 2.5", "temperature", None)),
        ({"max_tokens": True}, ("'max_tokens' must be an integer, got bool", "max_tokens", "invalid_type")),
        ({"seed": False}, ("'seed' must be an integer", "seed", "invalid_type")),
        ({"stop": "a \ud800"}, ("'stop' is not valid Unicode (a lone surrogate)", "stop", "invalid_string")),
    ],
)
def test_openai_fields_are_refused_in_openais_words(extra, want):
    parse = RequestParser(["m"], 16, ctx=512).chat
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    status, msg, param, code = _refusal(parse, {**body, **extra})
    assert (status, msg, param) == (400, *want[:2]) and code == (want[2] or "invalid_value")
