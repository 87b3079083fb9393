"""ds4: a disk KV cache for LLM inference that can be trusted.

Quick tour::

    import ds4
    eng = ds4.ReferenceEngine()              # or ds4.LlamaCppEngine()
    store = ds4.KVStore("~/.cache/ds4", budget_mb=4096)
    sess = ds4.Session(eng, ctx=8192)
    report = ds4.recover(sess, store, prompt_text)
    print(report.rung, report.reused_tokens)
"""

from typing import Any

from . import errors, keytext
from ._core import __version__ as _core_version
from .checkpoint import Checkpoint, open_checkpoint, write_checkpoint
from .engine import Engine, EngineContext
from .kvstore import KVStore
from .recovery import RecoveryReport, recover
from .session import Rewrite, Session

__version__ = _core_version

__all__ = [
    "Checkpoint",
    "Engine",
    "EngineContext",
    "KVStore",
    "LlamaCppEngine",
    "RecoveryReport",
    "ReferenceEngine",
    "Rewrite",
    "Session",
    "default_engine",
    "errors",
    "keytext",
    "open_checkpoint",
    "recover",
    "write_checkpoint",
]


def __getattr__(name: str) -> object:
    # Engines are imported lazily: llama_cpp is heavy and optional at import.
    if name == "ReferenceEngine":
        from .engines.reference import ReferenceEngine

        return ReferenceEngine
    if name == "LlamaCppEngine":
        from .engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine
    raise AttributeError(f"module 'ds4' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def default_engine(**kwargs: Any) -> Engine:
    """The engine ``--engine auto`` picks (:func:`ds4.config.engine_kind`):
    SmolLM2 through llama.cpp when installed with a model, else the
    reference engine. ``kwargs`` go to its constructor."""
    from .config import build_engine

    return build_engine("auto", kwargs.pop("model_path", None), **kwargs)
