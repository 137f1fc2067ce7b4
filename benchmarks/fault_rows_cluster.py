"""The Redis Cluster rows of `benchmarks/fault_matrix.py` (``--redis-cluster N``): a resharding under streams, then
each primary killed in turn (see that module's rules)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import redis
from fault_matrix import (
    KEYS,
    Row,
    ServeStack,
    Stream,
    _finished,
    _stream_summary,
    joined,
    queue_unstarted,
    wait_for,
)

from redserve.proc_tree import alive


def _cluster_node_holds(stack: ServeStack, address: str) -> str:
    """Which of redserve's keys and channels the cluster node at `address` owns."""
    client = stack.redis()
    try:
        def owner(key: str) -> str:
            node = client.get_node_from_key(key)
            return f"{node.host}:{node.port}"
        held = [f"engine {e} keys" for e in map(str, range(stack.engines)) if owner(KEYS.engine(e)) == address]
        if owner(KEYS.lb()) == address:
            held.append("control keys + Celery")
        clients = [c.decode() for c in client.smembers(KEYS.clients())]
        outs = sum(owner(KEYS.output_channel(c)) == address for c in clients)
        if outs:
            held.append(f"{outs} of {len(clients)} client output channels")
    finally:
        client.close()
    return ", ".join(held) or "no redserve key"


def _shard_primary(stack: ServeStack, index: int) -> dict:
    """The node that is primary of shard `index` now (``redis-{index}`` or, after a failover, one of its replicas)."""
    return next(n for n in stack.state()["redis_nodes"] if n["role"] == "primary"
                and (n["name"] == f"redis-{index}" or n["name"].startswith(f"redis-{index}-")))


def _role(stack: ServeStack, address: str) -> str | None:
    """INFO replication's role of the node at `address` (as the admin), None if it does not answer."""
    password = unquote(urlsplit(stack.state()["admin_redis_url"]).password or "")
    host, port = address.rsplit(":", 1)
    try:
        with redis.Redis(host, int(port), username="admin", password=password, socket_timeout=1,
                         socket_connect_timeout=1, decode_responses=True) as client:
            return client.info("replication")["role"]
    except redis.RedisError:
        return None


def redis_cluster_node_kill(stack: ServeStack, index: int, streams: int) -> Row:
    node = _shard_primary(stack, index)
    replicas = [n for n in stack.state()["redis_nodes"] if n.get("replica_of") == node["name"]]
    holds = _cluster_node_holds(stack, node["address"])
    engines = [stack.child(f"engine-{i}") for i in range(stack.engines)]
    running = [Stream(stack, 300) for _ in range(streams)]
    threads, results = queue_unstarted(stack, engines)
    try:
        os.kill(node["pid"], signal.SIGKILL)
        killed = time.monotonic()
    finally:
        for engine in engines:
            os.kill(engine, signal.SIGCONT)
    promoted = ""
    if replicas:
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: any(_role(stack, r["address"]) == "master" for r in replicas), 60, "a replica promoted",
                     interval=0.05)
            promoted = f"replica promoted after {time.monotonic() - killed:.1f} s; "
    recovered = stack.wait_served(killed)
    _finished(running)
    queued, lost = joined(threads, results)
    if replicas:
        return (f"Redis Cluster primary {node['name']} kill -9, {len(replicas)} replica(s) ({holds})",
                f"{streams} streams mid-way, 3 queued ({_frozen(stack)}), SIGKILL the node; the cluster fails over",
                f"{promoted}{_stream_summary(running)}; queued: {queued}", f"{recovered:.1f}", f"{lost} of 3")
    return (f"Redis Cluster primary {node['name']} kill -9 ({holds})",
            f"{streams} streams mid-way, 3 queued ({_frozen(stack)}), SIGKILL the node; restarted with its slots",
            f"{_stream_summary(running)}; queued: {queued}", f"{recovered:.1f}", f"{lost} of 3 (no persistence)")


def _frozen(stack: ServeStack) -> str:
    return "engine SIGSTOPped" if stack.engines == 1 else f"all {stack.engines} engines SIGSTOPped"


def redis_cluster_reshard(stack: ServeStack, streams: int) -> Row:
    """Valkey's atomic slot migration (CLUSTER MIGRATESLOTS) of every engine's slot and then the control slot, each
    to another primary, while streams run."""
    password = unquote(urlsplit(stack.state()["admin_redis_url"]).password or "")

    def admin(address: str) -> redis.Redis:
        host, port = address.rsplit(":", 1)
        return redis.Redis(host, int(port), username="admin", password=password, socket_timeout=5,
                           decode_responses=True)

    running = [Stream(stack, 1500) for _ in range(streams)]
    client = stack.redis()
    started, moved = time.monotonic(), []
    try:
        for key in [*(KEYS.engine(str(e)) for e in range(stack.engines)), KEYS.lb()]:
            slot, node = client.keyslot(key), client.get_node_from_key(key)
            source = f"{node.host}:{node.port}"
            target = next(f"{p.host}:{p.port}" for p in client.get_primaries() if f"{p.host}:{p.port}" != source)
            with admin(target) as t, admin(source) as s:
                s.execute_command("CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", slot, slot, "NODE",
                                  t.execute_command("CLUSTER", "MYID"))
                port = int(target.rsplit(":", 1)[1])
                wait_for(lambda t=t, slot=slot, port=port: any(e[0] <= slot <= e[1] and e[2][1] == port
                                                               for e in t.execute_command("CLUSTER", "SLOTS")),
                         30, "the move")
            moved.append(key)
        took = time.monotonic() - started
        open_at_end = sum(s.outcome == "open" for s in running)
    finally:
        client.close()
    _finished(running)
    gone = sum(1 for line in stack.log_path.read_text(errors="replace").splitlines()
               if "broker.client.liveness" in line and " is gone" in line)
    return (f"Redis Cluster resharding ({len(moved)} slots: each engine's, then the control slot)",
            f"{streams} streams of 1500 tokens; CLUSTER MIGRATESLOTS of each slot to another primary, one after another",
            f"{_stream_summary(running)}; {open_at_end} streams still open when the last slot had moved; "
            f"'engine gone' verdicts: {gone}", f"{took:.1f} (all moves)", "-")


def cluster_steps(stack: ServeStack, primaries: int, streams: int, replicas: int = 0) -> list[Callable[[], Row]]:
    """The rows of ``--redis-cluster``: each primary killed in turn, once the previous one is back (with replicas:
    back as a replica, linked, each shard with all its replicas)."""
    def settled() -> bool:
        nodes = stack.state()["redis_nodes"]
        if not all(alive(n["pid"]) for n in nodes):
            return False
        followers = [n for n in nodes if n["role"] == "replica"]
        if len(followers) != primaries * replicas or any(_role(stack, n["address"]) != "slave" for n in followers):
            return False
        return stack.served()
    return [lambda: (wait_for(settled, 120, "every node back"), redis_cluster_reshard(stack, streams))[1],
            *(lambda i=i: (wait_for(settled, 120, "every node back"), redis_cluster_node_kill(stack, i, streams))[1]
              for i in range(primaries))]
