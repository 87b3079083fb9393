"""A reference engine that follows a script: the agent-protocol tests need a
model that calls tools, and the reference model's random weights never do.

:class:`ScriptedEngine` is the reference transformer (its KV state is
computed, saved, verified and loaded as usual) whose next-token logits are
overridden while it writes an assistant turn: the reply is a deterministic
function of the prompt text (:func:`script`), so a resumed session answers
exactly what a cold prefill answers, and a wrong resume shows. The token
history travels with the state (an extra ``script.tokens`` array), so a
checkpoint loaded from disk goes on with the same script.

The script, for a prompt whose system turn describes tools (the last turn
is the last one that is not a system turn):
    * after a tool turn: ``Result: <the last result's first 24 characters>.``
    * after a user turn: a call of the first tool, ``{"n": <a number taken
      from the prompt>}``; the user text steers it: ``MALFORMED`` (a broken
      call block), ``COMPACT`` (a valid call not in the canonical spacing),
      ``ESCAPED`` (a compact call of ``note`` whose string is ``\\u``-escaped),
      ``TWO`` (two parallel calls), ``TALK`` (plain text, no call),
      ``PREFACE`` (visible text before the call).
Without tools: ``Hello from the script.``; ``LONG <n>`` in the last turn:
``n`` bytes of ``la la la ...`` (a long generation whose text is known);
when the last turn's text has
``THINK``, a reasoning model's reply: ``<think>\nThinking about N.\n</think>\n\n``
then ``The answer is N.`` (N from the prompt).

``ScriptedEngine(template=...)`` renders chats with a GGUF-style Jinja
template (:data:`QWEN3_LIKE`: Qwen3's handling of ``reasoning_content``,
kept in the turns after the last user message and dropped from earlier
ones) instead of the reference engine's ChatML, which keeps reasoning in
every turn; ``scripted_serve.py`` takes it from ``DS4_SCRIPTED_TEMPLATE=qwen3``.
"""

from __future__ import annotations

import json
import re

import numpy as np

from ds4.engines.chat_template import TemplateRenderer, marker_texts
from ds4.engines.reference import ReferenceContext, ReferenceEngine

IM_START, IM_END = 257, 258
ASSISTANT = b"assistant\n"


def _first_tool(prompt: str) -> str:
    m = re.search(r"<tools>\n(.*)\n", prompt)
    return json.loads(m.group(1))["name"] if m else "none"


#: Qwen3's template's reasoning rule (its tool handling left out): an
#: assistant turn after the last user message renders ``<think>`` (its
#: reasoning, or empty when it is the last message), earlier ones drop it
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def script(prompt: str) -> str:
    # the last turn that is not a system turn (ds4 serve's --prompt-volatile-mode tail puts one last)
    turns = prompt.split("<|im_start|>")
    last = next((t for t in reversed(turns) if not t.startswith("system\n")), turns[-1])
    if "<tools>" not in prompt:
        long = re.search(r"LONG (\d+)", last)
        if long:
            n = int(long.group(1))
            return ("la " * (n // 3 + 1))[:n]
        if "THINK" in last:
            n = len(prompt) % 97
            return f"<think>\nThinking about {n}.\n</think>\n\nThe answer is {n}."
        return "Hello from the script."
    if last.startswith("tool\n"):
        res = last.rsplit("<tool_response>\n", 1)[-1].split("\n</tool_response>", 1)[0]
        return f"Result: {res[:24]}."
    name = _first_tool(prompt)
    n = len(prompt) % 97
    if "MALFORMED" in last:
        return '<tool_call>[{"name": "' + name + '", "arguments": {"n": </tool_call>'
    if "COMPACT" in last:
        return f'<tool_call>[{{"name":"{name}","arguments":{{"n":{n}}}}}]</tool_call>'
    if "ESCAPED" in last:
        return f'<tool_call>[{{"name":"note","arguments":{{"text":"caf\\u00e9 \\"{n}\\"","n":{n}}}}}]</tool_call>'
    if "TALK" in last:
        return "No tool needed."
    calls = [{"name": name, "arguments": {"n": n}}]
    if "TWO" in last:
        calls.append({"name": name, "arguments": {"n": n + 1}})
    pre = "Let me look that up.\n" if "PREFACE" in last else ""
    return pre + "<tool_call>" + json.dumps(calls) + "</tool_call>"


class ScriptedContext(ReferenceContext):
    def reset(self) -> None:
        super().reset()
        self.hist: list[int] = []
        self._cache: tuple[int, bytes] | None = None

    def _reply(self) -> tuple[bytes, bytes] | None:
        """(the script's reply, what was generated so far) while an
        assistant turn is being written."""
        h = self.hist
        for i in range(len(h) - 1, -1, -1):
            if h[i] == IM_END:
                return None
            if h[i] == IM_START:
                break
        else:
            return None
        gen = bytes(t for t in h[i + 1 :] if t < 256)
        if not gen.startswith(ASSISTANT) or any(t >= 256 for t in h[i + 1 :]):
            return None
        if self._cache is None or self._cache[0] != i:
            text = self.engine.detokenize(h[:i])
            self._cache = (i, script(text).encode("utf-8"))
        return self._cache[1], gen[len(ASSISTANT) :]

    def _script(self) -> None:
        r = self._reply()
        if r is None or self._logits is None:
            return
        want, got = r
        if not want.startswith(got):
            return
        target = want[len(got)] if len(got) < len(want) else IM_END
        z = np.full(self.engine.vocab_size, -30.0, np.float32)
        z[target] = 30.0
        self._logits = z

    def eval(self, tokens, progress=None):
        super().eval(tokens, progress)
        self.hist.extend(int(t) for t in tokens)
        self._script()
        return self.last_logits()

    def truncate(self, n_tokens: int) -> bool:
        ok = super().truncate(n_tokens)
        if ok:
            del self.hist[int(n_tokens) :]
        return ok

    def export_state(self):
        out = super().export_state()
        out["script.tokens"] = np.asarray(self.hist, dtype=np.int32)
        return out

    def import_state(self, arrays, n_tokens):
        arrays = dict(arrays)
        hist = [int(t) for t in np.asarray(arrays.pop("script.tokens"))]
        super().import_state(arrays, n_tokens)
        self.hist = hist
        self._cache = None


class ScriptedEngine(ReferenceEngine):
    def __init__(self, *args, template: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = template
        self._renderer = None

    def payload_abi(self) -> str:
        return super().payload_abi() + "+scripted"

    def render_chat(self, messages, add_generation_prompt=True, template_kwargs=None):
        if self.chat_template is None:
            return super().render_chat(messages, add_generation_prompt, template_kwargs)
        if self._renderer is None:
            self._renderer = TemplateRenderer(self.chat_template, markers=marker_texts(self))
        return self._renderer.render(messages, add_generation_prompt, template_kwargs)

    def new_context(self, n_ctx: int) -> ScriptedContext:
        return ScriptedContext(self, n_ctx)
