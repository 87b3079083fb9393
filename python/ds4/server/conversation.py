"""The one internal conversation model the agent protocols share (OpenAI
chat completions with tools, Anthropic Messages, OpenAI Responses): messages,
tool calls, tool results, and their rendering to the engine's chat messages
(through the convention of :mod:`ds4.server.tools`).

It also holds what ds4 remembers between the turns of an agent loop
(:class:`LiveTools`: the ids of the calls generated at the live end and the
canonical conversation the live state holds) and the per-request hooks the
worker runs (:class:`AgentTurn`): render the prompt (continuing from the
live tool state when the request's trailing tool results answer exactly the
calls generated at the live end: ds4's ``anthropic-tool-output`` /
``responses-tool-output`` match), then, after decoding and before the final
event, parse the reply and bring the live state to its canonical rendering
(ds4's ``canonicalize_tool_checkpoint``) so that the next request, the
history plus the tool results, is a live hit. A reply's reasoning
(``<think>…</think>``, :mod:`ds4.server.reasoning`) is split off first;
after a turn that produced reasoning the live state is brought to the
rendering every next request starts with (:func:`next_turn_prefix`: the
reasoning kept or dropped as the template renders an earlier turn), so
the next turn is a live hit whether the client sends the reasoning back or
strips it, wherever the template renders both alike (docs/DESIGN.md,
"Canonical reasoning checkpoints").

Nothing here knows HTTP; the protocol modules build a :class:`Conversation`
from their request bodies and format :class:`Outcome` back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..constrain import Constraint
from ..errors import PromptError
from ..keytext import Prompt
from . import tools as conv_tools
from .reasoning import OPEN as THINK_OPEN
from .reasoning import ReasoningSplitter, split_reasoning
from .tool_stream import StreamSplitter
from .volatile import SystemText

if TYPE_CHECKING:
    from ..engine import Engine
    from ..turn import GenParams, GenResult, TurnDriver

log = logging.getLogger("ds4.server")

__all__ = [
    "AgentTurn",
    "Conversation",
    "LiveStateGone",
    "LiveTools",
    "Message",
    "Outcome",
    "Tool",
    "ToolCall",
    "issued_call_id",
    "new_call_id",
    "results_without_calls",
]


class LiveStateGone(PromptError):
    """The request continues from live tool state that is no longer there
    (ds4's 409: replay the full history). Raised by the worker before the
    session is touched: a refusal of the request, like any
    :class:`ds4.errors.PromptError`."""


@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text (as the client sent it, or canonical when generated)


@dataclasses.dataclass
class Message:
    role: str  # "system", "user", "assistant" or "tool"
    content: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    tool_call_id: str | None = None  # role "tool": the call it answers
    #: role "assistant": the turn's reasoning (chat ``reasoning_content``, Anthropic
    #: ``thinking``, Responses ``reasoning``); None when it has none or the client stripped it
    reasoning: str | None = None


@dataclasses.dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.description:
            d["description"] = self.description
        d["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return d


#: the key of the tags of the call ids this process issues (drawn at start)
_ID_KEY = secrets.token_bytes(32)
_TAG_HEX = 12


def _tag(body: str) -> str:
    return hmac.new(_ID_KEY, body.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:_TAG_HEX]


def new_call_id(prefix: str) -> str:
    """A new call id: ``prefix``, 20 random hex digits and a 12-digit tag
    (an HMAC of the rest under this process's key), so that a call id this
    process issued is known again (:func:`issued_call_id`) whatever became
    of the live state, with nothing remembered."""
    body = prefix + secrets.token_hex(10)
    return body + _tag(body)


def issued_call_id(call_id: str) -> bool:
    """Whether this process issued ``call_id`` (a client's own ids, and the
    ids of a process before a restart, are not)."""
    body, tag = call_id[:-_TAG_HEX], call_id[-_TAG_HEX:]
    return bool(body) and hmac.compare_digest(_tag(body).encode(), tag.encode("utf-8", "replace"))


def results_without_calls(messages: Sequence[Message], start: int = 0) -> list[str]:
    """The call ids of the tool results from ``messages[start]`` on that no
    earlier call of ``messages`` made, in order: only the live tool state
    can serve them (ds4's live-only continuation), or nothing when no such
    call was ever issued."""
    seen: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        seen.update(c.id for c in m.tool_calls)
        if i >= start and m.role == "tool" and (m.tool_call_id or "") not in seen:
            out.append(m.tool_call_id or "")
    return out


@dataclasses.dataclass
class Conversation:
    messages: list[Message]
    tools: list[Tool] = dataclasses.field(default_factory=list)
    tool_choice: str = "auto"  # "auto", "none", "required" or a tool's name
    parallel_tool_calls: bool = True
    #: what is taken out of the system text before rendering (ds4.server.volatile)
    volatile: SystemText | None = None
    #: tool results whose calls are not in the history: only the live tool state can serve it
    live_only: bool = False
    #: more variables for the chat template: the thinking switches (ds4.server.thinking)
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced(self) -> str | None:
        """``"required"`` or the forced tool's name; None for auto/none."""
        return None if self.tool_choice in ("auto", "none") else self.tool_choice

    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    # -- rendering to the engine's chat --------------------------------------
    def engine_messages(self) -> list[dict[str, str]]:
        """The engine-level chat (role/content only): the tools block opens
        the first system turn (one is added when there is none), assistant
        calls and tool results in the convention's blocks; the system
        text's volatile lines out, or (tail) in a system turn after the
        last (:class:`ds4.server.volatile.SystemText`)."""
        out, tail = self.stable_messages()
        return [*out, tail] if tail is not None else out

    def stable_messages(self) -> tuple[list[dict[str, str]], dict[str, str] | None]:
        """:meth:`engine_messages` in two parts: the chat without the
        ``tail`` mode's system turn of volatile lines, and that turn (None
        in ``drop`` mode or when no line matched)."""
        out, tail = turns(self.messages), None
        if self.volatile is not None:
            msgs, spans = self.volatile.strip_messages(self.messages)  # transient spans, before the convention
            out, tail = self.volatile.split(turns(msgs), spans)
        if self.tools_active:
            block = conv_tools.tools_block([t.schema() for t in self.tools], self.parallel_tool_calls)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{block}\n\n{out[0]['content']}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out, tail

    def trailing_results(self) -> list[Message]:
        """The run of tool results the conversation ends with."""
        k = len(self.messages)
        while k > 0 and self.messages[k - 1].role == "tool":
            k -= 1
        return self.messages[k:]

    # -- the reply -----------------------------------------------------------
    def parse(self, text: str) -> conv_tools.ParsedReply:
        if not self.tools_active:
            return conv_tools.ParsedReply(text)
        rep = conv_tools.parse_reply(text, self.names())
        if rep.calls and not self.parallel_tool_calls and len(rep.calls) > 1:
            log.warning("parallel_tool_calls=false: %d calls generated, the first kept", len(rep.calls))
            rep = conv_tools.ParsedReply(rep.content, rep.calls[:1])
        return rep

    def splitter(self) -> StreamSplitter | None:
        """The stream's splitter (None without tools): declared names, one
        call at most without ``parallel_tool_calls`` (as :meth:`parse`)."""
        if not self.tools_active:
            return None
        return StreamSplitter(self.names(), None if self.parallel_tool_calls else 1)

    def gen_params(self, params: GenParams) -> GenParams:
        """The turn's decoding parameters: with tools, decoding stops right
        after a call block closes; ``tool_choice`` ``required`` or a named
        tool constrains the reply to a call block whose arguments follow the
        tool's schema (:func:`ds4.server.tools.tool_call_grammar`). Raises
        :class:`ds4.errors.ConstraintError` for schemas that cannot be
        enforced."""
        if self.tools_active:
            params = dataclasses.replace(params, stop_after=(*params.stop_after, conv_tools.CALL_END))
            if self.forced is not None:
                grammar = conv_tools.tool_call_grammar(
                    [t.schema() for t in self.tools], self.forced, self.parallel_tool_calls
                )
                params = dataclasses.replace(params, constraint=Constraint.lark(grammar))
        return params


def turns(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Messages to engine chat turns: a run of tool results is one ``tool``
    turn; an assistant turn's calls follow its content, and its reasoning
    (when it has some) is the turn's ``reasoning_content``, which the chat
    template renders as it renders it (:mod:`ds4.engines.chat_template`)."""
    out: list[dict[str, str]] = []
    run: list[str] = []
    for m in messages:
        if m.role == "tool":
            run.append(m.content)
            continue
        if run:
            out.append({"role": "tool", "content": conv_tools.render_results(run)})
            run = []
        if m.role == "assistant":
            calls = [(c.name, c.arguments) for c in m.tool_calls]
            turn = {"role": "assistant", "content": conv_tools.render_assistant(m.content, calls)}
            if m.reasoning:  # the template renders it (or drops it) as it renders the model's own
                turn["reasoning_content"] = m.reasoning
            out.append(turn)
        else:
            out.append({"role": m.role, "content": m.content})
    if run:
        out.append({"role": "tool", "content": conv_tools.render_results(run)})
    return out


class LiveTools:
    """What the live state holds after a turn that ended in tool calls: the
    calls' ids, the engine chat it is the canonical rendering of, and its
    key text then (the live state still holds that turn while its key text
    is the same). Read and written by the worker thread only."""

    def __init__(self) -> None:
        self.ids: frozenset[str] = frozenset()
        self.messages: list[dict[str, str]] = []
        self.key = b""

    def remember(self, ids: frozenset[str], messages: list[dict[str, str]], key: bytes) -> None:
        self.ids, self.messages, self.key = ids, messages, key

    def clear(self) -> None:
        self.ids, self.messages, self.key = frozenset(), [], b""


@dataclasses.dataclass
class Outcome:
    """A finished turn as the protocols answer it."""

    content: str
    calls: list[ToolCall]
    finish_reason: str  # "stop", "length", "tool_calls" or "cancelled"
    reasoning: str | None = None  # the reply's <think> part (ds4.server.reasoning); None: none


#: ds4's 409 messages, by protocol (AgentTurn's label)
GONE = {
    "anthropic": "Anthropic continuation state is not available; retry by replaying the full messages history",
    "responses": "Responses continuation state is not available; retry by replaying the full input history",
}


class AgentTurn:
    """The worker's hooks for one agent request: :meth:`render` the prompt
    and, once decoded, :meth:`done` (parse, canonicalize, remember)."""

    def __init__(
        self,
        conv: Conversation,
        live: LiveTools,
        gen: TurnDriver,
        *,
        id_prefix: str = "call_",
        label: str = "chat",
        live_only: bool = False,
    ):
        self.conv, self.live, self.gen = conv, live, gen
        self.id_prefix, self.label = id_prefix, label
        # results whose calls the history does not hold: only the live state can serve it
        self.live_only = live_only or conv.live_only
        self.messages: list[dict[str, str]] = []
        #: the prompt opens the reasoning (its generation prompt ends in <think>)
        self.opened = False
        self._rsplit: ReasoningSplitter | None = None  # a stream's (:meth:`stream_reasoning`)
        #: the prompt ends in the tail mode's system turn of volatile lines
        self.tailed = False
        self.outcome: Outcome | None = None
        self.on_outcome: Callable[[Outcome, GenResult], None] | None = None  # (the outcome, the turn's result)
        self._ids: list[str] = []
        self._ids_lock = threading.Lock()

    def call_id(self, k: int) -> str:
        """The id of the turn's call ``k`` (:func:`new_call_id`, drawn on first
        use): a stream announces a call by it while it is generated (in the
        event loop), :meth:`done` gives it to the parsed call ``k`` (in the
        worker thread), so the client holds the id the server recognises."""
        with self._ids_lock:
            while len(self._ids) <= k:
                self._ids.append(new_call_id(self.id_prefix))
            return self._ids[k]

    def render(self, engine: Engine, namespace: str | None = None) -> str:
        """The prompt of a turn in the cache ``namespace`` (the request's:
        only a live state of that namespace can be continued)."""
        msgs = self._live_continuation(namespace)
        stable, tail = self.conv.stable_messages()
        if msgs is None:
            if self.live_only:
                raise LiveStateGone(GONE.get(self.label, GONE["responses"]))
            msgs = stable
        # the turn's canonical checkpoint renders ``self.messages`` and the
        # reply: the tail turn of volatile lines is left out of it, since the
        # next request puts that turn after the reply (a live hit then)
        self.messages, self.tailed = msgs, tail is not None
        if tail is not None:
            msgs = [*msgs, tail]
        prompt = engine.render_chat(msgs, template_kwargs=self.conv.template_kwargs)
        self.opened = prompt.rstrip().endswith(THINK_OPEN)
        return prompt

    def stream_reasoning(self, text: str) -> tuple[str, str]:
        """A streamed piece of the reply through the turn's reasoning
        splitter (made on the first piece, once the prompt is rendered):
        the reasoning and the content that may be sent now."""
        if self._rsplit is None:
            self._rsplit = ReasoningSplitter(self.opened)
        return self._rsplit.push(text)

    def end_stream_reasoning(self) -> tuple[str, str] | None:
        """The reasoning and content the splitter still held at the end of
        the stream; None when no piece went through it."""
        return None if self._rsplit is None else self._rsplit.finish()

    def _live_continuation(self, namespace: str | None) -> list[dict[str, str]] | None:
        """ds4's tool-output match: the request ends in results for exactly
        the calls generated at the live end, and the live state still holds
        that turn, in the request's namespace: continue from it (whatever
        the client made of the earlier history). Another tenant's live
        state is never continued (its text would reach this prompt), even
        by a request that names its call ids."""
        tail = self.conv.trailing_results()
        live = self.live
        ids = frozenset(m.tool_call_id or "" for m in tail)
        if not tail or not live.ids or ids != live.ids:
            return None
        sess = self.gen.sess
        if sess.namespace != namespace:
            log.info("%s live continuation declined: the live state is another namespace's", self.label)
            return None
        if not (sess.checkpoint_valid and sess.key_bytes() == live.key):
            log.info("%s live continuation lost: the live state moved since the calls", self.label)
            return None
        log.info("%s live continuation match=tool-output-ids ids=%d", self.label, len(ids))
        if self.conv.volatile is not None:  # their transient spans go to the tail turn, as in a full rendering
            tail = self.conv.volatile.strip_messages(tail)[0]
        return [*live.messages, *turns(tail)]

    def done(self, res: GenResult) -> None:
        """Split the reply's reasoning off (:mod:`ds4.server.reasoning`),
        parse the rest, give its calls ids; after a turn that ended in
        calls, bring the live state to the turn's canonical rendering
        (before the final event is sent) and remember it. After a turn that
        produced reasoning (closed) and no calls, or a text turn after the
        tail mode's volatile turn, bring the live state to the rendering the
        next request will hold (:meth:`_canonicalize_next_turn`). The
        canonical rendering of a turn never holds the tail turn."""
        sp = split_reasoning(res.text, self.opened)
        text = res.text if sp.reasoning is None else sp.content
        rep = self.conv.parse(text)
        calls = [ToolCall(self.call_id(k), c.name, c.arguments) for k, c in enumerate(rep.calls)]
        finish = "tool_calls" if calls else res.finish_reason
        self.outcome = Outcome(rep.content if calls else text, calls, finish, sp.reasoning)
        self.live.clear()
        if calls and res.finish_reason == "stop":
            self._canonicalize(rep.content, calls, sp.reasoning)
        elif res.finish_reason in ("stop", "length") and (sp.closed if sp.reasoning is not None else self.tailed):
            self._canonicalize_next_turn(text, sp.reasoning)
        if self.on_outcome is not None:
            self.on_outcome(self.outcome, res)

    def _canonicalize_next_turn(self, content: str, reasoning: str | None) -> None:
        """The live state after a reasoning turn, or any text turn whose
        prompt ended in the tail mode's system turn of volatile lines: the
        prompt and the reply as the next request renders them
        (:func:`next_turn_prefix`: with the reasoning where the template
        keeps it in earlier turns, without it where it drops it; without the
        tail turn, which the next request renders after its own last
        message), so that the next request, whether its client sends the
        reasoning back or strips it, is a live hit wherever the template
        renders both alike."""
        gen = self.gen
        turn = {"role": "assistant", "content": content}
        if reasoning is not None:
            turn["reasoning_content"] = reasoning
        try:
            text = next_turn_prefix(gen.engine, [*self.messages, turn], self.conv.template_kwargs)
            if text is None:
                return
            gen.canonicalize(text)
        except Exception as e:  # the reply stands; the next turn recovers as usual
            log.warning("reasoning checkpoint rebuild failed: %s: %s", type(e).__name__, e)

    def _canonicalize(self, content: str, calls: list[ToolCall], reasoning: str | None = None) -> None:
        gen = self.gen
        turn = conv_tools.render_assistant(content, [(c.name, c.arguments) for c in calls])
        msg = {"role": "assistant", "content": turn}
        if reasoning:
            msg["reasoning_content"] = reasoning
        msgs = [*self.messages, msg]
        text = gen.engine.render_chat(msgs, add_generation_prompt=False, template_kwargs=self.conv.template_kwargs)
        try:
            outcome = gen.canonicalize(text)
        except Exception as e:  # the reply stands; the next turn recovers as usual
            log.warning("tool checkpoint rebuild failed: %s: %s", type(e).__name__, e)
            return
        if outcome != "failed":  # the live state holds ``text`` (canonicalize checked it)
            self.live.remember(frozenset(c.id for c in calls), msgs, gen.sess.key_bytes())


#: the two user turns :func:`next_turn_prefix` renders after the turn
_PROBES = ("a", "b")


def next_turn_prefix(
    engine: Engine, messages: list[dict[str, str]], kw: Mapping[str, Any] | None = None
) -> Prompt | None:
    """What every next request after ``messages`` (its last an assistant
    turn) starts with: the rendering of ``messages`` and a user turn, cut
    where two different user turns first part, then back before the next
    turn's opening marker (the last special span), so that it ends where
    the assistant turn does. This is the template's rendering of the turn
    as an *earlier* turn (Qwen3's drops its reasoning then; rendering the
    chat with the assistant turn last would keep it). A template with no
    marker after the reply keeps the next turn's opening text. None when
    nothing is left."""
    a, b = (engine.render_chat([*messages, {"role": "user", "content": p}], False, kw) for p in _PROBES)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    segs: list[tuple[str, bool]] = []
    at = 0
    for text, special in getattr(a, "segments", ((str(a), False),)):
        if at + len(text) > n:
            if not special:
                segs.append((text[: n - at], False))
            break
        segs.append((text, special))
        at += len(text)
    last = max((i for i, (_, sp) in enumerate(segs) if sp), default=-1)
    prompt_len = len(engine.render_chat(messages[:-1], True, kw))  # where the reply starts
    if last > 0 and sum(len(t) for t, _ in segs[:last]) > prompt_len:  # a marker after the reply: its turn's end
        segs = segs[:last]
    return Prompt(segs) if segs else None


def message_text(parts: Sequence[Mapping[str, Any]] | str) -> str:
    """Text parts joined (helper for the protocols' block lists)."""
    if isinstance(parts, str):
        return parts
    return "".join(str(p.get("text", "")) for p in parts)
