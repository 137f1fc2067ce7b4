"""`redserve serve --redis-cluster 3 --redis-replicas 1`: a real 3-shard Valkey Cluster with a replica per primary,
one engine, the coordinator and the API, over real HTTP. Killing a replica shows nothing to clients. Killing
(kill -9) the primary that holds the engine's slot mid-stream makes the cluster promote that primary's replica by
itself: every stream completes with its exact tokens (resumed from what it delivered), requests the (paused) engine
had not read yet are answered, later requests too; the supervisor starts the dead node again only after the
failover, and it rejoins as a replica of the promoted node without taking its slots back or losing data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import redis
import requests
from greedy_stream import GreedyStream
from stack_procs import Procs, cli, free_port, poll, wait_for

from broker.connection import connect, parse_cluster_url
from broker.keys import RedisKeys
from redserve.proc_tree import alive, children, title
from redserve.redis_cluster import ClusterRedis, parse_cluster_nodes
from redserve.stack import RedisWatch
from redserve.supervisor import RestartPolicy, Supervisor

KEYS = RedisKeys()
MAX_TOKENS = 160
STREAMS = 8
PROMPT = [11, 12, 13]


class FailoverStack:
    def __init__(self, tmp: Path, model: str) -> None:
        self.state_dir = tmp / "state" / "redserve"
        self.procs = Procs(tmp, env={"REDSERVE_STATE_DIR": str(self.state_dir)})
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = self.procs.start("serve", cli(
            "--log-level", "INFO", "serve", "--model", model, "--dtype", "float32", "--port", str(self.port),
            "--api-workers", "1", "--redis-cluster", "3", "--redis-replicas", "1", "--no-batch-worker"))

    def engine_pid(self) -> int:
        return wait_for(lambda: next((p for p in children(self.proc.pid) if title(p).startswith("redserve-engine-0")
                                      and alive(p)), None), 30, "the engine's pid")

    def state(self) -> dict:
        return json.loads((self.state_dir / "stack.json").read_text())

    def redis(self):
        return connect(self.state()["redis_url"])

    def admin(self, address: str) -> redis.Redis:
        """A plain admin client of one node."""
        password = unquote(urlsplit(self.state()["admin_redis_url"]).password)
        host, port = address.rsplit(":", 1)
        return redis.Redis(host, int(port), username="admin", password=password, decode_responses=True,
                           socket_timeout=2)

    def node(self, address: str) -> dict:
        return next(n for n in self.state()["redis_nodes"] if n["address"] == address)

    def settled(self) -> bool:
        """Every node runs, each primary with slots has a replica whose link is up (as the stack file says)."""
        try:
            nodes = self.state()["redis_nodes"]
            replicas = [n for n in nodes if n["role"] == "replica"]
            if not all(n["running"] for n in nodes) or len(replicas) != 3:
                return False
            for n in replicas:
                with self.admin(n["address"]) as client:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
            return True
        except (OSError, ValueError, KeyError, redis.RedisError):
            return False

    def complete(self, max_tokens: int, timeout: float = 60) -> requests.Response:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        return requests.post(f"{self.base_url}/v1/completions", json=body, timeout=timeout)

    def served(self) -> bool:
        try:
            return self.complete(4, timeout=10).status_code == 200
        except requests.RequestException:
            return False


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FailoverStack]:
    s = FailoverStack(tmp_path_factory.mktemp("cluster-failover"), tiny_llama_dir)
    try:
        wait_for(lambda: s.served() and s.settled(), 120, "the stack to serve", interval=0.5, watch=(s.proc,))
        yield s
    finally:
        s.procs.close()


def _run_through(stack: FailoverStack, fault) -> list[GreedyStream]:
    running = [GreedyStream(stack.base_url, PROMPT, MAX_TOKENS) for _ in range(STREAMS)]
    assert all(s.started.wait(60) for s in running), "streams did not start"
    fault()
    return [s.join() for s in running]


def _engine_primary(stack: FailoverStack) -> tuple[str, int]:
    """(address, slot) of the primary that owns engine 0's keys now (the slot asked of the server)."""
    r = stack.redis()
    try:
        slot = r.cluster_keyslot(KEYS.engine("0"))
        node = r.get_node_from_key(KEYS.engine("0"))
        return f"{node.host}:{node.port}", slot
    finally:
        r.close()


def _owner(stack: FailoverStack, address: str, slot: int) -> str:
    """The address that owns `slot` as the node at `address` sees it (CLUSTER NODES)."""
    with stack.admin(address) as client:
        for view in parse_cluster_nodes(client.execute_command("CLUSTER", "NODES")):
            for part in view.slots:
                low, _, high = part.partition("-")
                if view.primary and not view.failed and int(low) <= slot <= int(high or low):
                    return next(n["address"] for n in stack.state()["redis_nodes"] if n["address"].endswith(
                        f":{view.port}"))
    return ""


def test_stack_file_shows_primaries_and_replicas(stack: FailoverStack) -> None:
    nodes = stack.state()["redis_nodes"]
    assert [(n["name"], n["role"], n.get("replica_of")) for n in nodes] == [
        ("redis-0", "primary", None), ("redis-0-r1", "replica", "redis-0"), ("redis-1", "primary", None),
        ("redis-1-r1", "replica", "redis-1"), ("redis-2", "primary", None), ("redis-2-r1", "replica", "redis-2")]
    assert [n["slots"] for n in nodes if n["role"] == "primary"] == ["0-5460", "5461-10921", "10922-16383"]
    url_nodes = parse_cluster_url(stack.state()["redis_url"]).nodes
    assert sorted(f"{h}:{p}" for h, p in url_nodes) == sorted(n["address"] for n in nodes)  # replicas too


def test_replica_kill_is_invisible(stack: FailoverStack) -> None:
    expected = stack.complete(MAX_TOKENS).json()["choices"][0]["text"]
    primary, _ = _engine_primary(stack)
    name = stack.node(primary)["name"]
    replica = next(n for n in stack.state()["redis_nodes"] if n.get("replica_of") == name)
    done = _run_through(stack, lambda: os.kill(replica["pid"], signal.SIGKILL))
    assert [s.outcome for s in done] == [(None, expected, MAX_TOKENS)] * STREAMS
    assert max(s.longest_gap for s in done) < 2.0, [s.longest_gap for s in done]
    assert _engine_primary(stack)[0] == primary  # no failover
    wait_for(lambda: stack.node(replica["address"])["pid"] != replica["pid"] and stack.settled(), 30,
             "the replica restarted and linked again")


def test_primary_killed_mid_stream_fails_over_to_its_replica(stack: FailoverStack) -> None:
    wait_for(stack.settled, 30, "every node back")
    expected = stack.complete(MAX_TOKENS).json()["choices"][0]["text"]
    old, slot = _engine_primary(stack)
    victim = stack.node(old)
    replica = next(n for n in stack.state()["redis_nodes"] if n.get("replica_of") == victim["name"])
    r = stack.redis()
    r.set("test:{0}:marker", b"kept")  # in the engine's slot: on the node about to die
    with stack.admin(replica["address"]) as client:
        client.execute_command("READONLY")
        poll(lambda: client.get("test:{0}:marker") == "kept", 10, "the marker on the replica")
    engine = stack.engine_pid()
    queued: list = []

    def fault() -> None:
        os.kill(engine, signal.SIGSTOP)
        try:
            before = r.xlen(KEYS.request_stream("0"))
            pool = ThreadPoolExecutor(2)
            queued.extend(pool.submit(stack.complete, 8) for _ in range(2))
            poll(lambda: r.xlen(KEYS.request_stream("0")) >= before + 2, 10, "two requests queued")
            os.kill(victim["pid"], signal.SIGKILL)
        finally:
            os.kill(engine, signal.SIGCONT)

    killed = time.monotonic()
    done = _run_through(stack, fault)
    assert [s.outcome for s in done] == [(None, expected, MAX_TOKENS)] * STREAMS
    answers = [f.result() for f in queued]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [8, 8]
    longest = max(s.longest_gap for s in done)
    print(f"longest stream pause across the failover: {longest:.2f} s ({time.monotonic() - killed:.1f} s to the end)")
    assert longest < 15.0, [s.longest_gap for s in done]
    # the cluster promoted the replica: it owns the slot now (CLUSTER NODES), and the stack file says so
    assert _owner(stack, replica["address"], slot) == replica["address"]
    assert _engine_primary(stack)[0] == replica["address"]
    assert r.get("test:{0}:marker") == b"kept"
    # a request sent after the failover: answered, after at most a few 503s with Retry-After while the API
    # catches up with the engine's registration on the promoted node (as the openai client retries them)
    unavailable = []

    def answered():
        resp = stack.complete(MAX_TOKENS)
        assert resp.status_code in (200, 503), resp.text
        if resp.status_code == 503:
            unavailable.append(resp.json()["error"]["message"])
        return resp if resp.status_code == 200 else None
    after = wait_for(answered, 30, "a request answered after the failover", interval=1.0)
    print(f"503s before the first answer after the failover: {unavailable}")
    assert after.json()["choices"][0]["text"] == expected
    # the supervisor started the dead node again; it rejoins as a replica of the promoted one, slots stay put
    wait_for(lambda: stack.node(old)["pid"] != victim["pid"] and stack.node(old).get("replica_of") == replica["name"]
             and stack.settled(), 40, "the old primary back as a replica")
    with stack.admin(old) as client:
        assert client.info("replication")["master_port"] == int(replica["address"].rsplit(":", 1)[1])
    assert _owner(stack, old, slot) == replica["address"]
    assert r.get("test:{0}:marker") == b"kept"
    assert stack.served()
    r.close()
    assert stack.proc.poll() is None


def _migrate(stack: FailoverStack, slot: int, source: str, target: str) -> None:
    """Valkey's atomic slot migration of `slot` from primary `source` to primary `target` (CLUSTER MIGRATESLOTS),
    returning once the target owns it."""
    with stack.admin(target) as client:
        target_id = client.execute_command("CLUSTER", "MYID")
    with stack.admin(source) as client:
        client.execute_command("CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", slot, slot, "NODE", target_id)
    wait_for(lambda: _owner(stack, target, slot) == target == _owner(stack, source, slot), 30, f"slot {slot} moved")


def test_engine_and_control_slots_migrated_mid_stream(stack: FailoverStack) -> None:
    """Resharding under load: engine 0's slot (its request stream, registration, heartbeat, presence channel) and
    then the control slot move to another primary (Valkey's atomic CLUSTER MIGRATESLOTS) while streams run; they
    complete with their exact tokens, no engine is declared gone, and nothing restarts."""
    wait_for(stack.settled, 60, "every node back")
    tokens = 1800  # long enough to outlast both moves (the tiny model runs ~5 ms a step here)
    expected = stack.complete(tokens).json()["choices"][0]["text"]
    engine = stack.engine_pid()
    running = [GreedyStream(stack.base_url, PROMPT, tokens) for _ in range(STREAMS)]
    assert all(s.started.wait(60) for s in running), "streams did not start"
    moves = []
    for key in (KEYS.engine("0"), KEYS.wave()):
        r = stack.redis()
        try:
            slot = r.cluster_keyslot(key)
            node = r.get_node_from_key(key)
            source = f"{node.host}:{node.port}"
            target = next(f"{p.host}:{p.port}" for p in r.get_primaries() if f"{p.host}:{p.port}" != source)
        finally:
            r.close()
        _migrate(stack, slot, source, target)
        moves.append((key, slot, source, target))
        time.sleep(0.5)
    assert not any(s.usage for s in running), "a stream ended before the slots had moved: make them longer"
    done = [s.join() for s in running]
    assert [s.outcome for s in done] == [(None, expected, tokens)] * STREAMS
    longest = max(s.longest_gap for s in done)
    print(f"slot moves {moves}: longest stream pause {longest:.2f} s")
    assert longest < 5.0, [s.longest_gap for s in done]
    assert _engine_primary(stack)[0] == moves[0][3]
    assert stack.engine_pid() == engine  # the engine carried on, never restarted
    after = stack.complete(MAX_TOKENS)
    assert after.status_code == 200, (after.status_code, after.text)
    assert after.json()["choices"][0]["text"] == expected[:len(after.json()["choices"][0]["text"])]
    assert "is gone" not in (stack.procs.logs / "serve.log").read_text()
    assert stack.proc.poll() is None


def test_a_dead_primary_waits_for_the_failover_then_rejoins_as_a_replica() -> None:
    """Without a stack: the supervisor's watch starts a killed primary again only once its replica took over."""
    with pytest.raises(ValueError, match=">= 3"):
        ClusterRedis(2, 1)  # no majority of primaries would be left to vote a replica in
    cluster = ClusterRedis(3, 1).start()
    try:
        supervisor, restarted = Supervisor(RestartPolicy(initial_backoff=0.01, max_backoff=0.01)), []
        watches = [RedisWatch(node, supervisor, restarted.append, name, lambda name=name: cluster.prepare_restart(name))
                   for name, node in cluster.nodes.items()]
        client = connect(cluster.url)
        client.set("k{x}", b"v")
        owner = client.get_node_from_key("k{x}")
        name = next(n for n, node in cluster.nodes.items() if node.port == owner.port)
        replica = next(n for n, p in cluster.primary_of.items() if p == name)
        with redis.Redis(*cluster.nodes[replica].address, username="admin",
                         password=cluster.passwords["admin"]) as admin:
            admin.execute_command("READONLY")
            poll(lambda: admin.get("k{x}") == b"v", 10, "k on the replica")
        os.kill(cluster.nodes[name].pid, signal.SIGKILL)
        killed, read = time.monotonic(), ThreadPoolExecutor(1).submit(lambda: (client.get("k{x}"), time.monotonic()))
        poll(lambda: [w.check() for w in watches] and restarted, 30, f"{name} restarted")
        assert restarted == [name]
        value, answered = read.result(timeout=30)  # a command sent to the dead node: retried across the failover
        assert value == b"v" and answered - killed > 1.0
        assert cluster.roles()[replica] == ("primary", None)  # it waited for the failover
        cluster.wait_ok()
        assert cluster.roles()[name] == ("replica", replica)
        for node in cluster.nodes.values():  # what clients read: every node's CLUSTER SLOTS lists the rejoined replica
            with redis.Redis(*node.address, username="admin", password=cluster.passwords["admin"]) as admin:
                assert all(len(entry) - 3 == 1 for entry in admin.execute_command("CLUSTER", "SLOTS")), node.address
        assert client.get("k{x}") == b"v"
        client.close()
        status = subprocess.run(cli("status", "--redis-url", cluster.url), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        shards = {cluster.nodes[replica].address: cluster.nodes[name].address, **{
            cluster.nodes[p].address: cluster.nodes[q].address for q, p in cluster.primary_of.items() if p != name}}
        for (ph, pp), (rh, rp) in shards.items():  # each primary now, with its replica
            assert f"{ph}:{pp} (replicas {rh}:{rp})" in status.stdout, status.stdout
    finally:
        cluster.stop()


def test_serve_takes_replicas_with_its_own_cluster_only(tmp_path: Path) -> None:
    from redserve.cli import build_parser
    from redserve.stack import Stack

    parse = build_parser().parse_args
    Stack(parse(["serve", "--model", str(tmp_path), "--redis-cluster", "3", "--redis-replicas", "1"]))  # accepted
    with pytest.raises(ValueError, match="N >= 3"):
        Stack(parse(["serve", "--model", str(tmp_path), "--redis-cluster", "2", "--redis-replicas", "1"]))
    with pytest.raises(ValueError, match="--redis-url"):
        Stack(parse(["serve", "--model", str(tmp_path), "--redis-cluster", "3", "--redis-url", "redis://h:1/0"]))
