"""Shared fixtures: a checkpoint writer, a session saver, one reference
engine per test module (``eng``; a module may define its own), and the
shared tier's Redis servers (``node``, ``cluster``, ``flushed``: one real
``redis-server`` or three-master cluster per test module, started on first
use; ``tests/redis_servers.py``)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import ds4
from ds4.checkpoint import write_checkpoint

#: ABI string of every test checkpoint (short: keeps crafted headers small)
TEST_ABI = "t/1"


def _write(directory, text, arrays=None, *, name=None, **kw):
    """Write a v2 checkpoint named ``sha1(text).kv`` (or ``name``) into
    ``directory`` and return its path as a str."""
    text_b = text.encode() if isinstance(text, str) else bytes(text)
    if arrays is None:
        arrays = {"kv": np.arange(48, dtype=np.float32).reshape(4, 12), "logits": np.linspace(-1, 1, 17)}
    kw.setdefault("abi", TEST_ABI)
    kw.setdefault("tokens", 7)
    kw.setdefault("ctx", 4096)
    kw.setdefault("created", 1_700_000_000)
    path = os.path.join(os.fspath(directory), name or hashlib.sha1(text_b).hexdigest() + ".kv")
    write_checkpoint(path, text_b, arrays, **kw)
    return path


def _save_session(directory, sess, *, abi=None):
    """Write ``sess``'s live state as ``sha1(rendered text).kv`` in
    ``directory`` (under ``abi`` when given, else the session's own) and
    return the path as a str."""
    text = sess.text_bytes()
    path = os.path.join(os.fspath(directory), hashlib.sha1(text).hexdigest() + ".kv")
    write_checkpoint(path, text, sess.export_arrays(), abi=abi or sess.payload_abi, tokens=sess.n_past, ctx=sess.ctx)
    return path


@pytest.fixture(scope="session")
def save_session():
    """``save_session(directory, sess, *, abi=None) -> path``."""
    return _save_session


@pytest.fixture(scope="session")
def write_ck():
    """``write_ck(directory, text, arrays=None, *, name=None, **write_kw) -> path``."""
    return _write


@pytest.fixture(scope="module")
def eng():
    """The reference engine, one per test module (as each module built its own)."""
    return ds4.ReferenceEngine()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One ``redis-server`` for the module's tests."""
    from redis_servers import RedisNode

    srv = RedisNode(str(tmp_path_factory.mktemp("redis"))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A three-master Redis Cluster for the module's tests."""
    from redis_servers import RedisClusterNodes

    srv = RedisClusterNodes(str(tmp_path_factory.mktemp("cluster"))).start()
    yield srv
    srv.stop()


@pytest.fixture
def flushed(node):
    """The module's node, emptied before the test."""
    with node.client() as c:
        c.flushall()
    return node
