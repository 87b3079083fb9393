"""ds4: a disk KV cache for LLM inference that can be trusted."""

from . import errors
from .engine import Engine, EngineContext

__all__ = ["errors", "Engine", "EngineContext"]
