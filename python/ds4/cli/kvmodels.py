"""Which model wrote a checkpoint, for ``ds4 kv ls`` (its MODEL column and
``--model PATH`` filter) and ``ds4 kv prune --model PATH`` (one model's
files only: :mod:`.kvremove`). A model is named by what its payload ABI records: the
engine's fingerprint of the weights (``model=sha256:<16 hex>``: SHA-256
of the GGUF file for llama.cpp, of the weights for the reference engine)
and, for llama.cpp, the architecture (``arch=``)."""

from __future__ import annotations

import argparse
import hashlib
import sys

from ..kvstore.entries import model_label, model_of
from .kvinfo import READABLE, Info

__all__ = ["file_fingerprint", "model_filter", "model_label", "model_of", "of_model"]


def file_fingerprint(path: str) -> str:
    """What an engine records of a GGUF file: the first 16 hex digits of its
    SHA-256 (``ds4.engines.llamacpp_lib.model_fingerprint``, without loading
    llama.cpp)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def model_filter(args: argparse.Namespace, cmd: str) -> str | bool | None:
    """``--model PATH``'s fingerprint; None without the flag; False (after
    saying why) when the file cannot be read."""
    path = getattr(args, "model", None)
    if path is None:
        return None
    try:
        return file_fingerprint(path)
    except OSError as e:
        print(f"{cmd}: --model {path}: {e.strerror or e}", file=sys.stderr)
        return False


def of_model(infos: list[Info], fp: str) -> list[Info]:
    """The readable files whose ABI records fingerprint ``fp``."""
    return [i for i in infos if i["status"] in READABLE and model_of(str(i.get("abi", ""))) == fp]
