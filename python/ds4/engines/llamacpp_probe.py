"""What the llama.cpp engine learns about a model when it loads it.

Two facts that no metadata states, measured on a small context:

* **The state layout** (:class:`~ds4.engines.llamacpp_state.StateLayout`):
  the caches of a state the engine exported itself, their windows and
  every layer's K/V headers. Imported states must match it exactly.
* **The batch sizes the kernels treat alike.** ggml's CPU kernels compute a
  token's activations along paths that depend on the size of the batch it
  is in: a batch of one token takes the matrix-vector path (every model);
  with weights in a repacked type (Q4_K and others, the ``CPU_REPACK``
  buffer) rows go through the kernel four at a time and the rest through a
  row kernel; and on Gemma 3 270M batches of two to seven tokens differ
  from longer ones in the last bits. A resume replays other batches than a
  cold prefill (the suffix after a checkpoint, one token at a time after
  generation), so exactness needs every batch to be one the kernels treat
  like any other. The probe evaluates a 32-token sequence whole and in
  splits with short batches (the last one token at a time, as a reply is
  decoded), under each candidate policy (pad every batch to at least
  ``floor`` tokens, a multiple of ``multiple``), and keeps the cheapest
  under which every split leaves the state and logits of the whole, bit
  for bit (the logits alone let Phi-3 and Mamba-2 run unpadded where a
  reply's state then differed from a prefill's):
  SmolLM2-135M (Q4_1) needs 2x1 (the single-token pad ds4 always had),
  Gemma 3 270M (Q4_K_M) 8x4. A model for which no candidate passes keeps
  the strictest, with ``exact_verified`` False (logged).

Before either, the probe asks the model's **memory** what it can do
(:class:`Memory`): whether it drops a tail of positions (pads, rewinds),
and, for a recurrent or hybrid memory (Mamba-2, LFM2, Granite 4 hybrid),
which cannot, whether the architecture keeps rollback snapshots
(``n_rs_seq``) through which the last few tokens of a batch can still be
dropped. A padded policy is only a candidate where the pads can be dropped;
the unpadded policy (1x1) is always one. So LFM2 pads like any model, and
Mamba-2 runs unpadded batches, exact where the probe sees every split agree
unpadded. Where no policy the memory can run is exact (Mamba-2 and Granite
4 hybrid: no rollback snapshots, and unpadded splits differ), the engine goes
**serial**: llama.cpp evaluates every token on its own (ubatches of one),
a cold prefill too, so every split is one computation; prefill is slower.

Probes are cached per model file (path, size, mtime), batch size and thread
count for the life of the process, and the batch policy (the costly part)
on disk between processes, under a key naming everything it depends on
(:mod:`~ds4.engines.llamacpp_policy_cache`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Protocol

import numpy as np

from ..errors import EngineError, EngineStateError
from . import llamacpp_policy_cache as policy_cache
from .llamacpp_context import LlamaCppContext
from .llamacpp_lib import model_fingerprint
from .llamacpp_owner import Owner
from .llamacpp_state import StateLayout, learn_layout, walk_state

__all__ = ["CANDIDATES", "Memory", "Probe", "pads_needed", "probe_engine"]

log = logging.getLogger("ds4.engines.llamacpp")

#: batch policies (floor, multiple), cheapest first; 1x1 is no pad at all
CANDIDATES: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (8, 4))
#: the probe's splits of its 32 tokens (each a list of batch lengths); the
#: last decodes 12 tokens one by one, as a reply is: a short batch's other
#: bits are rare in a small model's cache (Phi-3's tiny model passes every
#: other split)
SPLITS: tuple[tuple[int, ...], ...] = ((31, 1), (29, 3), (26, 6), (3, 29), (1, 31), (30, 1, 1), (20,) + (1,) * 12)
_N = 32


@dataclasses.dataclass(frozen=True)
class Memory:
    """What the model's memory can do, as the probe found it.

    ``kind``: ``attention`` (one KV cache), ``swa`` (a full and a windowed
    cache), ``recurrent`` (no KV cache: Mamba, RWKV) or ``hybrid`` (a KV
    cache and a recurrent memory: LFM2, Granite 4 hybrid, Jamba).
    ``truncate``: a tail of positions can be dropped at any point (a rewind;
    never for a recurrent part, whose one state summarises every token).
    ``rollback``: how many of the last tokens a recurrent part can drop
    right after the decode that took them (llama.cpp's per-token snapshots,
    ``n_rs_seq``; 0 where the architecture keeps none); pads need that.
    ``copy``: a prefix of one sequence can be copied into another (a pool's
    shared prefix; a recurrent state has no prefix to copy)."""

    kind: str
    truncate: bool
    rollback: int
    copy: bool

    def can_pad(self, floor: int, multiple: int) -> bool:
        """Whether a batch policy's pads can be dropped after each decode."""
        return self.truncate or pads_needed(floor, multiple) <= self.rollback

    def describe(self) -> str:
        """The memory's facts for the engine facts and the payload ABI."""
        return f"{self.kind} truncate={'yes' if self.truncate else 'no'} rollback={self.rollback}"


def pads_needed(floor: int, multiple: int) -> int:
    """The most pad tokens a batch policy adds to one decode."""
    return max(floor - 1, multiple - 1, 0)


@dataclasses.dataclass(frozen=True)
class Probe:
    layout: StateLayout | None
    bytes_per_token: int
    batch_floor: int
    batch_multiple: int
    exact_verified: bool
    memory: Memory
    #: a state exported, imported into a cleared context and continued gives
    #: the continuation of the state it was exported from, bit for bit
    roundtrip: bool = False
    #: exact only with every token evaluated alone (ubatches of one)
    serial: bool = False
    #: what the policy depends on (the disk cache's key; other start-up
    #: checks of this engine key their results by it too)
    key: dict[str, Any] | None = dataclasses.field(default=None, compare=False)


_cache: dict[tuple[object, ...], Probe] = {}


class Probed(Owner, Protocol):
    """The engine being probed (:class:`~ds4.engines.llamacpp.LlamaCppEngine`,
    as it starts): a context's owner, with its model file and tokenizer."""

    model_path: str
    hybrid: bool

    def tokenize(self, text: str, special: bool = False) -> list[int]: ...


def probe_engine(eng: Probed) -> Probe:
    """The probe of ``eng``'s model (cached; see the module docstring)."""
    st = os.stat(eng.model_path)
    key = (os.path.realpath(eng.model_path), st.st_size, st.st_mtime_ns, eng.n_batch, eng.n_threads, eng.exact)
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = _probe(eng)
    return hit


def _memory(ctx: LlamaCppContext, eng: Probed) -> Memory:
    """The memory's facts (see :class:`Memory`), read from the model and the
    probe's context (how many rollback snapshots llama.cpp granted it)."""
    if eng.recurrent:
        rollback = int(eng.lc.llama_n_rs_seq(ctx.raw))
        return Memory("hybrid" if eng.hybrid else "recurrent", False, rollback, False)
    return Memory("swa" if eng.n_swa else "attention", True, 0, True)


def _probe(eng: Probed) -> Probe:
    ctx = LlamaCppContext(eng, 256)
    try:
        mem = _memory(ctx, eng)
        layout, per_token = _layout(ctx, eng)
        toks = _tokens(eng)
        possible = [c for c in CANDIDATES if mem.can_pad(*c)] if eng.exact else [(1, 1)]
        key = _policy_key(eng, mem)
        kept = policy_cache.load(key, possible)
        if kept is not None:  # measured at an earlier start, under the same key
            floor, mult, verified, serial = kept
            if serial:
                ctx.close()
                eng.serial = True
                ctx = LlamaCppContext(eng, 256)
        else:
            ctx, (floor, mult, verified, serial) = _search(ctx, eng, mem, toks, possible)
            policy_cache.store(key, (floor, mult, verified, serial))
        ctx.batch_floor, ctx.batch_multiple = floor, mult
        trip = layout is not None and _roundtrip(ctx, toks)
        if layout is not None and not trip:
            log.warning(
                "llama.cpp engine: %s's state does not survive an export and import here; "
                "its checkpoints are not saved",
                os.path.basename(eng.model_path),
            )
        return Probe(layout, per_token, floor, mult, verified, mem, trip, serial, key)
    finally:
        ctx.close()


def _search(
    ctx: LlamaCppContext, eng: Probed, mem: Memory, toks: list[int], possible: list[tuple[int, int]]
) -> tuple[LlamaCppContext, policy_cache.Policy]:
    """The cheapest policy of ``possible`` under which every split of
    ``toks`` gives the whole's state and logits, else serial where that is
    exact, else the strictest (unverified); and the context to go on with
    (a serial engine's own)."""
    floor, mult = possible[-1]
    verified = serial = False
    for f, m in possible:
        if _alike(ctx, toks, f, m):
            floor, mult, verified = f, m, True
            break
    else:
        # no batch size the memory can take is exact: every token alone
        # (llama.cpp's ubatches of one) takes one path, in a cold prefill
        # too, so every split is the same computation (slower prefill)
        if eng.exact:
            ctx.close()
            eng.serial = True
            ctx = LlamaCppContext(eng, 256)
            floor, mult = 1, 1
            verified = serial = _alike(ctx, toks, 1, 1)
        eng.serial = serial
        if eng.exact and not serial:
            log.warning(
                "llama.cpp engine: no batch policy its %s memory can run made %s's results independent of "
                "the batch split; resumed sessions may differ from a cold prefill in the last bits",
                mem.kind,
                os.path.basename(eng.model_path),
            )
    return ctx, (floor, mult, verified, serial)


def _policy_key(eng: Probed, mem: Memory) -> dict[str, Any]:
    """What the batch policy depends on (:mod:`~ds4.engines.llamacpp_policy_cache`)."""
    lc = eng.lc
    lib = getattr(getattr(getattr(lc, "llama_cpp", None), "_lib", None), "_name", None)
    libs: list[list[object]] = []
    if isinstance(lib, str) and os.path.isfile(lib):
        d = os.path.dirname(lib)
        for name in sorted(os.listdir(d)):
            st = os.stat(os.path.join(d, name))
            libs.append([name, st.st_size, st.st_mtime_ns])
    return {
        "probe": policy_cache.PROBE_VERSION,
        "model": model_fingerprint(eng.model_path),
        "llama_cpp": str(getattr(lc, "__version__", "")),
        "libs": [os.path.realpath(lib) if isinstance(lib, str) else None, libs],
        "system": bytes(lc.llama_print_system_info() or b"").decode("utf-8", "replace"),
        "n_batch": eng.n_batch,
        "n_threads": eng.n_threads,
        "type_k": eng.type_k,
        "type_v": eng.type_v,
        "exact": eng.exact,
        "memory": [mem.kind, mem.truncate, mem.rollback, mem.copy],
        "candidates": [list(c) for c in CANDIDATES],
    }


def _roundtrip(ctx: LlamaCppContext, toks: list[int]) -> bool:
    """Whether a state of 20 tokens, exported, imported into the cleared
    context and continued by the rest, gives the logits of the context that
    prefilled them all (under the policy just chosen)."""
    cut = 20
    try:
        ctx.reset()
        ctx.eval(toks[:cut])
        state = ctx.export_state()
        ctx.eval(toks[cut:])
        ref = ctx.last_logits()
        ctx.reset()
        ctx.import_state(state, cut)
        return bool(np.array_equal(ctx.eval(toks[cut:]), ref))
    except (EngineError, EngineStateError) as e:
        log.warning("llama.cpp engine: the state round trip failed: %s", e)
        return False


def _layout(ctx: LlamaCppContext, eng: Probed) -> tuple[StateLayout | None, int]:
    """The layout of the engine's own 1- and 3-token states, and the bytes a
    token adds to the blob (below the window)."""
    try:
        sizes, layout = [], None
        kv = (1 if eng.hybrid else 0) if eng.recurrent else None
        for n in (1, 3):
            ctx.reset()
            ctx.eval(list(range(n)))
            blob = ctx.export_state()["llama_state"]
            layout = learn_layout(blob, n, eng.n_swa, recurrent=eng.recurrent, kv_caches=kv)
            walk_state(blob, n, layout)  # its own checks agree
            sizes.append(int(blob.size))
        return layout, (sizes[1] - sizes[0]) // 2
    except (EngineError, EngineStateError):
        return None, 0


def _tokens(eng: Probed) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. "
    toks = eng.tokenize(text * 4)[:_N]
    if len(toks) < _N:  # pragma: no cover - every tokenizer splits this text finer
        toks += [toks[-1]] * (_N - len(toks))
    return toks


def _alike(ctx: LlamaCppContext, toks: list[int], floor: int, mult: int) -> bool:
    """Whether, padded to ``floor`` x ``mult``, every split of ``toks``
    gives the state and logits of the whole, bit for bit (the state too: a
    short batch's other bits can round away in the logits and stay in the
    cache, where a later token reads them)."""
    ctx.batch_floor, ctx.batch_multiple = floor, mult

    def run(pieces: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        ctx.reset()
        at = 0
        for p in pieces:
            ctx.eval(toks[at : at + p])
            at += p
        st = ctx.export_state()
        return st["llama_state"], st["logits"]

    def same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
        return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])

    try:
        ref = run((_N,))
        return all(same(run(s), ref) for s in SPLITS)
    except EngineError as e:  # the memory refused the pads after all
        log.info("llama.cpp engine: batch policy %dx%d cannot run here: %s", floor, mult, e)
        return False
