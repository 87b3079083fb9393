"""ds4: a disk KV cache for LLM inference that can be trusted.

Quick tour::

    import ds4
    eng = ds4.ReferenceEngine()              # or ds4.LlamaCppEngine()
    store = ds4.KVStore("~/.cache/ds4", budget_mb=4096)
    sess = ds4.Session(eng, ctx=8192)
    report = ds4.recover(sess, store, prompt_text)
    print(report.rung, report.reused_tokens)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._core import __version__ as _core_version

if TYPE_CHECKING:
    from . import errors, keytext
    from .checkpoint import Checkpoint, open_checkpoint, write_checkpoint
    from .engine import Engine, EngineContext
    from .engines.llamacpp import LlamaCppEngine
    from .engines.reference import ReferenceEngine
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


#: where each public name lives, imported when first asked for (``import
#: ds4`` loads only the extension; ``from ds4.kvstore import KVStore`` never
#: loads numpy, the engines or the ladder): engines, the session and the
#: ladder pull in numpy, llama_cpp is heavy and optional
_LAZY = {
    "Checkpoint": "checkpoint",
    "open_checkpoint": "checkpoint",
    "write_checkpoint": "checkpoint",
    "Engine": "engine",
    "EngineContext": "engine",
    "KVStore": "kvstore",
    "RecoveryReport": "recovery",
    "recover": "recovery",
    "Rewrite": "session",
    "Session": "session",
    "ReferenceEngine": "engines.reference",
    "LlamaCppEngine": "engines.llamacpp",
}
_SUBMODULES = ("errors", "keytext")


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'ds4' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def default_engine(**kwargs: Any) -> Engine:
    """The engine ``--engine auto`` picks (:func:`ds4.config.engine_kind`):
    SmolLM2 through llama.cpp when installed with a model, else the
    reference engine. ``kwargs`` go to its constructor."""
    from .config import build_engine

    return build_engine("auto", kwargs.pop("model_path", None), **kwargs)
