"""Thinking switches (docs/DESIGN.md, "Thinking switches"): what a request
says about the model's reasoning, as variables of the GGUF's chat template.

* OpenAI chat and Responses: ``chat_template_kwargs`` (an object: vLLM's
  and llama.cpp server's field) are passed to the Jinja template as its
  variables. ``reasoning_effort`` (chat) or ``reasoning.effort``
  (Responses) ``none`` or ``minimal`` sets ``enable_thinking: false``, any
  other effort ``true``; an ``enable_thinking`` given in
  ``chat_template_kwargs`` wins.
* Anthropic: ``thinking: {"type": "disabled"}`` sets ``enable_thinking:
  false``; ``{"type": "enabled", "budget_tokens": N}`` and ``{"type":
  "adaptive"}`` set ``true`` (the budget is checked as Anthropic checks it,
  at least 1,024 and below ``max_tokens``, and not enforced: the template
  has no budget).

The variables change the rendering exactly as the template defines (Qwen3's
puts an empty ``<think></think>`` after the generation prompt when
``enable_thinking`` is false); a template that does not read one renders as
before, and the built-in renderers (the reference engine's ChatML, Gemma
3's) read none. The checkpoint keys are the rendered bytes, so they follow.
A variable named like one of the template's own inputs is refused (400)."""

from __future__ import annotations

from typing import Any

from .wire import JSON, bad

__all__ = ["RESERVED", "anthropic_kwargs", "openai_kwargs"]

#: the template's own inputs (``TemplateRenderer.render_text``): never a request's
RESERVED = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        "functions",
        "function_call",
    }
)
#: the efforts that turn thinking off (OpenAI's names)
OFF = frozenset({"none", "minimal"})
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})


def _kwargs(body: JSON) -> dict[str, Any]:
    raw = body.get("chat_template_kwargs")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad("chat_template_kwargs: must be an object", "chat_template_kwargs")
    for k in raw:
        if k in RESERVED:
            raise bad(f"chat_template_kwargs.{k}: is the template's own input", "chat_template_kwargs")
    return dict(raw)


def _switch(kwargs: dict[str, Any], enabled: bool | None) -> dict[str, Any]:
    if enabled is None or "enable_thinking" in kwargs:
        return kwargs
    return {**kwargs, "enable_thinking": enabled}


def openai_kwargs(body: JSON, effort_field: str = "reasoning_effort") -> dict[str, Any]:
    """The template variables of an OpenAI chat (``reasoning_effort``) or
    Responses (``reasoning.effort``: ``effort_field="reasoning"``) body."""
    kwargs = _kwargs(body)
    if effort_field == "reasoning":
        r = body.get("reasoning")
        if r is not None and not isinstance(r, dict):
            raise bad("reasoning: must be an object", "reasoning")
        effort, where = (r or {}).get("effort"), "reasoning.effort"
    else:
        effort, where = body.get(effort_field), effort_field
    if effort is None:
        return kwargs
    if effort not in EFFORTS:
        raise bad(f"{where}: must be one of {', '.join(sorted(EFFORTS))}", where)
    return _switch(kwargs, effort not in OFF)


def anthropic_kwargs(body: JSON, max_tokens: int | None) -> dict[str, Any]:
    """The template variables of an Anthropic Messages body (``thinking``)."""
    t = body.get("thinking")
    if t is None:
        return {}
    if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking: must be an object whose type is 'enabled', 'disabled' or 'adaptive'")
    if t["type"] == "enabled":
        n = t.get("budget_tokens")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1024:
            raise bad("thinking.budget_tokens: must be an integer >= 1024")
        if max_tokens is not None and n >= max_tokens:
            raise bad("thinking.budget_tokens: must be less than max_tokens")
    return {"enable_thinking": t["type"] != "disabled"}
