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
    Tokenizing is a homomorphism (see :mod:`ds4.engines._bytetok`).

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
    reduction in the model is made independent of summation order: exact
    integer-grid matmuls, uint8 attention with exact tile sums, a fixed
    pairwise tree for RMSNorm, RoPE tables per fixed block of positions
    (:mod:`ds4.engines._exact` says how).

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

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..blocks import layer_rows_layout
from ..engine import as_token_array
from ..errors import ContextOverflowError, EngineError, EngineStateError
from ._blas import blas_threads
from ._bytetok import ByteTokenizer
from ._exact import (
    EXACT_F32,
    F32,
    PMAX,
    QKV_SCALE,
    QMAX,
    TILE,
    ExactAttention,
    Layer,
    QLinear,
    RopeTable,
    qkv_int,
    rmsnorm,
    roundup,
    swiglu,
)

__all__ = ["PAYLOAD_LAYOUT", "SPECIAL_TOKENS", "ReferenceContext", "ReferenceEngine"]

#: bump when the meaning of the exported arrays changes
PAYLOAD_LAYOUT = 1
#: the special tokens, in id order after the 256 byte tokens
SPECIAL_TOKENS = ("<|bos|>", "<|im_start|>", "<|im_end|>", "<|eos|>")

#: a layer's K and V: ``[n_kv, cap, head_dim + 1]`` for a full layer,
#: ``[n_kv, window, head_dim]`` rings for a sliding one
KV = tuple[np.ndarray, np.ndarray]


class ReferenceEngine(ByteTokenizer):
    """A deterministic NumPy transformer (see the module docstring)."""

    name = "reference"
    block_layout = layer_rows_layout  # ds4.blocks: every full layer's K and V rows

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
        if head_dim * QMAX * QMAX * 2 + 1e6 >= EXACT_F32:
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

        ByteTokenizer.__init__(self, SPECIAL_TOKENS, bos="<|bos|>", eos="<|im_end|>")
        self.attn = ExactAttention(head_dim, attn_temperature)
        self._build_weights()
        self.rope = RopeTable(head_dim, self.rope_base)
        self._abi: str | None = None

    # -- weights -----------------------------------------------------------
    def _build_weights(self) -> None:
        rng = np.random.default_rng(self.seed)
        d, hd, nh, nkv, ff = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads, self.d_ff
        self.embed = rng.standard_normal((self.vocab_size, d)).astype(F32)
        res_gain = 1.0 / math.sqrt(2 * self.n_layers)
        self.layers: list[Layer] = []
        for i in range(self.n_layers):
            # keyword order = draw order (see Layer)
            L = Layer(
                attn_norm=(1.0 + 0.1 * rng.standard_normal(d)).astype(F32),
                wqkv=QLinear(rng, d, (nh + 2 * nkv) * hd, 1.0),
                wo=QLinear(rng, nh * hd, d, 2.0 * res_gain),
                mlp_norm=(1.0 + 0.1 * rng.standard_normal(d)).astype(F32),
                wgu=QLinear(rng, d, 2 * ff, 1.0),
                wd=QLinear(rng, ff, d, 2.0 * res_gain),
                sliding=i in self.sliding_layers,
            )
            self.layers.append(L)
        self._final_norm = (1.0 + 0.1 * rng.standard_normal(d)).astype(F32)
        self._lm_head = QLinear(rng, d, self.vocab_size, 3.0)

    def _config(self) -> dict[str, Any]:
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
            "attn_c": float(self.attn.c),
            "attn_n0": self.attn.n0,
            "qkv_scale": QKV_SCALE,
            "pmax": PMAX,
            "tile": TILE,
        }

    def _weight_arrays(self) -> Iterator[np.ndarray]:
        yield self.embed
        for L in self.layers:
            yield from L.arrays()
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
        for i, L in enumerate(self.layers):
            rows = min(n, self.window) if L.sliding else n
            out[f"layer{i}.k"] = (rows, self.n_kv_heads, self.head_dim)
            out[f"layer{i}.v"] = (rows, self.n_kv_heads, self.head_dim)
        out["logits"] = (self.vocab_size,)
        return out

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
    def head(self, x_last: np.ndarray) -> np.ndarray:
        h = rmsnorm(x_last, self._final_norm)
        return self._lm_head(h)[0].astype(F32, copy=False)


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
        self._kv: list[KV] = []
        for L in e.layers:
            shape = (e.n_kv_heads, e.window, e.head_dim) if L.sliding else (e.n_kv_heads, 0, e.head_dim + 1)
            self._kv.append((np.zeros(shape, F32), np.zeros(shape, F32)))

    # -- capacity ----------------------------------------------------------
    def _reserve(self, n: int) -> None:
        """Make the full layers' caches hold at least ``n`` positions."""
        if n <= self._cap:
            return
        e = self._engine
        limit = roundup(self.n_ctx, TILE)
        cap = min(limit, max(roundup(n, TILE), 2 * self._cap, TILE))
        for i, L in enumerate(e.layers):
            if L.sliding:
                continue
            K, V = (np.zeros((e.n_kv_heads, cap, e.head_dim + 1), F32) for _ in range(2))
            oldK, oldV = self._kv[i]
            K[:, : self._n] = oldK[:, : self._n]
            V[:, : self._n] = oldV[:, : self._n]
            self._kv[i] = (K, V)
        self._cap = cap

    # -- evaluation --------------------------------------------------------
    def _as_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        return as_token_array(tokens, self._engine.vocab_size, np.int64)

    def eval(self, tokens: Sequence[int], progress: Callable[[int, int], object] | None = None) -> np.ndarray:
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
                with blas_threads(self._engine.blas_threads):
                    self._forward(toks[done : done + step], want_logits=done + step == total)
            except Exception as exc:
                self.reset()
                if isinstance(exc, EngineError):
                    raise
                raise EngineError(f"reference engine failed at position {pos}: {exc!r}") from exc
            done += step
            if progress is not None:
                progress(done, total)
        return self.last_logits()

    def _forward(self, toks: np.ndarray, want_logits: bool) -> None:
        e = self._engine
        P, T = self._n, int(toks.size)
        nh, nkv, hd = e.n_heads, e.n_kv_heads, e.head_dim
        cos, sin = e.rope(P, T)
        if any(not L.sliding for L in e.layers):
            self._reserve(P + T)
        x = e.embed[toks]
        new_rings = []
        for i, L in enumerate(e.layers):
            h = rmsnorm(x, L.attn_norm)
            Q, k_int, vq = qkv_int(L.wqkv(h).reshape(T, nh + 2 * nkv, hd), cos, sin, nh, nkv)
            if L.sliding:
                o, ring = e.attn.attend_ring(self._kv[i], Q, k_int, vq, P)
                new_rings.append((i, ring))
            else:
                K, Vc = self._kv[i]
                K[:, P : P + T, :hd] = k_int.transpose(1, 0, 2)
                K[:, P : P + T, hd] = 1.0
                Vc[:, P : P + T, :hd] = vq.transpose(1, 0, 2)
                Vc[:, P : P + T, hd] = 1.0
                o = e.attn.attend(Q, K, Vc, P + T, 0, P, T, None)
            # o: [nkv, g*T, hd] -> [T, nh*hd]
            o = o.reshape(nkv, nh // nkv, T, hd).transpose(2, 0, 1, 3).reshape(T, nh * hd)
            x = x + L.wo(o)
            x = x + L.wd(swiglu(L.wgu(rmsnorm(x, L.mlp_norm)), e.d_ff))
        # commit the sliding rings last (their old entries were needed above)
        for i, ring in new_rings:
            self._kv[i] = ring
        self._n = P + T
        if want_logits:
            self._logits = e.head(x[T - 1 : T])

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
        for i, L in enumerate(e.layers):
            K, V = self._kv[i]
            if L.sliding:
                slots = np.arange(max(0, n - W), n) % W
                out[f"layer{i}.k"] = np.ascontiguousarray(K[:, slots].transpose(1, 0, 2))
                out[f"layer{i}.v"] = np.ascontiguousarray(V[:, slots].transpose(1, 0, 2))
            else:
                out[f"layer{i}.k"] = np.ascontiguousarray(K[:, :n, :hd].transpose(1, 0, 2))
                out[f"layer{i}.v"] = np.ascontiguousarray(V[:, :n, :hd].transpose(1, 0, 2))
        out["logits"] = self._logits.copy()
        return out

    def import_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> None:
        """Validate everything, then replace the state (the arrays are copied,
        so read-only views of a mapped file are fine)."""
        n = self._check_state(arrays, n_tokens)
        # -- stage the new state (nothing live changes if this fails) ------
        kv, cap = self._stage_kv(arrays, n)
        logits = np.array(arrays["logits"], dtype=F32, copy=True)
        # -- commit --------------------------------------------------------
        self._kv, self._cap, self._n, self._logits = kv, cap, n, logits

    def _check_state(self, arrays: Mapping[str, np.ndarray], n_tokens: int) -> int:
        """The token count of a valid state; EngineStateError otherwise."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, np.integer)):
            raise EngineStateError(f"n_tokens must be an int, got {type(n_tokens).__name__}")
        n = int(n_tokens)
        if not 0 < n <= self.n_ctx:
            raise EngineStateError(f"n_tokens {n} outside 1..{self.n_ctx}")
        if not isinstance(arrays, Mapping):
            raise EngineStateError("state arrays must be a mapping of names to arrays")
        expected = self._engine.state_shapes(n)
        names = set(arrays.keys())
        if names != set(expected):
            missing = sorted(set(expected) - names)
            extra = sorted(str(x) for x in names - set(expected))
            raise EngineStateError(f"state arrays do not match the model: missing {missing}, unexpected {extra}")
        for name, shape in expected.items():
            _check_array(name, arrays[name], shape, n)
        for name in expected:
            _check_values(name, arrays[name])
        return n

    def _stage_kv(self, arrays: Mapping[str, np.ndarray], n: int) -> tuple[list[KV], int]:
        """New K/V buffers holding the (validated) arrays, and their capacity."""
        e = self._engine
        hd, W = e.head_dim, e.window
        cap = min(roundup(self.n_ctx, TILE), roundup(n, TILE))
        kv: list[KV] = []
        for i, L in enumerate(e.layers):
            k, v = arrays[f"layer{i}.k"], arrays[f"layer{i}.v"]
            if L.sliding:
                shape = (e.n_kv_heads, W, hd)
                kr, vr = np.zeros(shape, F32), np.zeros(shape, F32)
                slots = np.arange(max(0, n - W), n) % W
                kr[:, slots] = k.transpose(1, 0, 2)
                vr[:, slots] = v.transpose(1, 0, 2)
                kv.append((kr, vr))
            else:
                K = np.zeros((e.n_kv_heads, cap, hd + 1), F32)
                V = np.zeros((e.n_kv_heads, cap, hd + 1), F32)
                K[:, :n, :hd] = k.transpose(1, 0, 2)
                V[:, :n, :hd] = v.transpose(1, 0, 2)
                K[:, :n, hd] = 1.0
                V[:, :n, hd] = 1.0
                kv.append((K, V))
        return kv, cap


def _check_array(name: str, a: object, shape: tuple[int, ...], n: int) -> None:
    """Type, dtype and shape of one state array."""
    if not isinstance(a, np.ndarray):
        raise EngineStateError(f"{name} is a {type(a).__name__}, not a numpy array")
    if a.dtype != np.dtype(np.float32):
        raise EngineStateError(f"{name} has dtype {a.dtype}, expected float32")
    if a.shape != shape:
        raise EngineStateError(f"{name} has shape {a.shape}, expected {shape} for {n} tokens")


def _check_values(name: str, a: np.ndarray) -> None:
    """Logits finite; K and V on the int8 grid."""
    if name == "logits":
        if not np.all(np.isfinite(a)):
            raise EngineStateError("logits contain NaN or infinity")
    elif a.size and (not np.all(np.abs(a) <= QMAX) or not np.array_equal(np.rint(a), a)):
        raise EngineStateError(f"{name} holds values off the int8 grid")
