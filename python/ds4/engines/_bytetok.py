"""The reference engine's tokenizer: byte level, plus a few special markers.

Tokens ``0..255`` are the bytes of the UTF-8 text, followed by the special
markers in order. ``tokenize(text, special=True)`` turns the marker strings
into their ids, ``special=False`` keeps them as plain bytes. Chat turns are
rendered as ChatML.

Because no token spans more than one byte except the markers, tokenizing
is a homomorphism: ``tokenize(a + b, s) == tokenize(a, s) +
tokenize(b, s)`` whenever no marker occurrence straddles the boundary
between ``a`` and ``b`` (with ``special=False`` it always holds; a Python
``str`` cannot be cut inside a UTF-8 sequence). Markers never overlap each
other, so the split points are unambiguous.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..keytext import Prompt

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Byte tokens, then ``specials``; ``eos`` (one of them) ends a chat turn."""

    def __init__(self, specials: Sequence[str], bos: str, eos: str):
        self.special_tokens = {s: 256 + i for i, s in enumerate(specials)}
        self.special_token_ids = frozenset(self.special_tokens.values())
        self.vocab_size = 256 + len(specials)
        self.bos_token_id = self.special_tokens[bos]
        self.eos_token_id = self.special_tokens[eos]
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")
        self._token_bytes = [bytes([i]) for i in range(256)] + [s.encode("utf-8") for s in specials]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """ChatML (a fixed format: ``template_kwargs`` ignored): ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
        then ``<|im_start|>assistant\\n`` when ``add_generation_prompt``. The
        markers are special spans, roles and contents text
        (:class:`ds4.keytext.Prompt`). An assistant turn with a non-empty
        ``reasoning_content`` keeps it in every turn, before its content, in
        the form a reasoning model writes it (and :mod:`ds4.server.reasoning`
        splits it): ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``."""
        out: list[tuple[str, bool]] = []
        for m in messages:
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError):
                raise ValueError("each message must be a mapping with 'role' and 'content'") from None
            if not isinstance(role, str) or not isinstance(content, str):
                raise TypeError("message role and content must be str")
            reasoning = m.get("reasoning_content")
            if reasoning and role == "assistant":
                content = f"<think>\n{reasoning}\n</think>\n\n{content}"
            out += [("<|im_start|>", True), (f"{role}\n{content}", False), ("<|im_end|>", True), ("\n", False)]
        if add_generation_prompt:
            out += [("<|im_start|>", True), ("assistant\n", False)]
        return Prompt(out)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """UTF-8 bytes as tokens; with ``special=True`` the marker strings in
        ``text`` become their special ids. Never adds a BOS."""
        if not isinstance(text, str):
            raise TypeError("text must be str")
        if not special:
            return list(text.encode("utf-8"))
        out: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:
                out.append(self.special_tokens[part])
            elif part:
                out.extend(part.encode("utf-8"))
        return out

    def token_bytes(self, token: int) -> bytes:
        t = int(token)
        if not 0 <= t < self.vocab_size:
            raise ValueError(f"token id {t} out of range [0, {self.vocab_size})")
        return self._token_bytes[t]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")
