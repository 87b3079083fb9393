"""Real ``redis-server`` processes for the shared-tier tests: a single node
and a three-master Redis Cluster, each on free loopback ports in a temp
directory, stopped at the end. ``scripts/setup.sh`` installs the server."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time

import redis

from helpers.ports import bindable, free_port, free_ports, port_range


def cluster_ports(n: int) -> list[tuple[int, int]]:
    """A free port and a free cluster bus port for each of ``n`` cluster
    nodes, all distinct (Redis refuses a port above 55535 in cluster mode):
    with ``DS4_TEST_PORTS``, ``2n`` of its ports; else random ports whose
    +10000 is free too."""
    if port_range() is not None:
        got = free_ports(2 * n)
        return list(zip(got[:n], got[n:], strict=True))
    rng, out = random.Random(), []
    for _ in range(1000 * n):
        port = rng.randrange(20000, 55535)
        if bindable(port) and bindable(port + 10000) and not {port, port + 10000} & {p for pair in out for p in pair}:
            out.append((port, port + 10000))
            if len(out) == n:
                return out
    raise RuntimeError("no free port pairs for the cluster's nodes")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run scripts/setup.sh (it installs Debian's redis-server)")
    return path


class RedisNode:
    """One ``redis-server`` on 127.0.0.1, no persistence."""

    def __init__(self, workdir: str, *extra: str, port: int | None = None):
        self.port = port or free_port()
        self.dir = os.path.join(workdir, f"redis-{self.port}")
        os.makedirs(self.dir, exist_ok=True)
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisNode:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # never leave a half-started server behind
            raise

    def _start(self, timeout: float) -> RedisNode:
        args = [
            _binary("redis-server"),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            *self.extra,
        ]
        self.log = open(os.path.join(self.dir, "redis.log"), "ab")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1) as c:
                    if c.ping():
                        return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None


class RedisClusterNodes:
    """Three masters (``--cluster-enabled yes``) joined by ``redis-cli
    --cluster create ... --cluster-yes``."""

    def __init__(self, workdir: str):
        self.nodes = []
        for port, bus in cluster_ports(3):
            node = RedisNode(workdir, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000", port=port)
            node.extra += ["--cluster-port", str(bus), "--cluster-config-file", os.path.join(node.dir, "nodes.conf")]
            self.nodes.append(node)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> RedisClusterNodes:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()  # the nodes that did start
            raise

    def _start(self, timeout: float) -> RedisClusterNodes:
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [_binary("redis-cli"), "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for n in self.nodes:
                with n.client() as c:
                    states.append(c.execute_command("CLUSTER", "INFO").decode().split("\r\n")[0])
            if all(s == "cluster_state:ok" for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
