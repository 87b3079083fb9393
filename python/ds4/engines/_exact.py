"""The exact-integer numerics of the reference engine.

Every reduction here is independent of summation order, so that chunking,
key tiling, GQA grouping and BLAS kernels cannot change a single bit (the
promise is in "Bit-exactness" in :mod:`ds4.engines.reference`):

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

Everything is float32 unless said otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

F32 = np.float32
QMAX = 127.0  # int8 grid for weights, activations, q, k, v
PMAX = 255.0  # attention probabilities are integers in [0, 255]
TILE = 512  # keys per exact float32 PV partial sum
EXACT_F32 = 2.0**24
EXACT_F64 = 2.0**53
ROPE_BLOCK = 4096
SCRATCH_ELEMS = 1 << 20  # score elements per attention block (4 MiB of float32)
WEIGHT_GRID = 40.0  # weights ~ N(0, 1) are stored as rint(40 * w)
QKV_SCALE = 32.0  # q, k, v ~ N(0, 1) are stored as rint(32 * x)


def roundup(n: int, m: int) -> int:
    return -(-n // m) * m


def tree_sum_last(x: np.ndarray) -> np.ndarray:
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


def rmsnorm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """RMSNorm of the rows of ``x`` (float32 [T, d]) with gain ``g``."""
    ss = tree_sum_last(x * x)
    r = F32(1.0) / np.sqrt(ss * F32(1.0 / x.shape[-1]) + F32(1e-5))
    return (x * r[:, None]) * g


class QLinear:
    """An integer-grid weight matrix with a float32 scale per output column."""

    __slots__ = ("dtype", "scale", "w")
    dtype: type[np.float32] | type[np.float64]

    def __init__(self, rng: np.random.Generator, d_in: int, d_out: int, gain: float):
        w = np.clip(np.rint(rng.standard_normal((d_in, d_out)) * WEIGHT_GRID), -QMAX, QMAX)
        col = np.exp(0.1 * rng.standard_normal(d_out))  # a little per-column variety
        self.scale = (col * gain / (WEIGHT_GRID * math.sqrt(d_in))).astype(F32)
        # exact integer matmul: every partial sum must be representable
        bound = d_in * QMAX * QMAX
        if bound < EXACT_F32:
            self.dtype = np.float32
        elif bound < EXACT_F64:  # pragma: no cover - only for big configs
            self.dtype = np.float64
        else:  # pragma: no cover
            raise ValueError(f"layer input width {d_in} too large for exact integer matmuls")
        self.w = w.astype(self.dtype)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """``x`` (float32 [T, d_in]) times the weights, exactly on the grid."""
        a = np.max(np.abs(x), axis=-1, keepdims=True)
        a = np.maximum(a, F32(1e-30))
        xi = np.rint(x * (F32(QMAX) / a))
        np.clip(xi, -QMAX, QMAX, out=xi)
        acc = np.matmul(xi.astype(self.dtype, copy=False), self.w)
        if self.dtype is not np.float32:  # pragma: no cover
            acc = acc.astype(F32)
        return acc * (a / F32(QMAX)) * self.scale


@dataclass(slots=True)
class Layer:
    """One transformer block's weights (the field order is the order in
    which they are drawn from the seed's generator)."""

    attn_norm: np.ndarray
    wqkv: QLinear
    wo: QLinear
    mlp_norm: np.ndarray
    wgu: QLinear
    wd: QLinear
    sliding: bool

    def arrays(self) -> Iterator[np.ndarray]:
        """Every weight array, in a fixed order (for the payload ABI digest)."""
        yield self.attn_norm
        for q in (self.wqkv, self.wo):
            yield q.w
            yield q.scale
        yield self.mlp_norm
        for q in (self.wgu, self.wd):
            yield q.w
            yield q.scale


class RopeTable:
    """cos/sin tables of rotary embeddings, computed in fixed blocks of
    ``ROPE_BLOCK`` positions, so a position's values never depend on the call
    that first asked for them."""

    def __init__(self, head_dim: int, base: float):
        half = head_dim // 2
        self._inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (float32 [n, head_dim/2]) for positions pos0..pos0+n-1."""
        b0, b1 = pos0 // ROPE_BLOCK, (pos0 + n - 1) // ROPE_BLOCK
        for b in range(b0, b1 + 1):
            if b not in self._blocks:
                pos = np.arange(b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK, dtype=np.float64)
                ang = pos[:, None] * self._inv_freq[None, :]
                self._blocks[b] = (np.cos(ang).astype(F32), np.sin(ang).astype(F32))
        if b0 == b1:
            c, s = self._blocks[b0]
            o = pos0 - b0 * ROPE_BLOCK
            return c[o : o + n], s[o : o + n]
        cs = [self._blocks[b] for b in range(b0, b1 + 1)]
        o = pos0 - b0 * ROPE_BLOCK
        c = np.concatenate([x[0] for x in cs])[o : o + n]
        s = np.concatenate([x[1] for x in cs])[o : o + n]
        return c, s


def qkv_int(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, nh: int, nkv: int) -> tuple[np.ndarray, ...]:
    """From the projected ``qkv`` (float32 [T, nh + 2 * nkv, hd]): RoPE on q
    and k (rotate-half), then the int8 grid. Returns ``Q`` grouped by kv head
    (``[nkv, g*T, hd + 1]``, row ``gi*T + t``, last column free),
    ``k_int`` ``[T, nkv, hd]`` and ``v`` ``[T, nkv, hd]``."""
    T, _, hd = qkv.shape
    half, g = hd // 2, nh // nkv
    qk = qkv[:, : nh + nkv]
    x1, x2 = qk[..., :half], qk[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    rot *= F32(QKV_SCALE)
    np.rint(rot, out=rot)
    np.clip(rot, -QMAX, QMAX, out=rot)
    vq = np.rint(qkv[:, nh + nkv :] * F32(QKV_SCALE))
    np.clip(vq, -QMAX, QMAX, out=vq)
    q_int = rot[:, :nh]  # [T, nh, hd]
    k_int = rot[:, nh:]  # [T, nkv, hd]
    Q = np.zeros((nkv, g * T, hd + 1), F32)
    Q[:, :, :hd] = q_int.reshape(T, nkv, g, hd).transpose(1, 2, 0, 3).reshape(nkv, g * T, hd)
    return Q, k_int, vq


def swiglu(gu: np.ndarray, d_ff: int) -> np.ndarray:
    """SiLU(gate) * up; the clamp keeps exp finite (silu(x) rounds to -0 there anyway)."""
    gate, up = gu[:, :d_ff], gu[:, d_ff:]
    return gate / (F32(1.0) + np.exp(np.minimum(-gate, F32(80.0)))) * up


class ExactAttention:
    """Exact-integer attention: scores are ``(q.k) * c`` on the int grid,
    shifted by ``n0`` so that the largest visible score gives
    ``p = exp(n0 * c) ~ 255``."""

    def __init__(self, head_dim: int, temperature: float):
        self.c = F32(temperature / (QKV_SCALE * QKV_SCALE * math.sqrt(head_dim)))
        self.n0 = float(round(math.log(PMAX) / float(self.c)))
        top = float(np.rint(np.exp(F32(self.n0) * self.c)))
        if top > PMAX or head_dim * QMAX * QMAX + self.n0 + head_dim * QMAX * QMAX >= EXACT_F32:
            raise ValueError("attention constants out of the exact range")  # pragma: no cover

    def attend_ring(
        self, ring: tuple[np.ndarray, np.ndarray], Q: np.ndarray, k_int: np.ndarray, vq: np.ndarray, P: int
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Attention of a sliding layer whose ring (``[nkv, W, hd]`` K and V,
        slot ``pos % W``) holds positions before ``P``; ``k_int``/``vq``
        (``[T, nkv, hd]``) are positions ``P..P+T-1``. Returns the output and
        the updated ring (a new one: the old is left as it was)."""
        kr, vr = ring
        nkv, W, hd = kr.shape
        T = k_int.shape[0]
        nr = min(P, W)  # ring entries, positions P-nr .. P-1
        slots = np.arange(P - nr, P) % W
        n = nr + T
        cap = roundup(n, TILE)
        K = np.zeros((nkv, cap, hd + 1), F32)
        V = np.zeros((nkv, cap, hd + 1), F32)
        K[:, :nr, :hd] = kr[:, slots]
        V[:, :nr, :hd] = vr[:, slots]
        K[:, nr:n, :hd] = k_int.transpose(1, 0, 2)
        V[:, nr:n, :hd] = vq.transpose(1, 0, 2)
        K[:, :n, hd] = 1.0
        V[:, :n, hd] = 1.0
        o = self.attend(Q, K, V, n, P - nr, P, T, W)
        # new ring: the last min(T, W) positions of the chunk overwrite their slots
        kr2, vr2 = kr.copy(), vr.copy()
        m = min(T, W)
        ns = np.arange(P + T - m, P + T) % W
        kr2[:, ns] = K[:, n - m : n, :hd]
        vr2[:, ns] = V[:, n - m : n, :hd]
        return o, (kr2, vr2)

    def attend(
        self,
        Q: np.ndarray,
        K: np.ndarray,
        V: np.ndarray,
        n_keys: int,
        kpos0: int,
        qpos0: int,
        T: int,
        window: int | None,
    ) -> np.ndarray:
        """Exact-integer attention.

        Q: [nkv, g*T, hd+1] (last column free), K/V: [nkv, >= roundup(n_keys,
        512), hd+1] with key j at position kpos0 + j, rows >= n_keys zero.
        Query row r sits at position qpos0 + r % T and sees key positions
        in (qpos - window, qpos]. Returns float32 [nkv, g*T, hd]."""
        nkv, gT, hd1 = Q.shape
        hd = hd1 - 1
        g = gT // T
        n_pad = roundup(n_keys, TILE)
        bw = max(TILE, (SCRATCH_ELEMS // (nkv * gT)) // TILE * TILE)
        bias = _visibility(kpos0, qpos0, T, window)

        blocks = [(b0, min(b0 + bw, n_pad)) for b0 in range(0, n_pad, bw)]
        # pass 1: the exact row max of q.k over visible keys
        Q[:, :, hd] = 0.0
        m = np.full((nkv, gT), -np.inf, F32)
        for b0, b1 in blocks:
            r1 = min(b1, n_keys)
            S = np.matmul(Q, K[:, b0:r1].transpose(0, 2, 1))
            bm = bias(b0, r1)
            if bm is not None:
                S4 = S.reshape(nkv, g, T, r1 - b0)
                S4 += bm
            np.maximum(m, S.max(axis=-1), out=m)
        # pass 2: p = rint(exp((q.k - m + N0) * c)) in [0, 255]; exact tile sums
        Q[:, :, hd] = F32(self.n0) - m
        acc = np.zeros((nkv, gT, hd1), np.float64)
        for b0, b1 in blocks:
            w = b1 - b0
            S = np.matmul(Q, K[:, b0:b1].transpose(0, 2, 1))
            bm = bias(b0, b1)
            if bm is not None:
                S4 = S.reshape(nkv, g, T, w)
                S4 += bm
            S *= self.c
            np.exp(S, out=S)
            np.rint(S, out=S)
            nt = w // TILE
            part = np.matmul(
                S.reshape(nkv, gT, nt, TILE).transpose(0, 2, 1, 3),
                V[:, b0:b1].reshape(nkv, nt, TILE, hd1),
            )  # [nkv, nt, gT, hd1], exact in float32
            acc += part.sum(axis=1, dtype=np.float64)
        out = acc[:, :, :hd] / (acc[:, :, hd:] * QKV_SCALE)
        return out.astype(F32)


def _visibility(kpos0: int, qpos0: int, T: int, window: int | None) -> Callable[[int, int], np.ndarray | None]:
    """``bias(b0, b1)``: the 0 / -inf mask of key columns b0..b1-1 for the
    queries at positions qpos0..qpos0+T-1, or None if all are visible."""
    qpos = qpos0 + np.arange(T)
    qmin, qmax = qpos0, qpos0 + T - 1

    def bias(b0: int, b1: int) -> np.ndarray | None:
        lo, hi = kpos0 + b0, kpos0 + b1 - 1
        if hi <= qmin and (window is None or lo > qmax - window):
            return None
        kp = kpos0 + np.arange(b0, b1)
        vis = kp[None, :] <= qpos[:, None]
        if window is not None:
            vis &= kp[None, :] > qpos[:, None] - window
        return np.where(vis, F32(0.0), F32(-np.inf))

    return bias
