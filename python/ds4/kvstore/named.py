"""Loading one checkpoint by its key (``ds4 chat``'s named sessions and
system prompt): :meth:`ds4.kvstore.KVStore.load_named`."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from ..checkpoint import open_checkpoint
from ..errors import CheckpointError, CorruptCheckpointError, ImportFailedError
from .entries import NamedLoad
from .files import NOT_REGULAR, is_checkpoint_name, stat_key
from .rejection import import_failure

if TYPE_CHECKING:
    from ..session import Session
    from . import KVStore

__all__ = ["load_named"]


def load_named(store: KVStore, sess: Session, sha: str, text: bytes, *, exact: bool = False) -> NamedLoad:
    """See :meth:`KVStore.load_named`."""
    name = f"{sha}.kv"
    if not is_checkpoint_name(name):
        raise ValueError(f"not a checkpoint key: {sha!r}")
    path = os.path.join(store.dir, name)
    t0 = time.perf_counter()
    try:
        judged = stat_key(os.lstat(path))
        ck = open_checkpoint(
            path, prompt=text, expected_abi=sess.payload_abi, ctx=sess.ctx - 1, auth_key=store.auth_key
        )
        if exact and ck.text != text:
            return NamedLoad("missing")  # a longer checkpoint is not this text's
        sess.load_checkpoint(ck)
    except FileNotFoundError:
        return NamedLoad("missing")
    except CorruptCheckpointError as e:
        if e.code == NOT_REGULAR:  # not ours to judge: kept, like any unusable file
            sess.invalidate(f"unusable checkpoint {name}")
            return NamedLoad("unusable", error=e)
        sess.invalidate(f"corrupt checkpoint {name}")
        store.discard(path, e, "named load", judged)
        return NamedLoad("corrupt", error=e)
    except CheckpointError as e:
        sess.invalidate(f"unusable checkpoint {name}")
        return NamedLoad("unusable", error=e)
    except Exception as e:
        sess.invalidate(f"checkpoint {name} failed to load")
        return NamedLoad("unusable", error=ImportFailedError(import_failure(path, e)[3], path=path))
    return NamedLoad("loaded", tokens=ck.tokens, ms=(time.perf_counter() - t0) * 1000)
