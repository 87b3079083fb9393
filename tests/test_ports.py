"""``DS4_TEST_PORTS=lo-hi`` keeps the tests' servers inside a port range
(tests/helpers/ports.py): the picks, a bad value, a full range, and a real Redis
node and three-master cluster (bus ports too) started inside it."""

from __future__ import annotations

import socket

import pytest
from helpers.ports import free_port, free_ports, port_range
from helpers.redis_servers import RedisClusterNodes, RedisNode, cluster_ports

LO, HI = 41000, 41063


@pytest.fixture
def ranged(monkeypatch):
    monkeypatch.setenv("DS4_TEST_PORTS", f"{LO}-{HI}")


def test_picks_stay_in_the_range_and_are_distinct(ranged):
    assert port_range() == range(LO, HI + 1)
    got = free_ports(10)
    assert len(set(got)) == 10 and all(LO <= p <= HI for p in got)
    assert LO <= free_port() <= HI
    pairs = cluster_ports(3)
    flat = [p for pair in pairs for p in pair]
    assert len(set(flat)) == 6 and all(LO <= p <= HI for p in flat)


def test_unset_is_the_kernels_pick(monkeypatch):
    monkeypatch.delenv("DS4_TEST_PORTS", raising=False)
    assert port_range() is None
    assert 0 < free_port() < 65536


@pytest.mark.parametrize("bad", ["41000", "41010-41000", "80-90", "a-b", "41000-70000"])
def test_a_bad_value_is_an_error(monkeypatch, bad):
    monkeypatch.setenv("DS4_TEST_PORTS", bad)
    with pytest.raises(ValueError, match="DS4_TEST_PORTS"):
        free_port()


def test_a_range_with_too_few_free_ports_is_an_error(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    monkeypatch.setenv("DS4_TEST_PORTS", f"{port}-{port}")
    try:
        with pytest.raises(RuntimeError, match="free ports"):
            free_port()
    finally:
        held.close()


def test_a_redis_node_and_a_cluster_start_inside_the_range(ranged, tmp_path):
    node = RedisNode(str(tmp_path)).start()
    try:
        assert LO <= node.port <= HI
        with node.client() as c:
            assert c.ping()
    finally:
        node.stop()
    cluster = RedisClusterNodes(str(tmp_path / "cluster")).start()
    try:
        assert all(LO <= n.port <= HI for n in cluster.nodes)
        with cluster.nodes[0].client() as c:
            info = c.execute_command("CLUSTER", "INFO").decode()
        assert "cluster_state:ok" in info
    finally:
        cluster.stop()
