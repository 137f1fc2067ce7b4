"""Celery on a Redis Cluster (`api.batch.celery_cluster`): a real 3-shard Valkey Cluster with a replica per
primary, a real Celery worker process (prefork pool, `tests/celery_cluster_app.py`), and this process sending tasks
and reading their results. The primary owning the Celery keys' slot is demoted first by a graceful CLUSTER FAILOVER
(its open connections then answer MOVED or UNBLOCKED), then the promoted one is killed (-9): the tasks sent after
each are run and their results read, by the same worker process, which is never restarted."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

import pytest
import redis
from stack_procs import Procs, wait_for

from api.batch.celery_redis import celery_redis_settings, celery_transport_options
from broker.connection import cluster_node_for_key, connect
from broker.keys import RedisKeys
from redserve.redis_cluster import ClusterRedis

ROOT = Path(__file__).resolve().parents[1]
PREFIX = RedisKeys().celery()


def test_cluster_settings_name_the_slot_following_transport_and_backend() -> None:
    url = "redis+cluster://redserve:p%40ss@10.0.0.5:7000,10.0.0.6:7001/"
    settings = celery_redis_settings(url, route_key=PREFIX)
    assert settings["broker_url"] == "redis://redserve:p%40ss@10.0.0.5:7000/0"  # its credentials; no lookup yet
    assert settings["broker_transport"] == "api.batch.celery_cluster:ClusterTransport"
    assert settings["result_backend"] == "api.batch.celery_cluster:ClusterResultBackend+redis://redserve:p%40ss@10.0.0.5:7000/0"
    assert celery_transport_options(url, route_key=PREFIX) == {"cluster_url": url, "cluster_route_key": PREFIX}
    assert celery_redis_settings(url) == {} and celery_transport_options(url) == {}  # checked only


def _owner(cluster: ClusterRedis) -> str:
    host, port = cluster_node_for_key(cluster.url, PREFIX)
    return next(name for name, node in cluster.nodes.items() if node.address == (host, port))


def _admin(cluster: ClusterRedis, name: str) -> redis.Redis:
    return redis.Redis(*cluster.nodes[name].address, username="admin", password=cluster.passwords["admin"],
                       decode_responses=True, socket_timeout=5)


def test_celery_follows_the_slot_owner_across_failovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = ClusterRedis(3, 1).start()
    monkeypatch.setenv("REDSERVE_TEST_CLUSTER_URL", cluster.url)
    procs = Procs(tmp_path, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"})
    try:
        tasks = importlib.reload(importlib.import_module("celery_cluster_app"))
        worker = procs.start("worker", [sys.executable, "-m", "celery", "-A", "celery_cluster_app", "worker",
                                        "--pool=prefork", "--concurrency=2", "--loglevel=INFO"])

        def run(xs: range) -> list[int]:
            sent = [tasks.double.apply_async((x,)) for x in xs]
            return [result.get(timeout=60)["value"] for result in sent]

        assert run(range(4)) == [0, 2, 4, 6]
        first = _owner(cluster)
        replica = next(name for name, primary in cluster.primary_of.items() if primary == first)
        with _admin(cluster, replica) as admin:
            admin.execute_command("CLUSTER", "FAILOVER")  # graceful: the old primary lives on as a replica
        wait_for(lambda: _owner(cluster) == replica, 30, "the replica to take the Celery slot over")
        assert run(range(4, 8)) == [8, 10, 12, 14]
        assert worker.poll() is None, procs.log("worker")[-3000:]

        cluster.wait_ok()
        os.kill(cluster.nodes[replica].pid, signal.SIGKILL)  # the promoted primary: the old one takes over again
        assert run(range(8, 12)) == [16, 18, 20, 22]
        assert _owner(cluster) == first
        assert worker.poll() is None, procs.log("worker")[-3000:]
        log = procs.log("worker")
        assert "Connection to broker lost" in log  # the worker did lose its connection, and carried on
        keys = connect(cluster.url)
        try:  # every Celery key in the one slot, on the node that owns it now
            assert {keys.cluster_keyslot(k) for k in keys.scan_iter(match=f"{PREFIX}*", target_nodes="all")} == {
                keys.cluster_keyslot(PREFIX)}
        finally:
            keys.close()
    finally:
        procs.close()
        cluster.stop()
