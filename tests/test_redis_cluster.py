"""`redserve serve --redis-cluster 3` with DP=2: a real 3-primary Valkey Cluster, two engines, the coordinator, the
API and a batch worker, all talking through `redis+cluster://`. Streams over HTTP complete with exact token counts,
a batch job completes, one engine's keys map to one slot, and output channels are sharded channels."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from stack_procs import Procs, cli, free_port, wait_for

from api.batch.store import BatchStore
from broker.channels import ChannelMoved, Subscriber, subscriber_counts
from broker.connection import cluster_url, connect, parse_cluster_url
from broker.keys import RedisKeys
from broker.load_balance import read_lb_snapshot
from broker.registry import EngineRegistry
from redserve.redis_cluster import ClusterRedis, slot_ranges

API_KEY = "sk-cluster-test-key"
KEYS = RedisKeys()
MAX_TOKENS = 40


class ClusterStack:
    def __init__(self, tmp: Path) -> None:
        self.state_dir = tmp / "state" / "redserve"
        self.env = {"REDSERVE_STATE_DIR": str(self.state_dir)}
        self.procs = Procs(tmp, env=self.env)
        self.base_url = f"http://127.0.0.1:{free_port()}"
        self.proc = None

    def start(self, model: str) -> None:
        port = self.base_url.rsplit(":", 1)[1]
        self.proc = self.procs.start("serve", cli(
            "--log-level", "INFO", "serve", "--model", model, "--dtype", "float32", "--port", port,
            "--api-workers", "1", "--api-key", API_KEY, "--redis-cluster", "3", "--data-parallel-size", "2"))

    def state(self) -> dict:
        return json.loads((self.state_dir / "stack.json").read_text())

    def redis(self) -> RedisCluster:
        return connect(self.state()["redis_url"])

    def complete(self, max_tokens: int = 4, stream: bool = False, timeout: float = 60) -> requests.Response:
        body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return requests.post(f"{self.base_url}/v1/completions", json=body, timeout=timeout, stream=stream,
                             headers={"Authorization": f"Bearer {API_KEY}"})


def served(stack: ClusterStack) -> bool:
    try:
        return stack.complete(timeout=10).status_code == 200
    except requests.RequestException:
        return False


def both_engines_ready(stack: ClusterStack) -> bool:
    try:
        r = stack.redis()
    except (OSError, ValueError):
        return False
    try:
        return all(r.hget(KEYS.engine(e), "state") == b"ready" for e in ("0", "1"))
    finally:
        r.close()


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterStack]:
    s = ClusterStack(tmp_path_factory.mktemp("cluster"))
    s.start(tiny_llama_dir)
    try:
        wait_for(lambda: served(s) and both_engines_ready(s), 120, "the clustered stack to serve", interval=0.5,
                 watch=(s.proc,))
        yield s
    finally:
        s.procs.close()


def test_cluster_url_round_trip() -> None:
    url = cluster_url([("127.0.0.1", 7000), ("h2", 7001)], "u", "p@ss")
    parsed = parse_cluster_url(url)
    assert parsed.nodes == (("127.0.0.1", 7000), ("h2", 7001)) and (parsed.username, parsed.password) == ("u", "p@ss")
    for bad in ("redis+cluster://u:p@/", "redis+cluster://h:1/3", "redis+cluster://h:1/?ssl=1"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    assert slot_ranges(3) == [(0, 5460), (5461, 10921), (10922, 16383)]


def test_stack_file_lists_three_primaries_covering_every_slot(stack: ClusterStack) -> None:
    state = stack.state()
    assert state["redis_url"].startswith("redis+cluster://")
    assert [n["role"] for n in state["redis_nodes"]] == ["primary"] * 3
    r = stack.redis()
    try:
        assert len(r.get_primaries()) == 3
        info = r.cluster_info(target_nodes=RedisCluster.RANDOM)
        assert info["cluster_state"] == "ok" and int(info["cluster_slots_assigned"]) == 16384
    finally:
        r.close()


def test_one_engine_keys_share_one_slot_and_the_control_keys_another(stack: ClusterStack) -> None:
    r = stack.redis()
    try:
        for engine in ("0", "1"):
            names = [KEYS.request_stream(engine), KEYS.engine(engine), KEYS.engine_alive(engine)]
            assert all(r.exists(name) for name in names), names
            slots = {r.cluster_keyslot(name) for name in names}  # asked of the server (CLUSTER KEYSLOT)
            assert slots == {r.keyslot(KEYS.engine(engine))}
        control = [KEYS.engines(), KEYS.lb(), KEYS.wave(), KEYS.coordinator_lock(), KEYS.coordinator(), KEYS.clients()]
        wait_for(lambda: all(r.exists(name) for name in control), 20, f"the coordinator's keys {control}")
        assert len({r.cluster_keyslot(name) for name in control}) == 1
    finally:
        r.close()


def test_streams_complete_with_exact_token_counts(stack: ClusterStack) -> None:
    def stream(_: int) -> tuple[int, int | None]:
        chunks, usage = 0, None
        with stack.complete(MAX_TOKENS, stream=True) as resp:
            assert resp.status_code == 200, resp.text
            for line in resp.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunks += sum(1 for c in chunk.get("choices", []) if c.get("text"))
                usage = chunk.get("usage") or usage
        return chunks, (usage or {}).get("completion_tokens")

    r = stack.redis()
    try:
        before = {e: int(r.hget(KEYS.engine(e), "generated_tokens") or 0) for e in ("0", "1")}
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(stream, range(8)))
        assert [tokens for _, tokens in results] == [MAX_TOKENS] * 8
        assert all(chunks >= 1 for chunks, _ in results)
        wait_for(lambda: sum(int(r.hget(KEYS.engine(e), "generated_tokens") or 0) - before[e] for e in before)
                 >= 8 * MAX_TOKENS, 10, "the engines' stats")
        assert sorted(read_lb_snapshot(r, KEYS)) == ["0", "1"]  # the coordinator sees both engines
        # the API's output channel is a sharded channel: SHARDNUMSUB on its node sees the subscriber
        clients = [c.decode() for c in r.smembers(KEYS.clients())]
        counts = subscriber_counts(r, [KEYS.output_channel(c) for c in clients])
        assert counts and all(n == 1 for n in counts), dict(zip(clients, counts, strict=True))
    finally:
        r.close()


def test_batch_job_completes(stack: ClusterStack, tmp_path: Path) -> None:
    n = 12
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                                       "body": {"model": "tiny-llama", "prompt": f"Story {i}:", "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n)))
    submit = subprocess.run(cli("batch", "submit", str(src), "--chunk-size", "4"), capture_output=True, text=True,
                            timeout=60, env={**os.environ, **stack.env})
    assert submit.returncode == 0, submit.stderr
    batch_id = submit.stdout.split()[0]
    store = BatchStore(stack.redis(), KEYS)
    try:
        wait_for(lambda: store.info(batch_id).status == "completed", 90, "the batch to complete", watch=(stack.proc,))
        info = store.info(batch_id)
        results = list(store.results(batch_id, n))
        celery_slots = {store.redis.cluster_keyslot(k) for k in store.redis.scan_iter(match=f"{KEYS.celery()}*",
                                                                                     target_nodes="all")}
    finally:
        store.redis.close()
    assert (info.total, info.completed, info.failed) == (n, n, 0)
    assert [r["custom_id"] for r in results] == [f"b{i}" for i in range(n)]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 6 for r in results)
    assert celery_slots == {store.redis.keyslot(KEYS.celery())}  # Celery's keys: all in the control slot


def test_status_and_redis_cli_on_a_cluster() -> None:
    """Without a stack: `redserve status` names the primaries, `redserve redis-cli` follows redirections (-c)."""
    cluster = ClusterRedis(3).start()
    try:
        r = connect(cluster.url)
        EngineRegistry(r, KEYS).register("7", {"dp_rank": 0, "tp": 1, "model": "m"})
        r.close()
        status = subprocess.run(cli("status", "--redis-url", cluster.url), capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "cluster of 3 primaries" in status.stdout and "starting" in status.stdout
        assert "PASS" not in status.stdout and cluster.passwords["redserve"] not in status.stdout
        got = subprocess.run(cli("redis-cli", "--redis-url", cluster.url, "HGET", KEYS.engine("7"), "state"),
                             capture_output=True, text=True, timeout=60)
        assert got.stdout.strip() == "starting", got.stdout + got.stderr
    finally:
        cluster.stop()


def test_a_migrated_slot_drops_its_subscribers_and_its_stale_counts() -> None:
    """Without a stack: a slot moved by Valkey's atomic migration (CLUSTER MIGRATESLOTS) drops a `Subscriber`'s
    sharded channel with a SUNSUBSCRIBE it did not ask for, which it raises as a lost connection (its own
    unsubscribe is no error); counting subscribers with the old slot map raises ChannelMoved instead of reading 0
    off the node that gave the slot away, and so does a count read from another node than the last one."""
    cluster = ClusterRedis(3).start()
    app, fresh, sub = connect(cluster.url), None, None
    try:
        channel, other = KEYS.engine_presence("0", "abc"), KEYS.engine_presence("0", "def")
        sub = Subscriber(cluster.url, channel, "test")
        for name in (channel, other):
            sub.subscribe(name)
            assert wait_for(lambda: sub.get_message(0.2), 5, "the subscription")["type"] == "subscribe"
        sub.unsubscribe(other)
        assert wait_for(lambda: sub.get_message(0.2), 5, "the unsubscription")["type"] == "unsubscribe"
        seen: dict[str, str] = {}
        assert subscriber_counts(app, [channel], seen) == [1]
        source = app.get_node_from_key(channel)
        target = next(n for n in cluster.nodes.values() if n.port != source.port)
        admin = {port: redis.Redis(*node.address, username="admin", password=cluster.passwords["admin"])
                 for port, node in ((n.port, n) for n in cluster.nodes.values())}
        target_id = admin[target.port].execute_command("CLUSTER", "MYID")
        admin[source.port].execute_command("CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", app.keyslot(channel),
                                           app.keyslot(channel), "NODE", target_id)
        with pytest.raises(RedisConnectionError, match="slot moved"):
            wait_for(lambda: sub.get_message(0.2), 10, "the subscription to drop")
        with pytest.raises(ChannelMoved):  # app's map still names the source, where the count is 0 now
            subscriber_counts(app, [channel])
        sub.close()
        sub = Subscriber(cluster.url, channel, "test")  # subscribing again finds the new node
        sub.subscribe(channel)
        assert wait_for(lambda: sub.get_message(0.2), 5, "the new subscription")["type"] == "subscribe"
        fresh = connect(cluster.url)
        assert fresh.get_node_from_key(channel).port == target.port
        with pytest.raises(ChannelMoved):  # counted on the target now; the last count was the source's
            subscriber_counts(fresh, [channel], seen)
        assert subscriber_counts(fresh, [channel], seen) == [1]
        for client in admin.values():
            client.close()
    finally:
        for client in (app, fresh, sub):
            if client is not None:
                client.close()
        cluster.stop()


def test_a_subscriber_on_a_replica_is_heard_and_counted() -> None:
    """Without a stack: a shard's replica accepts SSUBSCRIBE and relays its primary's SPUBLISH (which counts only
    the primary's own subscribers, here 0), and `subscriber_counts` finds that subscriber."""
    cluster = ClusterRedis(3, 1).start()
    app = connect(cluster.url)
    try:
        channel = KEYS.output_channel("on-a-replica")
        primary = app.get_node_from_key(channel)
        name = next(n for n, node in cluster.nodes.items() if node.port == primary.port)
        replica = next(r for r, p in cluster.primary_of.items() if p == name)
        with redis.Redis(*cluster.nodes[replica].address, username="redserve",
                         password=cluster.passwords["redserve"]) as on_replica:
            sub = on_replica.pubsub()
            sub.ssubscribe(channel)
            assert sub.get_message(timeout=2)["type"] == "ssubscribe"
            assert app.spublish(channel, b"hello") == 0  # the primary has no subscriber of its own
            assert sub.get_message(timeout=2)["data"] == b"hello"  # the replica relayed it
            assert subscriber_counts(app, [channel]) == [1]
            sub.close()
    finally:
        app.close()
        cluster.stop()
