"""The structured-output formats of the two OpenAI protocols: chat's
``response_format`` (:func:`response_format`) and Responses' ``text.format``
(:func:`text_format`), each a :class:`ds4.constrain.Constraint` (or none)
enforced whether ``strict`` is true or not. A bad one is a 400 naming the
field; a schema the grammar library rejects is ``invalid_json_schema``.
"""

from __future__ import annotations

from ..constrain import Constraint
from ..errors import ConstraintError
from .fields import format_name
from .wire import JSON, bad, str_field

__all__ = ["response_format", "text_format"]


def response_format(rf: object) -> Constraint | None:
    """``response_format`` as a constraint: ``text`` (none), ``json_object``
    (any JSON object), ``json_schema`` (JSON valid under its ``schema``;
    enforced whether ``strict`` is true or not). A bad one is a 400."""
    p = "response_format"
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad(f"'{p}' must be an object with a string 'type'", p, "invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad(f"'{p}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{p}.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad(f"'{p}.json_schema' must be an object", f"{p}.json_schema", "invalid_type")
    name = js.get("name")
    if not format_name(name):
        raise bad(f"'{p}.json_schema.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{p}.json_schema.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad(f"'{p}.json_schema.strict' must be a boolean", f"{p}.json_schema.strict", "invalid_type")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"'{p}.json_schema.schema' must be an object", f"{p}.json_schema.schema", "invalid_type")
    try:
        return Constraint.json_schema(schema)
    except ConstraintError as e:
        raise bad(f"Invalid schema for response_format '{name}': {e}", p, "invalid_json_schema") from None


def text_format(text: object) -> tuple[Constraint | None, JSON]:
    """``text.format`` as a constraint, and what the response object says of
    it: ``text`` (none; also when ``text`` or its ``format`` is absent),
    ``json_object`` (any JSON object), ``json_schema`` (JSON valid under
    its ``schema``, whether ``strict`` is true or not; the echo has its
    ``name``, ``schema``, ``description`` and ``strict`` as given). A bad
    one is a 400 naming the field; a schema the grammar library rejects is
    ``invalid_json_schema`` (the check chat's ``response_format`` makes)."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text", "invalid_type")
    p = "text.format"
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad(f"'{p}' must be an object with a string 'type'", p, "invalid_type")
    kind = fmt["type"]
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return Constraint.json_object(), {"type": "json_object"}
    if kind != "json_schema":
        raise bad(f"'{p}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{p}.type")
    return _json_schema_format(fmt, p)


def _json_schema_format(fmt: JSON, p: str) -> tuple[Constraint, JSON]:
    """A ``json_schema`` format (``p``: its parameter) as a constraint and its echo."""
    name = fmt.get("name")
    if name is None:
        raise bad(f"Missing required parameter: '{p}.name'.", f"{p}.name", "missing_required_parameter")
    if not format_name(name):
        raise bad(f"'{p}.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{p}.name")
    schema = fmt.get("schema")
    if schema is None:
        raise bad(f"Missing required parameter: '{p}.schema'.", f"{p}.schema", "missing_required_parameter")
    if not isinstance(schema, dict):
        raise bad(f"'{p}.schema' must be an object", f"{p}.schema", "invalid_type")
    strict, description = fmt.get("strict"), fmt.get("description")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"'{p}.strict' must be a boolean", f"{p}.strict", "invalid_type")
    if description is not None:
        str_field(description, f"{p}.description")
    try:
        constraint = Constraint.json_schema(schema)
    except ConstraintError as e:
        raise bad(f"Invalid schema for response_format '{name}': {e}", f"{p}.schema", "invalid_json_schema") from None
    echo = {"type": "json_schema", "name": name, "schema": schema, "description": description, "strict": strict}
    return constraint, echo
