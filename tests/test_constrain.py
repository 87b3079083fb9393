"""Constrained decoding (``ds4.constrain``) through the turn driver: what
comes out matches its schema or grammar on both engines, bad constraints are
typed errors raised before anything is touched, and a constraint changes
sampling only (same prompt, same checkpoints, same live reuse)."""

from __future__ import annotations

import json
import os
import random
import re

import jsonschema
import numpy as np
import pytest

import ds4
from ds4.checkpoint import open_checkpoint
from ds4.constrain import Constraint, json_rule
from ds4.errors import ConstraintError, PromptError
from ds4.turn import GenParams, TurnDriver

# -- a seeded generator of JSON schemas --------------------------------------
# Every production is bounded (string lengths, array sizes, number ranges on
# binary-exact steps), so a weak model's output ends within max_tokens: a
# grammar cannot bound the digits of an unconstrained number, nor the length
# of a free string.
KEYS = ["id", "name", "tags", "value", "ok", "kind", "items", "score", "note", "x", "y", "meta", "ünï", "a b"]


def _scalar(r: random.Random) -> dict:
    k = r.randrange(9)
    if k == 0:
        return {"type": "string", "maxLength": r.randint(1, 8), **({"minLength": 1} if r.random() < 0.3 else {})}
    if k == 1:
        lo = r.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 5000)}
    if k == 2:
        lo = r.randint(-100, 100)
        step = r.choice([0.5, 0.25, 0.125, 2])
        return {"type": "number", "multipleOf": step, "minimum": lo, "maximum": lo + r.randint(1, 100)}
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"type": "null"}
    if k == 5:
        return {"enum": r.sample(["red", "green", "blue", 1, 2.5, None, True, 'x"y', "é"], r.randint(1, 4))}
    if k == 6:
        return {"const": r.choice(["fixed", 7, False, None])}
    if k == 7:
        return {"type": "string", "pattern": r.choice(["^[a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$"])}
    return {"type": "string", "enum": ["a", "bb", "ccc"]}


def _schema(r: random.Random, depth: int) -> dict:
    k = r.randrange(10) if depth < 2 else 9
    if k < 4:
        names = r.sample(KEYS, r.randint(0, 3))
        props = {n: _schema(r, depth + 1) for n in names}
        req = [n for n in names if r.random() < 0.7]
        return {"type": "object", "properties": props, "required": req, "additionalProperties": False}
    if k < 6:
        lo = r.randint(0, 2)
        return {"type": "array", "items": _schema(r, depth + 1), "minItems": lo, "maxItems": lo + r.randint(0, 3)}
    if k == 6:
        return {"anyOf": [_schema(r, depth + 1), _schema(r, depth + 1)]}
    return _scalar(r)


def random_schema(seed: int) -> dict:
    """A strict-mode-like schema: an object, every property required, no others."""
    r = random.Random(seed)
    names = r.sample(KEYS, r.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: _schema(r, 1) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def _valid(schema: dict, text: str) -> object:
    obj = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(obj)
    return obj


# -- engines -----------------------------------------------------------------
@pytest.fixture(scope="module")
def small():
    """The reference engine, one small layer (thousands of tokens per test)."""
    return ds4.ReferenceEngine(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, sliding_layers=())


@pytest.fixture(scope="module")
def smol():
    eng = ds4.LlamaCppEngine()
    yield eng
    eng.close()


def _ask(eng, text: str) -> str:
    return eng.render_chat([{"role": "user", "content": text}])


# -- output matches ----------------------------------------------------------
N_SCHEMAS = 220


def test_random_schemas_validate_on_the_reference_engine(small):
    """220 seeded schemas, greedy and sampled: every output completes its
    grammar (finish "stop") and validates with jsonschema."""
    g = TurnDriver(small, 2048)
    failures = []
    for i in range(N_SCHEMAS):
        schema = random_schema(i)
        params = GenParams(
            max_tokens=400, constraint=Constraint.json_schema(schema), temperature=0.0 if i % 2 else 1.0, seed=i
        )
        res = g.generate(_ask(small, f"Answer in JSON ({i})."), params)
        try:
            assert res.finish_reason == "stop", res.finish_reason
            _valid(schema, res.text)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((i, str(e)[:200], json.dumps(schema), res.text[:200]))
    assert not failures, failures[:5]


def test_json_object_is_parseable_json_object(eng, small):
    """Greedy and sampled: a complete answer is a JSON object. (The reference
    engine's random weights close it at once; SmolLM2, below, fills one.)"""
    g = TurnDriver(eng, 2048)
    for i in range(6):
        params = GenParams(max_tokens=300, constraint=Constraint.json_object(), temperature=0.7 * (i % 2), seed=i)
        res = g.generate(_ask(eng, f"Give me an object ({i})."), params)
        assert res.finish_reason == "stop" and isinstance(json.loads(res.text), dict), res.text
    # the small engine loops inside a string (free strings have no bound):
    # cut by max_tokens, the text opens an object and has no end token
    params = GenParams(max_tokens=40, constraint=Constraint.json_object())
    res = TurnDriver(small, 2048).generate(_ask(small, "Object?"), params)
    assert res.finish_reason == "length" and res.text.startswith('{"') and len(res.tokens) == 40


def test_lark_prefix_json_suffix_repeated(small):
    """What the tool-call grammar needs: a literal prefix, JSON under a
    schema, a literal suffix, repeated."""
    args = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    grammar = f"""
start: call{{1,3}}
call: "<tool_call>" {json_rule(args)} "</tool_call>\\n"
"""
    c = Constraint.lark(grammar)
    assert c.kind == "lark"
    g = TurnDriver(small, 2048)
    for i in range(8):
        res = g.generate(
            _ask(small, f"Call the tool ({i})."), GenParams(max_tokens=300, constraint=c, temperature=1.0, seed=i)
        )
        assert res.finish_reason == "stop", res.text
        calls = re.findall(r"<tool_call>(.*?)</tool_call>\n", res.text, re.S)
        assert 1 <= len(calls) <= 3 and "".join(f"<tool_call>{x}</tool_call>\n" for x in calls) == res.text
        for x in calls:
            jsonschema.validate(json.loads(x), args)


def test_the_module_docstring_grammar_compiles():
    assert Constraint.lark('start: call+\ncall: "<tool_call>" %json {"type": "object"} "</tool_call>"').kind == "lark"


def _accepts(c: Constraint, eng, text: str) -> bool:
    guide = c.start(eng)
    return all(guide.matcher.consume_token(b) for b in text.encode()) and guide.accepting


def test_the_json_format_is_ds4s_unless_the_schema_says_otherwise(eng):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
        "required": ["a", "b"],
    }
    one_line, compact, free = '{"a": 1, "b": [2, 3]}', '{"a":1,"b":[2,3]}', '{\n  "a": 1,\n  "b": [2]\n}'
    loose = {**schema, "x-guidance": {"whitespace_flexible": True}}
    cases = [
        (Constraint.json_schema(schema), (True, False, False)),
        (Constraint.json_schema(json.dumps(schema)), (True, False, False)),
        (Constraint.lark(f"start: {json_rule(schema)}"), (True, False, False)),
        (Constraint.json_schema(loose), (True, True, True)),
        (Constraint.lark(f"start: %json {json.dumps(schema)}"), (True, True, True)),  # llguidance's defaults
    ]
    for c, want in cases:
        assert tuple(_accepts(c, eng, t) for t in (one_line, compact, free)) == want, c
    with pytest.raises(ConstraintError):
        Constraint.json_schema({**schema, "x-guidance": 5})


@pytest.mark.parametrize(
    "make",
    [
        lambda: Constraint.json_schema({"type": "foo"}),
        lambda: Constraint.json_schema({"type": "string", "pattern": "(("}),
        lambda: Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
        lambda: Constraint.json_schema({"type": "string", "minLength": 3, "maxLength": 1}),
        lambda: Constraint.json_schema({"type": "integer", "minimum": "zero"}),
        lambda: Constraint.json_schema({"type": "string", "format": "no-such-format"}),
        lambda: Constraint.json_schema("{not json"),
        lambda: Constraint.json_schema([1, 2]),
        lambda: Constraint.json_schema(True),
        lambda: Constraint.lark("start: undefined_rule"),
        lambda: Constraint.lark('start: "a" (('),
        lambda: Constraint.lark(b"start: 'a'"),
    ],
)
def test_bad_schemas_and_grammars_are_typed_errors(make):
    with pytest.raises(ConstraintError) as ei:
        make()
    e = ei.value
    assert e.code == "invalid_constraint" and str(e)
    assert isinstance(e, PromptError) and isinstance(e, ValueError)


def test_a_constraint_the_engine_cannot_use_is_refused_before_anything_is_touched(small, tmp_path):
    """A grammar that only fails against the engine's vocabulary (here: not a
    grammar at all) raises ConstraintError from generate, and the live
    session, its store and the counters of served turns stay as they were."""
    store = ds4.KVStore(tmp_path / "kv", min_tokens=8, boundary_align_tokens=8)
    g = TurnDriver(small, 2048, store=store)
    prompt = _ask(small, "a conversation that is cached")
    g.generate(prompt, GenParams(max_tokens=2))
    before = (list(g.sess.tokens), g.sess.checkpoint_valid, sorted(os.listdir(tmp_path / "kv")))
    with pytest.raises(ConstraintError):
        g.generate(_ask(small, "another one"), GenParams(max_tokens=4, constraint=Constraint("lark", "no grammar")))
    assert (list(g.sess.tokens), g.sess.checkpoint_valid, sorted(os.listdir(tmp_path / "kv"))) == before
    assert before[1] and g.counters["prompt_tokens"] == len(small.tokenize(prompt, special=True))


def test_a_completed_grammar_ends_with_stop_and_its_last_token_unevaluated(small):
    g = TurnDriver(small, 2048)
    prompt = _ask(small, "yes or no?")
    c = Constraint.json_schema(
        {
            "type": "object",
            "properties": {"a": {"enum": ["yes", "no"]}},
            "required": ["a"],
            "additionalProperties": False,
        }
    )
    res = g.generate(prompt, GenParams(max_tokens=50, constraint=c))
    assert res.finish_reason == "stop" and json.loads(res.text)["a"] in ("yes", "no")
    n_prompt = len(small.tokenize(prompt, special=True))
    assert g.sess.tokens == small.tokenize(prompt, special=True) + res.tokens[:-1]
    assert g.sess.n_past == n_prompt + len(res.tokens) - 1 and g.sess.checkpoint_valid
    # cut short: "length", the text a prefix of some valid answer
    res = g.generate(prompt, GenParams(max_tokens=3, constraint=c))
    assert res.finish_reason == "length" and res.text == '{"a'


def test_the_guide_allows_ends_only_when_complete_and_specials_never(eng):
    ends = {eng.eos_token_id}
    guide = Constraint.json_schema({"type": "integer", "minimum": 10, "maximum": 99}).start(eng, ends)
    specials = sorted(eng.special_token_ids)
    allowed = guide.allowed()
    assert allowed.shape == (eng.vocab_size,) and allowed.dtype == bool
    assert set(np.flatnonzero(allowed)) == {ord(d) for d in "123456789"}
    assert not guide.advance(ord("4")) and not guide.accepting
    allowed = guide.allowed()
    assert set(np.flatnonzero(allowed)) == {ord(d) for d in "0123456789"}
    assert guide.advance(ord("2")) and guide.accepting  # "42": complete, nothing may follow
    allowed = guide.allowed()
    assert set(np.flatnonzero(allowed)) == ends and not allowed[[t for t in specials if t not in ends]].any()
    logits = np.arange(eng.vocab_size, dtype=np.float32)
    masked = guide.mask(logits)
    assert int(np.argmax(masked)) == eng.eos_token_id and np.isneginf(masked).sum() == eng.vocab_size - 1
    assert logits[5] == 5.0  # the caller's logits are untouched


def test_a_constraint_changes_sampling_only(eng, tmp_path):
    """Same prompt with and without a constraint: the same prompt tokens,
    the same checkpoint names and payloads, the same live prompt state; and
    after the constrained turn the next one reuses the whole live state."""
    system = "You are a terse assistant. " * 12
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Give me a color as JSON."}]
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    seen = {}
    for name, c in (("plain", None), ("constrained", Constraint.json_schema(schema))):
        store = ds4.KVStore(tmp_path / name, min_tokens=32, boundary_align_tokens=64)
        g = TurnDriver(eng, 4096, store=store)
        r1 = g.generate(eng.render_chat(msgs), GenParams(max_tokens=24, constraint=c))
        names = sorted(n for n in os.listdir(tmp_path / name) if n.endswith(".kv"))
        arrays = {
            n: {k: np.array(v) for k, v in open_checkpoint(str(tmp_path / name / n)).arrays().items()} for n in names
        }
        prompt_state = g.sess.tokens[: r1.prompt_tokens]
        seen[name] = (r1.prompt_tokens, r1.report.rung, r1.report.cold_saved is not None, names, prompt_state)
        seen[name + "/arrays"] = arrays
        if c is None:
            continue
        assert r1.finish_reason == "stop"
        _valid(schema, r1.text)
        n_live = g.sess.n_past
        assert g.sess.checkpoint_valid and n_live == r1.prompt_tokens + len(r1.tokens) - 1
        nxt = [*msgs, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "Another one."}]
        r2 = g.generate(eng.render_chat(nxt), GenParams(max_tokens=4, constraint=c))
        assert r2.report.rung == "live" and r2.cached_tokens == n_live, r2.report
    plain, constrained = seen["plain"], seen["constrained"]
    assert plain == constrained and plain[1] == "prefill" and plain[2] and plain[3]
    for n in plain[3]:
        for k, v in seen["plain/arrays"][n].items():
            assert np.array_equal(v, seen["constrained/arrays"][n][k]), (n, k)


def test_smollm2_control_tokens_are_never_text(smol):
    """Inside a JSON string any text may come, but no control token
    (``<|im_end|>``, ``<|im_start|>``, ...): their bytes are not text to
    the grammar. The end tokens are allowed once the string is closed."""
    ends = TurnDriver(smol, 256).stop_ids
    specials = smol.special_token_ids
    assert {smol.tokenize("<|im_start|>", special=True)[0], smol.tokenize("<|im_end|>", special=True)[0]} <= specials
    assert ends <= specials
    guide = Constraint.json_schema({"type": "string"}).start(smol, ends)
    quote = smol.tokenize('"')
    assert len(quote) == 1 and not guide.advance(quote[0])
    allowed = guide.allowed()
    assert allowed.sum() > 40_000 and not allowed[sorted(specials)].any()
    guide.advance(smol.tokenize("hi")[0])
    assert guide.advance(quote[0]) and set(np.flatnonzero(guide.allowed())) == ends


def test_smollm2_schemas(smol):
    """A few schemas on the real model: valid JSON, each matching."""
    g = TurnDriver(smol, 1024)
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}
            },
            "required": ["colors"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 40}},
            "required": ["ok", "reason"],
            "additionalProperties": False,
        },
    ]
    for s in schemas:
        res = g.generate(
            _ask(smol, "Describe a person or some colors, in JSON."),
            GenParams(max_tokens=60, constraint=Constraint.json_schema(s)),
        )
        assert res.finish_reason == "stop", res.text
        _valid(s, res.text)
    res = g.generate(
        _ask(smol, "A JSON object with the keys name and age for a cat."),
        GenParams(max_tokens=80, constraint=Constraint.json_object()),
    )
    # an object (the constraint's promise) with the keys asked for (the model's; it may add more)
    assert res.finish_reason == "stop" and {"name", "age"} <= set(json.loads(res.text)), res.text
