"""The recovery ladder (DESIGN.md "Recovery ladder").

1. The live session: token-prefix match, then rendered byte-prefix match.
2. ``rewrite_from_common``; on REBUILD_NEEDED go on.
3. Disk checkpoints, longest first (corrupt: invalidate and remove, then the
   next; incompatible: skip and keep).
4. Full prefill.

Before the live session is replaced by an unrelated prompt, it is saved
("evict") when a store is given. The report says which rung served, how many
tokens were reused, every rejected candidate and where the time went.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from .errors import InvalidSessionError
from .session import Rewrite, Session

log = logging.getLogger("ds4.recovery")

__all__ = ["RUNGS", "RecoveryReport", "recover"]

RUNGS = ("live", "rewrite", "disk", "prefill")


@dataclasses.dataclass
class RecoveryReport:
    rung: str = "prefill"
    source: str = ""
    reused_tokens: int = 0
    prompt_tokens: int = 0
    loaded_path: str | None = None
    rejected: list = dataclasses.field(default_factory=list)
    timings: dict = dataclasses.field(default_factory=dict)
    evict_saved: str | None = None
    cold_saved: str | None = None
    events: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rejected"] = [{"path": p, "stage": s, "code": c, "reason": r} for (p, s, c, r) in self.rejected]
        return d

    def _event(self, msg: str, *args) -> None:
        text = msg % args if args else msg
        self.events.append(text)
        log.info(text)


def _tokenize_suffix(engine, prompt_b: bytes, n_bytes: int) -> list[int] | None:
    """Tokens of the prompt's byte suffix after ``n_bytes``, or None when the
    cut falls inside a UTF-8 sequence (the suffix is then not tokenizable
    on its own)."""
    try:
        suffix = prompt_b[n_bytes:].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return engine.tokenize(suffix, special=True) if suffix else []


def recover(
    sess: Session,
    store,
    prompt_text: str | bytes,
    *,
    evict_save: bool = True,
    cold_save: bool = False,
    progress: Callable[[int, int], None] | None = None,
    frontier_every: int | None = None,
    on_frontier: Callable[[Session], None] | None = None,
) -> RecoveryReport:
    """Bring ``sess`` to the state of ``prompt_text`` as cheaply as the
    verified material allows. ``store`` may be None (no disk rung). With
    ``cold_save``, a full prefill also stores ds4's trimmed/aligned cold
    prefix on the way."""
    t_start = time.perf_counter()
    rep = RecoveryReport()
    engine = sess.engine
    prompt_b = prompt_text.encode("utf-8") if isinstance(prompt_text, str) else bytes(prompt_text)
    prompt_s = prompt_b.decode("utf-8")
    t0 = time.perf_counter()
    tokens = engine.tokenize(prompt_s, special=True)
    rep.timings["tokenize_ms"] = (time.perf_counter() - t0) * 1000
    rep.prompt_tokens = len(tokens)
    sess.check_prompt(tokens)  # typed error before anything is touched

    def finish(rung: str, source: str, effective: list[int], reused: int) -> RecoveryReport:
        t = time.perf_counter()
        sess.sync(effective, progress=progress, frontier_every=frontier_every, on_frontier=on_frontier)
        rep.timings["prefill_ms"] = (time.perf_counter() - t) * 1000
        rep.rung, rep.source, rep.reused_tokens = rung, source, reused
        rep.prompt_tokens = len(effective)
        rep.timings["total_ms"] = (time.perf_counter() - t_start) * 1000
        rep._event(
            "ds4 ladder rung=%s source=%s reused=%d prompt=%d prefill=%d rejected=%d total=%.1f ms",
            rung,
            source,
            reused,
            len(effective),
            len(effective) - reused,
            len(rep.rejected),
            rep.timings["total_ms"],
        )
        return rep

    # 1. live session
    if sess.checkpoint_valid:
        live = sess.tokens
        if len(tokens) >= len(live) and tokens[: len(live)] == live:
            return finish("live", "memory-token", tokens, len(live))
        live_text = sess.text_bytes()
        if len(live_text) <= len(prompt_b) and prompt_b.startswith(live_text):
            rest = _tokenize_suffix(engine, prompt_b, len(live_text))
            if rest is not None and len(live) + len(rest) < sess.ctx:
                return finish("live", "memory-text", live + rest, len(live))
        # 2. rewrite to the common prefix
        common = sess.common_prefix(tokens)
        if 0 < common < len(live) and store is not None:
            # A rewind keeps only `common` tokens; a longer verified prefix on
            # disk reuses more (ds4 never rewinds, so it never has to choose).
            # The lookup is one pass over the prompt against the index.
            cands = store.lookup(prompt_b, ctx=sess.ctx)
            common_bytes = len(sess.text_bytes(common))
            if cands and cands[0].text_bytes > common_bytes:
                rep._event(
                    "ds4 rewrite skipped: disk holds a longer prefix (%d bytes > %d)", cands[0].text_bytes, common_bytes
                )
                common = -1
        if common > 0:
            if common < len(live) and store is not None and evict_save and sess.n_past >= store.min_tokens:
                # A rewind discards the live tokens past `common`: save them
                # first, as ds4 does before any live state is replaced (ds4
                # cannot rewind, so for it this case is a plain miss).
                try:
                    rep.evict_saved = store.store_live_prefix(sess, "evict")
                except (OSError, InvalidSessionError) as e:
                    rep._event("ds4 evict save failed: %s", e)
            t = time.perf_counter()
            r = sess.rewrite_from_common(tokens)
            rep.timings["rewrite_ms"] = (time.perf_counter() - t) * 1000
            if r is Rewrite.OK:
                rep.rung, rep.source, rep.reused_tokens = "rewrite", "memory-rewind", common
                rep.timings["total_ms"] = (time.perf_counter() - t_start) * 1000
                rep._event("ds4 ladder rung=rewrite reused=%d prompt=%d", common, len(tokens))
                return rep
            rep._event(
                "ds4 live kv cache miss live=%d prompt=%d common=%d reason=%s",
                len(live),
                len(tokens),
                common,
                sess.last_error or r.value,
            )
        elif common == 0:
            rep._event(
                "ds4 live kv cache miss live=%d prompt=%d common=0 reason=token-mismatch", len(live), len(tokens)
            )
        # The live state is about to be replaced: save it first.
        if store is not None and evict_save and rep.evict_saved is None and sess.n_past >= store.min_tokens:
            try:
                rep.evict_saved = store.store_live_prefix(sess, "evict")
            except (OSError, InvalidSessionError) as e:
                rep._event("ds4 evict save failed: %s", e)

    # 3. disk
    if store is not None:
        t = time.perf_counter()
        res = store.try_load_text(sess, prompt_b, report=rep)
        rep.timings["disk_ms"] = (time.perf_counter() - t) * 1000
        if res is not None:
            rest = _tokenize_suffix(engine, prompt_b, res.text_bytes)
            if rest is not None and res.tokens + len(rest) < sess.ctx:
                rep.loaded_path = res.path
                return finish("disk", "disk-text", sess.tokens + rest, res.tokens)
            sess.invalidate("suffix not tokenizable after disk load")

    # 4. full prefill (with ds4's cold save on the way)
    sess.invalidate("full prefill")
    if store is not None and cold_save and len(tokens) <= store.cold_max_tokens:
        cold_len = store.cold_store_len(len(tokens))
        if cold_len is not None:
            sess.sync(tokens[:cold_len], progress=progress, frontier_every=frontier_every, on_frontier=on_frontier)
            try:
                rep.cold_saved = store.store_live_prefix(sess, "cold")
            except OSError as e:
                rep._event("ds4 cold save failed: %s", e)
            rep_prefill = finish("prefill", "full", tokens, 0)
            return rep_prefill
    return finish("prefill", "full", tokens, 0)
