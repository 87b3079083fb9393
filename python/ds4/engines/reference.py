"""The reference engine: a small deterministic transformer in pure NumPy.

It exists so that ds4's central promise -- *a resumed session produces exactly
what a cold prefill would have produced* -- can be checked bit for bit, with
no model download and no native code.

Model
    A decoder-only transformer with random weights drawn from
    ``np.random.default_rng(seed)``: token embedding, ``n_layers`` blocks of
    pre-RMSNorm -> RoPE grouped-query attention -> residual -> RMSNorm ->
    SwiGLU MLP -> residual, a final RMSNorm and an LM head. Layers listed in
    ``sliding_layers`` attend only to the last ``window`` positions and keep
    their K/V in a ring buffer of ``window`` slots (``slot = pos % window``);
    the other ("full") layers keep a growing K/V cache. Everything is
    float32.

Tokenizer
    Byte level: tokens ``0..255`` are the bytes of the UTF-8 text, followed
    by the specials ``<|bos|>`` (256), ``<|im_start|>`` (257), ``<|im_end|>``
    (258, the EOS of a chat turn, ``eos_token_id``) and ``<|eos|>`` (259);
    ``vocab_size`` is 260. ``tokenize(text, special=True)`` turns the marker
    strings into their ids, ``special=False`` keeps them as plain bytes.
    Because no token spans more than one byte except the markers, tokenizing
    is a homomorphism: ``tokenize(a + b, s) == tokenize(a, s) +
    tokenize(b, s)`` whenever no marker occurrence straddles the boundary
    between ``a`` and ``b`` (with ``special=False`` it always holds; a Python
    ``str`` cannot be cut inside a UTF-8 sequence). Markers never overlap each
    other, so the split points are unambiguous.

State payload (``export_state``), for a context holding ``n`` tokens
    ``layer{i}.k``, ``layer{i}.v``: ``float32[n, n_kv_heads, head_dim]`` for a
    full layer; ``float32[min(n, window), n_kv_heads, head_dim]`` for a
    sliding layer, the ring in *logical* order (oldest to newest position),
    the way ds4 saves its raw KV ring. K is stored after RoPE.
    ``logits``: ``float32[vocab_size]``, the logits of the last token.
    The token ids are not part of the payload (the Session stores them).
    K and V values lie on the int8 grid (integers in ``[-127, 127]``);
    ``import_state`` checks that too.

Bit-exactness
    ``eval(a + b)`` and ``eval(a); eval(b)`` -- or ``eval(a)``, export, import
    into a fresh context, ``eval(b)`` -- give bit-identical logits and state,
    for any split point. BLAS is *not* row-stable (``X[i] @ W`` can differ
    in the last bit from ``(X @ W)[i]`` when the batch has another number of
    rows: other kernels, other summation orders), and neither are softmax
    sums over a key axis whose length depends on the split. So every
    reduction in the model is made independent of summation order:

    * matmuls are *exact*: like a W8A8 quantized model, weights are integers
      in ``[-127, 127]`` with a float32 scale per output column, activations
      are quantized per row to integers in ``[-127, 127]`` (the scale is the
      row's absolute max, which is order independent), and
      ``K * 127 * 127 < 2**24`` (``2**53`` with float64) guarantees that
      every partial sum, in any order, is an exactly representable integer.
      The integer result is then rescaled element by element.
    * attention: q, k and v are quantized to int8 with fixed scales, so
      ``q.k`` is exact; the row max over visible keys is exact; the
      probabilities are ``rint(exp((q.k - max + N0) * c))``, integers in
      ``[0, 255]`` (uint8 attention, as in integer-only transformers), and
      ``sum(p * v)`` and ``sum(p)`` are computed per tile of 512 keys where
      they are exact in float32 (``512 * 255 * 127 < 2**24``), then summed
      over tiles in float64 (exact too). Key tiling, chunking, GQA grouping
      and BLAS kernels therefore cannot change a single bit.
    * RMSNorm sums squares with a fixed pairwise tree over the model
      dimension; everything else is element-wise (IEEE ``+ - * / sqrt`` are
      correctly rounded; ``exp`` is computed by NumPy's SIMD loop, which
      treats every element alike); RoPE tables are computed once per fixed
      block of positions.

    Prefill still runs in chunks of ``chunk`` tokens aligned to absolute
    positions (boundaries at multiples of ``chunk``), which bounds memory
    and paces ``progress`` callbacks.

Rewinding
    ``truncate(n)`` succeeds only for ``n == n_past`` (nothing to do) and
    ``n == 0`` (a reset): the sliding layers' rings have overwritten the
    entries that a rewind would need, like ds4's compressor frontiers, so any
    other rewind returns False and leaves the state unchanged.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..engine import as_token_array
from ..errors import ContextOverflowError, EngineError, EngineStateError

__all__ = ["PAYLOAD_LAYOUT", "SPECIAL_TOKENS", "ReferenceContext", "ReferenceEngine"]

#: bump when the meaning of the exported arrays changes
PAYLOAD_LAYOUT = 1
#: the special tokens, in id order after the 256 byte tokens
SPECIAL_TOKENS = ("<|bos|>", "<|im_start|>", "<|im_end|>", "<|eos|>")

_F32 = np.float32
_QMAX = 127.0  # int8 grid for weights, activations, q, k, v
_PMAX = 255.0  # attention probabilities are integers in [0, 255]
_TILE = 512  # keys per exact float32 PV partial sum
_EXACT_F32 = 2.0**24
_EXACT_F64 = 2.0**53
_ROPE_BLOCK = 4096
_SCRATCH_ELEMS = 1 << 20  # score elements per attention block (4 MiB of float32)
_WEIGHT_GRID = 40.0  # weights ~ N(0, 1) are stored as rint(40 * w)
_QKV_SCALE = 32.0  # q, k, v ~ N(0, 1) are stored as rint(32 * x)


# -- BLAS threads --------------------------------------------------------------
# The model's matmuls are small: OpenBLAS threads cost more than they give, and
# on a busy machine their spin-waiting makes a prefill 10-20x slower. eval()
# therefore caps the BLAS thread count while it runs (results do not depend on
# it: every matmul is exact). threadpoolctl is used when installed, else the
# OpenBLAS that NumPy loaded is found in /proc/self/maps and called directly.
_blas_lock = threading.Lock()
_blas_state = {"depth": 0, "restore": None, "api": None}
_SET_NAMES = (
    "openblas_set_num_threads",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
)
_GET_NAMES = (
    "openblas_get_num_threads",
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
)


def _find_openblas():
    """(get, set) ctypes functions of the loaded OpenBLAS, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for gname, sname in zip(_GET_NAMES, _SET_NAMES, strict=True):
            get, set_ = getattr(lib, gname, None), getattr(lib, sname, None)
            if get is not None and set_ is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                set_.restype, set_.argtypes = None, [ctypes.c_int]
                return get, set_
    return None


def _blas_api():
    if _blas_state["api"] is None:
        api = False
        try:
            from threadpoolctl import threadpool_limits  # type: ignore

            api = ("threadpoolctl", threadpool_limits)
        except Exception:
            found = _find_openblas()
            if found is not None:
                api = ("openblas", found)
        _blas_state["api"] = api
    return _blas_state["api"]


@contextlib.contextmanager
def _blas_threads(n: int | None) -> Iterator[None]:
    """Cap the BLAS threads at ``n`` for the duration (no-op for None)."""
    if n is None:
        yield
        return
    with _blas_lock:
        if _blas_state["depth"] == 0:
            api = _blas_api()
            restore = None
            try:
                if api and api[0] == "threadpoolctl":
                    restore = api[1](limits=n, user_api="blas")
                elif api:
                    get, set_ = api[1]
                    old = int(get())
                    set_(int(n))
                    restore = lambda: set_(old)  # noqa: E731
            except Exception:  # pragma: no cover - best effort
                restore = None
            _blas_state["restore"] = restore
        _blas_state["depth"] += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_state["depth"] -= 1
            if _blas_state["depth"] == 0:
                restore, _blas_state["restore"] = _blas_state["restore"], None
                try:
                    if hasattr(restore, "restore_original_limits"):
                        restore.restore_original_limits()
                    elif callable(restore):
                        restore()
                except Exception:  # pragma: no cover - best effort
                    pass


def _tree_sum_last(x: np.ndarray) -> np.ndarray:
    """Sum over the last axis with a fixed pairwise tree (order independent of
    the other axes and of the memory layout)."""
    w = x.shape[-1]
    p = 1 << max(0, (w - 1).bit_length())
    if p != w:
        pad = np.zeros((*x.shape[:-1], p - w), dtype=x.dtype)
        x = np.concatenate([x, pad], axis=-1)
    while p > 1:
        p //= 2
        x = x[..., :p] + x[..., p:]
    return x[..., 0]


class _QLinear:
    """An integer-grid weight matrix with a float32 scale per output column."""

    __slots__ = ("dtype", "scale", "w")

    def __init__(self, rng: np.random.Generator, d_in: int, d_out: int, gain: float):
        w = np.clip(np.rint(rng.standard_normal((d_in, d_out)) * _WEIGHT_GRID), -_QMAX, _QMAX)
        col = np.exp(0.1 * rng.standard_normal(d_out))  # a little per-column variety
        self.scale = (col * gain / (_WEIGHT_GRID * math.sqrt(d_in))).astype(_F32)
        # exact integer matmul: every partial sum must be representable
        bound = d_in * _QMAX * _QMAX
        if bound < _EXACT_F32:
            self.dtype = np.float32
        elif bound < _EXACT_F64:  # pragma: no cover - only for big configs
            self.dtype = np.float64
        else:  # pragma: no cover
            raise ValueError(f"layer input width {d_in} too large for exact integer matmuls")
        self.w = w.astype(self.dtype)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x`` (float32 [T, d_in]) times the weights, exactly on the grid."""
        a = np.max(np.abs(x), axis=-1, keepdims=True)
        a = np.maximum(a, _F32(1e-30))
        xi = np.rint(x * (_F32(_QMAX) / a))
        np.clip(xi, -_QMAX, _QMAX, out=xi)
        acc = np.matmul(xi.astype(self.dtype, copy=False), self.w)
        if self.dtype is not np.float32:  # pragma: no cover
            acc = acc.astype(_F32)
        return acc * (a / _F32(_QMAX)) * self.scale


class _Layer:
    __slots__ = ("attn_norm", "mlp_norm", "sliding", "wd", "wgu", "wo", "wqkv")


class ReferenceEngine:
    """A deterministic NumPy transformer (see the module docstring)."""

    name = "reference"

    def __init__(
        self,
        seed: int = 0,
        n_layers: int = 4,
        d_model: int = 64,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        head_dim: int | None = None,
        d_ff: int | None = None,
        window: int = 128,
        sliding_layers: Sequence[int] = (1, 3),
        max_ctx: int = 65536,
        chunk: int = 256,
        rope_base: float = 10000.0,
        attn_temperature: float = 2.0,
        blas_threads: int | None = 1,
    ):
        head_dim = d_model // n_heads if head_dim is None else int(head_dim)
        d_ff = 2 * d_model if d_ff is None else int(d_ff)
        for nm, v in (
            ("n_layers", n_layers),
            ("d_model", d_model),
            ("n_heads", n_heads),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
            ("d_ff", d_ff),
            ("window", window),
            ("max_ctx", max_ctx),
            ("chunk", chunk),
        ):
            if int(v) <= 0:
                raise ValueError(f"{nm} must be positive, got {v}")
        if n_heads % n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")
        sliding = tuple(sorted({int(i) for i in sliding_layers}))
        if any(not 0 <= i < n_layers for i in sliding):
            raise ValueError(f"sliding_layers {sliding} outside 0..{n_layers - 1}")
        if head_dim * _QMAX * _QMAX * 2 + 1e6 >= _EXACT_F32:
            raise ValueError("head_dim too large for exact attention scores")

        self.seed = int(seed)
        self.n_layers = int(n_layers)
        self.d_model = int(d_model)
        self.n_heads = int(n_heads)
        self.n_kv_heads = int(n_kv_heads)
        self.head_dim = head_dim
        self.d_ff = d_ff
        self.window = int(window)
        self.sliding_layers = sliding
        self.max_ctx = int(max_ctx)
        self.chunk = int(chunk)
        self.rope_base = float(rope_base)
        self.blas_threads = None if blas_threads is None else max(1, int(blas_threads))

        # tokenizer
        self.special_tokens = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.bos_token_id = self.special_tokens["<|bos|>"]
        self.eos_token_id = self.special_tokens["<|im_end|>"]
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
        self._token_bytes = [bytes([i]) for i in range(256)] + [s.encode("utf-8") for s in SPECIAL_TOKENS]

        # attention constants: scores are (q.k) * c on the int grid, shifted by
        # N0 so that the largest visible score gives p = exp(N0 * c) ~ 255
        self._attn_c = _F32(attn_temperature / (_QKV_SCALE * _QKV_SCALE * math.sqrt(head_dim)))
        self._attn_n0 = float(round(math.log(_PMAX) / float(self._attn_c)))
        top = float(np.rint(np.exp(_F32(self._attn_n0) * self._attn_c)))
        if top > _PMAX or head_dim * _QMAX * _QMAX + self._attn_n0 + head_dim * _QMAX * _QMAX >= _EXACT_F32:
            raise ValueError("attention constants out of the exact range")  # pragma: no cover

        self._build_weights()
        self._rope_blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._abi: str | None = None

    # -- weights -----------------------------------------------------------
    def _build_weights(self) -> None:
        rng = np.random.default_rng(self.seed)
        d, hd, nh, nkv, ff = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads, self.d_ff
        self._embed = rng.standard_normal((self.vocab_size, d)).astype(_F32)
        res_gain = 1.0 / math.sqrt(2 * self.n_layers)
        self._layers: list[_Layer] = []
        for i in range(self.n_layers):
            L = _Layer()
            L.attn_norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(_F32)
            L.wqkv = _QLinear(rng, d, (nh + 2 * nkv) * hd, 1.0)
            L.wo = _QLinear(rng, nh * hd, d, 2.0 * res_gain)
            L.mlp_norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(_F32)
            L.wgu = _QLinear(rng, d, 2 * ff, 1.0)
            L.wd = _QLinear(rng, ff, d, 2.0 * res_gain)
            L.sliding = i in self.sliding_layers
            self._layers.append(L)
        self._final_norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(_F32)
        self._lm_head = _QLinear(rng, d, self.vocab_size, 3.0)
        half = hd // 2
        self._inv_freq = self.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)

    def _config(self) -> dict:
        return {
            "arch": "ds4-ref-transformer",
            "n_layers": self.n_layers,
            "d_model": self.d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "d_ff": self.d_ff,
            "window": self.window,
            "sliding_layers": list(self.sliding_layers),
            "vocab_size": self.vocab_size,
            "specials": list(SPECIAL_TOKENS),
            "rope_base": self.rope_base,
            "attn_c": float(self._attn_c),
            "attn_n0": self._attn_n0,
            "qkv_scale": _QKV_SCALE,
            "pmax": _PMAX,
            "tile": _TILE,
        }

    def _weight_arrays(self):
        yield self._embed
        for L in self._layers:
            yield L.attn_norm
            for q in (L.wqkv, L.wo):
                yield q.w
                yield q.scale
            yield L.mlp_norm
            for q in (L.wgu, L.wd):
                yield q.w
                yield q.scale
        yield self._final_norm
        yield self._lm_head.w
        yield self._lm_head.scale

    def payload_abi(self) -> str:
        """``ds4-ref/1 model=sha256:<16 hex> layout=<n>``; the digest covers the
        configuration and every weight byte, so another seed or shape gives
        another ABI. (``chunk`` and ``max_ctx`` do not change the payload.)"""
        if self._abi is None:
            h = hashlib.sha256()
            h.update(json.dumps(self._config(), sort_keys=True).encode("utf-8"))
            for a in self._weight_arrays():
                a = np.ascontiguousarray(a)
                h.update(f"{a.dtype.str}{a.shape}".encode())
                h.update(a.tobytes())
            self._abi = f"ds4-ref/1 model=sha256:{h.hexdigest()[:16]} layout={PAYLOAD_LAYOUT}"
        return self._abi

    def state_shapes(self, n_tokens: int) -> dict[str, tuple[int, ...]]:
        """The exact ``{name: shape}`` of a payload holding ``n_tokens`` tokens
        (every array is float32)."""
        n = int(n_tokens)
        out: dict[str, tuple[int, ...]] = {}
        for i, L in enumerate(self._layers):
            rows = min(n, self.window) if L.sliding else n
            out[f"layer{i}.k"] = (rows, self.n_kv_heads, self.head_dim)
            out[f"layer{i}.v"] = (rows, self.n_kv_heads, self.head_dim)
        out["logits"] = (self.vocab_size,)
        return out

    # -- RoPE --------------------------------------------------------------
    def _rope(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (float32 [n, head_dim/2]) for positions pos0..pos0+n-1.
        Computed in fixed blocks of positions, so a position's values never
        depend on the call that first asked for them."""
        b0, b1 = pos0 // _ROPE_BLOCK, (pos0 + n - 1) // _ROPE_BLOCK
        for b in range(b0, b1 + 1):
            if b not in self._rope_blocks:
                pos = np.arange(b * _ROPE_BLOCK, (b + 1) * _ROPE_BLOCK, dtype=np.float64)
                ang = pos[:, None] * self._inv_freq[None, :]
                self._rope_blocks[b] = (np.cos(ang).astype(_F32), np.sin(ang).astype(_F32))
        if b0 == b1:
            c, s = self._rope_blocks[b0]
            o = pos0 - b0 * _ROPE_BLOCK
            return c[o : o + n], s[o : o + n]
        cs = [self._rope_blocks[b] for b in range(b0, b1 + 1)]
        o = pos0 - b0 * _ROPE_BLOCK
        c = np.concatenate([x[0] for x in cs])[o : o + n]
        s = np.concatenate([x[1] for x in cs])[o : o + n]
        return c, s

    # -- text --------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message,
        then ``<|im_start|>assistant\\n`` when ``add_generation_prompt``."""
        out = []
        for m in messages:
            try:
                role, content = m["role"], m["content"]
            except (KeyError, TypeError):
                raise ValueError("each message must be a mapping with 'role' and 'content'") from None
            if not isinstance(role, str) or not isinstance(content, str):
                raise TypeError("message role and content must be str")
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

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

    # -- contexts ----------------------------------------------------------
    def new_context(self, n_ctx: int) -> ReferenceContext:
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, (int, np.integer)):
            raise TypeError("n_ctx must be an int")
        n_ctx = int(n_ctx)
        if n_ctx <= 0:
            raise ValueError("n_ctx must be positive")
        if n_ctx > self.max_ctx:
            raise ValueError(f"n_ctx {n_ctx} exceeds max_ctx {self.max_ctx}")
        return ReferenceContext(self, n_ctx)

    # -- the forward pass (used by the contexts) ---------------------------
    def _rmsnorm(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        ss = _tree_sum_last(x * x)
        r = _F32(1.0) / np.sqrt(ss * _F32(1.0 / self.d_model) + _F32(1e-5))
        return (x * r[:, None]) * g

    def _logits(self, x_last: np.ndarray) -> np.ndarray:
        h = self._rmsnorm(x_last, self._final_norm)
        return self._lm_head(h)[0].astype(_F32, copy=False)


def _roundup(n: int, m: int) -> int:
    return -(-n // m) * m


class ReferenceContext:
    """The K/V state of one token sequence for a :class:`ReferenceEngine`.

    Internal layout: a full layer keeps ``k``/``v`` as float32
    ``[n_kv, cap, head_dim + 1]`` (the extra column is 1 for a stored
    position: it carries the softmax shift through the score matmul and the
    softmax denominator through the PV matmul), ``cap`` a multiple of 512
    that grows geometrically, zero beyond ``n_past``. A sliding layer keeps
    ``[n_kv, window, head_dim]`` rings indexed by ``pos % window``.
    """

    def __init__(self, engine: ReferenceEngine, n_ctx: int):
        self._engine = engine
        self.n_ctx = int(n_ctx)
        self.reset()

    @property
    def n_past(self) -> int:
        return self._n

    @property
    def engine(self) -> ReferenceEngine:
        return self._engine

    def reset(self) -> None:
        e = self._engine
        self._n = 0
        self._logits: np.ndarray | None = None
        self._cap = 0
        self._kv: list[list[np.ndarray] | None] = []
        for L in e._layers:
            if L.sliding:
                shape = (e.n_kv_heads, e.window, e.head_dim)
                self._kv.append([np.zeros(shape, _F32), np.zeros(shape, _F32)])
            else:
                self._kv.append(None)

    # -- capacity ----------------------------------------------------------
    def _reserve(self, n: int) -> None:
        """Make the full layers' caches hold at least ``n`` positions."""
        if n <= self._cap:
            return
        e = self._engine
        limit = _roundup(self.n_ctx, _TILE)
        cap = min(limit, max(_roundup(n, _TILE), 2 * self._cap, _TILE))
        for i, L in enumerate(e._layers):
            if L.sliding:
                continue
            new = [np.zeros((e.n_kv_heads, cap, e.head_dim + 1), _F32) for _ in range(2)]
            old = self._kv[i]
            if old is not None:
                for a, b in zip(new, old, strict=False):
                    a[:, : self._n] = b[:, : self._n]
            self._kv[i] = new
        self._cap = cap

    # -- evaluation --------------------------------------------------------
    def _as_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_token_array(tokens, self._engine.vocab_size, np.int64)

    def eval(self, tokens: Sequence[int], progress=None) -> np.ndarray:
        """Append ``tokens`` (chunks aligned to absolute multiples of
        ``engine.chunk``); return the float32 logits of the last one.

        Bad input (empty, non-integer or out-of-range ids) raises ValueError
        and a prompt that does not fit raises ContextOverflowError, both
        before anything changes. An internal failure resets the context and
        raises EngineError. ``progress(done, total)`` is called after each
        chunk; if it raises, the exception propagates and the context holds
        the chunks evaluated so far (a consistent state)."""
        toks = self._as_tokens(tokens)
        total = int(toks.size)
        if self._n + total > self.n_ctx:
            raise ContextOverflowError(self._n + total, self.n_ctx)
        ch = self._engine.chunk
        done = 0
        while done < total:
            pos = self._n
            step = min(total - done, ch - pos % ch)
            try:
                with _blas_threads(self._engine.blas_threads):
                    self._forward(toks[done : done + step], want_logits=done + step == total)
            except Exception as exc:
                self.reset()
                if isinstance(exc, EngineError):
                    raise
                raise EngineError(f"reference engine failed at position {pos}: {exc!r}") from exc
            done += step
            if progress is not None:
                progress(done, total)
        return self._logits.copy()

    def _forward(self, toks: np.ndarray, want_logits: bool) -> None:
        e = self._engine
        P, T = self._n, int(toks.size)
        nh, nkv, hd = e.n_heads, e.n_kv_heads, e.head_dim
        g = nh // nkv
        cos, sin = e._rope(P, T)
        half = hd // 2
        if any(not L.sliding for L in e._layers):
            self._reserve(P + T)
        x = e._embed[toks]
        new_rings = []
        for i, L in enumerate(e._layers):
            h = e._rmsnorm(x, L.attn_norm)
            qkv = L.wqkv(h).reshape(T, nh + 2 * nkv, hd)
            # RoPE on q and k (rotate-half), then the int8 grid
            qk = qkv[:, : nh + nkv]
            x1, x2 = qk[..., :half], qk[..., half:]
            c, s = cos[:, None, :], sin[:, None, :]
            rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
            rot *= _F32(_QKV_SCALE)
            np.rint(rot, out=rot)
            np.clip(rot, -_QMAX, _QMAX, out=rot)
            vq = np.rint(qkv[:, nh + nkv :] * _F32(_QKV_SCALE))
            np.clip(vq, -_QMAX, _QMAX, out=vq)
            q_int = rot[:, :nh]  # [T, nh, hd]
            k_int = rot[:, nh:]  # [T, nkv, hd]
            # queries grouped by kv head: [nkv, g*T, hd + 1], row = gi*T + t
            Q = np.zeros((nkv, g * T, hd + 1), _F32)
            Q[:, :, :hd] = q_int.reshape(T, nkv, g, hd).transpose(1, 2, 0, 3).reshape(nkv, g * T, hd)
            if L.sliding:
                o, ring = self._attend_sliding(i, Q, k_int, vq, P, T)
                new_rings.append((i, ring))
            else:
                K, Vc = self._kv[i]
                K[:, P : P + T, :hd] = k_int.transpose(1, 0, 2)
                K[:, P : P + T, hd] = 1.0
                Vc[:, P : P + T, :hd] = vq.transpose(1, 0, 2)
                Vc[:, P : P + T, hd] = 1.0
                o = self._attend(Q, K, Vc, P + T, 0, P, T, None)
            # o: [nkv, g*T, hd] -> [T, nh*hd]
            o = o.reshape(nkv, g, T, hd).transpose(2, 0, 1, 3).reshape(T, nh * hd)
            x = x + L.wo(o)
            h = e._rmsnorm(x, L.mlp_norm)
            gu = L.wgu(h)
            gate, up = gu[:, : e.d_ff], gu[:, e.d_ff :]
            # SiLU; the clamp keeps exp finite (silu(x) rounds to -0 there anyway)
            act = gate / (_F32(1.0) + np.exp(np.minimum(-gate, _F32(80.0)))) * up
            x = x + L.wd(act)
        # commit the sliding rings last (their old entries were needed above)
        for i, (kr, vr) in new_rings:
            self._kv[i] = [kr, vr]
        self._n = P + T
        if want_logits:
            self._logits = e._logits(x[T - 1 : T])

    def _attend_sliding(self, i, Q, k_int, vq, P, T):
        """Attention of a sliding layer; returns (output, updated ring)."""
        e = self._engine
        W, nkv, hd = e.window, e.n_kv_heads, e.head_dim
        kr, vr = self._kv[i]
        nr = min(P, W)  # ring entries, positions P-nr .. P-1
        slots = np.arange(P - nr, P) % W
        n = nr + T
        cap = _roundup(n, _TILE)
        K = np.zeros((nkv, cap, hd + 1), _F32)
        V = np.zeros((nkv, cap, hd + 1), _F32)
        K[:, :nr, :hd] = kr[:, slots]
        V[:, :nr, :hd] = vr[:, slots]
        K[:, nr:n, :hd] = k_int.transpose(1, 0, 2)
        V[:, nr:n, :hd] = vq.transpose(1, 0, 2)
        K[:, :n, hd] = 1.0
        V[:, :n, hd] = 1.0
        o = self._attend(Q, K, V, n, P - nr, P, T, W)
        # new ring: the last min(T, W) positions of the chunk overwrite their slots
        kr2, vr2 = kr.copy(), vr.copy()
        m = min(T, W)
        ns = np.arange(P + T - m, P + T) % W
        kr2[:, ns] = K[:, n - m : n, :hd]
        vr2[:, ns] = V[:, n - m : n, :hd]
        return o, (kr2, vr2)

    def _attend(self, Q, K, V, n_keys, kpos0, qpos0, T, window):
        """Exact-integer attention.

        Q: [nkv, g*T, hd+1] (last column free), K/V: [nkv, >= roundup(n_keys,
        512), hd+1] with key j at position kpos0 + j, rows >= n_keys zero.
        Query row r sits at position qpos0 + r % T and sees key positions
        in (qpos - window, qpos]. Returns float32 [nkv, g*T, hd]."""
        e = self._engine
        nkv, gT, hd1 = Q.shape
        hd = hd1 - 1
        g = gT // T
        n_pad = _roundup(n_keys, _TILE)
        bw = max(_TILE, (_SCRATCH_ELEMS // (nkv * gT)) // _TILE * _TILE)
        qpos = qpos0 + np.arange(T)
        qmin, qmax = qpos0, qpos0 + T - 1

        def bias(b0, b1):
            """0 / -inf mask for key columns b0..b1-1, or None if all visible."""
            lo, hi = kpos0 + b0, kpos0 + b1 - 1
            if hi <= qmin and (window is None or lo > qmax - window):
                return None
            kp = kpos0 + np.arange(b0, b1)
            vis = kp[None, :] <= qpos[:, None]
            if window is not None:
                vis &= kp[None, :] > qpos[:, None] - window
            return np.where(vis, _F32(0.0), _F32(-np.inf))

        blocks = [(b0, min(b0 + bw, n_pad)) for b0 in range(0, n_pad, bw)]
        # pass 1: the exact row max of q.k over visible keys
        Q[:, :, hd] = 0.0
        m = None
        for b0, b1 in blocks:
            r1 = min(b1, n_keys)
            S = np.matmul(Q, K[:, b0:r1].transpose(0, 2, 1))
            bm = bias(b0, r1)
            if bm is not None:
                S4 = S.reshape(nkv, g, T, r1 - b0)
                S4 += bm
            bmax = S.max(axis=-1)
            m = bmax if m is None else np.maximum(m, bmax)
        # pass 2: p = rint(exp((q.k - m + N0) * c)) in [0, 255]; exact tile sums
        Q[:, :, hd] = _F32(e._attn_n0) - m
        acc = np.zeros((nkv, gT, hd1), np.float64)
        c = e._attn_c
        for b0, b1 in blocks:
            w = b1 - b0
            S = np.matmul(Q, K[:, b0:b1].transpose(0, 2, 1))
            bm = bias(b0, b1)
            if bm is not None:
                S4 = S.reshape(nkv, g, T, w)
                S4 += bm
            S *= c
            np.exp(S, out=S)
            np.rint(S, out=S)
            nt = w // _TILE
            part = np.matmul(
                S.reshape(nkv, gT, nt, _TILE).transpose(0, 2, 1, 3),
                V[:, b0:b1].reshape(nkv, nt, _TILE, hd1),
            )  # [nkv, nt, gT, hd1], exact in float32
            acc += part.sum(axis=1, dtype=np.float64)
        out = acc[:, :, :hd] / (acc[:, :, hd:] * _QKV_SCALE)
        return out.astype(_F32)

    # -- rewinding ---------------------------------------------------------
    def last_logits(self) -> np.ndarray:
        """Logits after the last evaluated token (a copy); used after truncate()."""
        if self._logits is None:
            raise EngineError("the context is empty")
        return self._logits.copy()

    def truncate(self, n_tokens: int) -> bool:
        """Keep the first ``n_tokens`` tokens. Only ``n == n_past`` (no-op)
        and ``n == 0`` (reset) are possible: a sliding layer's ring has
        overwritten what a rewind would need. Otherwise returns False and
        changes nothing. ``n`` outside ``0..n_past`` raises ValueError."""
        n = int(n_tokens)
        if n < 0 or n > self._n:
            raise ValueError(f"cannot truncate {self._n} tokens to {n}")
        if n == self._n:
            return True
        if n == 0:
            self.reset()
            return True
        return False

    # -- state -------------------------------------------------------------
    def export_state(self) -> dict[str, np.ndarray]:
        """Fresh float32 arrays (see the module docstring for names/shapes)."""
        if self._n == 0 or self._logits is None:
            raise EngineError("nothing to export: the context is empty")
        e = self._engine
        n, hd, W = self._n, e.head_dim, e.window
        out: dict[str, np.ndarray] = {}
        for i, L in enumerate(e._layers):
            if L.sliding:
                slots = np.arange(max(0, n - W), n) % W
                kr, vr = self._kv[i]
                out[f"layer{i}.k"] = np.ascontiguousarray(kr[:, slots].transpose(1, 0, 2))
                out[f"layer{i}.v"] = np.ascontiguousarray(vr[:, slots].transpose(1, 0, 2))
            else:
                K, V = self._kv[i]
                out[f"layer{i}.k"] = np.ascontiguousarray(K[:, :n, :hd].transpose(1, 0, 2))
                out[f"layer{i}.v"] = np.ascontiguousarray(V[:, :n, :hd].transpose(1, 0, 2))
        out["logits"] = self._logits.copy()
        return out

    def import_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> None:
        """Validate everything, then replace the state (the arrays are copied,
        so read-only views of a mapped file are fine)."""
        e = self._engine
        # -- validate -----------------------------------------------------
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
            raise EngineStateError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
        n = int(n_tokens)
        if not 0 < n <= self.n_ctx:
            raise EngineStateError(f"n_tokens {n} outside 1..{self.n_ctx}")
        if not isinstance(arrays, Mapping):
            raise EngineStateError("state arrays must be a mapping of names to arrays")
        expected = e.state_shapes(n)
        names = set(arrays.keys())
        if names != set(expected):
            missing = sorted(set(expected) - names)
            extra = sorted(str(x) for x in names - set(expected))
            raise EngineStateError(f"state arrays do not match the model: missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            a = arrays[name]
            if not isinstance(a, np.ndarray):
                raise EngineStateError(f"{name} is a {type(a).__name__}, not a numpy array")
            if a.dtype != np.dtype(np.float32):
                raise EngineStateError(f"{name} has dtype {a.dtype}, expected float32")
            if a.shape != shape:
                raise EngineStateError(f"{name} has shape {a.shape}, expected {shape} for {n} tokens")
        for name in expected:
            a = arrays[name]
            if name == "logits":
                if not np.all(np.isfinite(a)):
                    raise EngineStateError("logits contain NaN or infinity")
            elif a.size and (not np.all(np.abs(a) <= _QMAX) or not np.array_equal(np.rint(a), a)):
                raise EngineStateError(f"{name} holds values off the int8 grid")
        # -- stage the new state (nothing live changes if this fails) ------
        hd, W = e.head_dim, e.window
        cap = min(_roundup(self.n_ctx, _TILE), _roundup(n, _TILE))
        kv: list = []
        for i, L in enumerate(e._layers):
            k, v = arrays[f"layer{i}.k"], arrays[f"layer{i}.v"]
            if L.sliding:
                shape = (e.n_kv_heads, W, hd)
                kr, vr = np.zeros(shape, _F32), np.zeros(shape, _F32)
                slots = np.arange(max(0, n - W), n) % W
                kr[:, slots] = k.transpose(1, 0, 2)
                vr[:, slots] = v.transpose(1, 0, 2)
                kv.append([kr, vr])
            else:
                K = np.zeros((e.n_kv_heads, cap, hd + 1), _F32)
                V = np.zeros((e.n_kv_heads, cap, hd + 1), _F32)
                K[:, :n, :hd] = k.transpose(1, 0, 2)
                V[:, :n, :hd] = v.transpose(1, 0, 2)
                K[:, :n, hd] = 1.0
                V[:, :n, hd] = 1.0
                kv.append([K, V])
        logits = np.array(arrays["logits"], dtype=_F32, copy=True)
        # -- commit --------------------------------------------------------
        self._kv, self._cap, self._n, self._logits = kv, cap, n, logits
