"""Shared fixtures: a checkpoint writer, a session saver, one reference
engine per test module (``eng``; a module may define its own), ``ds4
serve`` processes (``serve`` and ``serve_module``: a factory whose servers
are stopped after the test or after the module; ``tests/helpers/server.py``)
and the shared tier's Redis servers (``node``, ``cluster``, ``flushed``: one
real ``redis-server`` or three-master cluster per test module, started on
first use; ``tests/helpers/redis_servers.py``). The helpers the modules
import live in ``tests/helpers/``."""

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


@pytest.fixture
def serve(tmp_path_factory):
    """``serve(*flags, name=..., cls=Server, kv=False, tmp=None, key=None,
    start=True, **kw) -> Server``: ``ds4 serve`` with ``flags`` on a free
    port, healthy when returned, stopped after the test
    (:class:`helpers.server.Servers` says the rest)."""
    from helpers.server import Servers

    servers = Servers(tmp_path_factory.mktemp)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def serve_module(tmp_path_factory):
    """:func:`serve` for a module's fixtures: its servers are stopped after
    the module's tests."""
    from helpers.server import Servers

    servers = Servers(tmp_path_factory.mktemp)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One ``redis-server`` for the module's tests."""
    from helpers.redis_servers import RedisNode

    srv = RedisNode(str(tmp_path_factory.mktemp("redis"))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A three-master Redis Cluster for the module's tests."""
    from helpers.redis_servers import RedisClusterNodes

    srv = RedisClusterNodes(str(tmp_path_factory.mktemp("cluster"))).start()
    yield srv
    srv.stop()


@pytest.fixture
def flushed(node):
    """The module's node, emptied before the test."""
    with node.client() as c:
        c.flushall()
    return node


#: The modules whose tests are ``slow``: they load a real model through
#: llama.cpp, start a server or Redis process, run the CLI in a subprocess,
#: or drive many turns through a pool. ``bash scripts/test.sh --quick`` runs
#: the rest (``-m "not slow"``); the README's command runs everything. A
#: single slow test elsewhere carries ``@pytest.mark.slow`` itself.
SLOW_MODULES = frozenset(
    {
        "test_agents_anthropic",
        "test_agents_cc_loop",
        "test_agents_chat",
        "test_agents_reasoning",
        "test_agents_responses",
        "test_agents_thinking",
        "test_agents_volatile",
        "test_blocks_crash",
        "test_blocks_models",
        "test_bounded_verify",
        "test_chat_template",
        "test_cli",
        "test_cli_bench_pool",
        "test_cli_blocks",
        "test_cli_kv_remote",
        "test_cli_progress",
        "test_codec",
        "test_constrain",
        "test_core_format",
        "test_crash",
        "test_dir_trust",
        "test_engine_llamacpp",
        "test_engine_llamacpp_batch",
        "test_exact_canonical",
        "test_frontier",
        "test_import_bounds",
        "test_import_graph",
        "test_inplace_race",
        "test_invalidation",
        "test_isolation_markers",
        "test_kv_escape",
        "test_kv_plot",
        "test_kv_tenant_cli",
        "test_kvstore",
        "test_kvstore_files",
        "test_kvstore_policy",
        "test_kvstore_remote",
        "test_kvstore_store_policy",
        "test_ladder",
        "test_live_maps",
        "test_loading_remote",
        "test_models_exact",
        "test_models_rungs",
        "test_models_server",
        "test_models_tiny",
        "test_models_tiny_server",
        "test_pool_routing",
        "test_pool_schedule",
        "test_ports",
        "test_probe_cache",
        "test_reliability",
        "test_remote_blocks",
        "test_restart_interleaved",
        "test_server",
        "test_server_pool",
        "test_server_pool_batch",
        "test_server_pool_fair",
        "test_server_remote",
        "test_server_security",
        "test_span_tokens",
        "test_store_links",
        "test_store_models",
        "test_tenants",
        "test_turn_refusals",
        "test_ui_browser",
        "test_v1_parity",
        "test_v3_bounds",
        "test_warm_start",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
