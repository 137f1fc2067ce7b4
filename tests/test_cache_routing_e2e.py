"""Cache-aware routing through real processes: a coordinator, two tiny-model engines publishing their prefix
caches to a real Redis, and `BrokerClient` placing requests (the API's path). In order: a conversation sticks to
the engine that served its first turn, a second one sharing only the system prompt, an engine killed and
restarted (its index is dropped, routing falls back to load), a flood on one cached prefix spills over."""

from __future__ import annotations

import time
import uuid

import pytest
from stack_procs import Procs, poll, quiet_cli

from broker.client import BrokerClient
from broker.connection import connect
from broker.keys import RedisKeys
from broker.load_balance import RoutingConfig
from broker.prefix_index import read_routing_counts
from broker.registry import EngineRegistry
from protocol.messages import AddRequest
from protocol.prefix_hash import block_hashes
from protocol.sampling_params import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(32 << 20), "--max-num-seqs", "2",
                "--heartbeat-ttl", "2"]
BS = 16
SYSTEM = [(7 * i) % 1000 + 3 for i in range(3 * BS)]  # a 3-block "system prompt"


class Stack:
    def __init__(self, url: str, keys: RedisKeys, model: str, procs: Procs) -> None:
        self.url, self.keys, self.model, self.procs = url, keys, model, procs
        self.redis = connect(url)
        self.registry = EngineRegistry(self.redis, keys)
        self.engines: dict[str, object] = {}
        procs.start("coordinator", quiet_cli("coordinator", "--redis-url", url, "--key-prefix", keys.prefix))
        self.client = BrokerClient(url, keys=keys)
        self.client.start()
        self.client.selector.routing = RoutingConfig(policy="cache")
        self._ids = (f"r{i}" for i in range(1_000_000))

    def start_engine(self, rank: str) -> None:
        self.engines[rank] = self.procs.start(f"engine-{rank}", quiet_cli(
            "engine", "--model", self.model, "--redis-url", self.url, "--key-prefix", self.keys.prefix,
            "--dp-rank", rank, *ENGINE_FLAGS))

    def wait_ready(self, *ids: str) -> None:
        def ready():
            for e in ids:
                assert self.engines[e].poll() is None, f"engine {e} exited"
            live = {i["engine_id"]: i for i in self.client.selector.refresh().values() if i.get("state") == "ready"}
            return all(e in live and "stats_at" in live[e] for e in ids)
        poll(ready, 180, f"engines {ids} to be ready")

    def run(self, prompt: list[int], max_tokens: int = 8) -> tuple[str, list[int]]:
        """Send one request through the selector; wait for it; return (engine, generated tokens)."""
        handle = self.submit(prompt, max_tokens)
        tokens = []
        for out in handle:
            assert out.error_code is None, out.error_text()
            tokens += out.new_token_ids
        return handle.engine_id, tokens

    def submit(self, prompt: list[int], max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        add = AddRequest(next(self._ids), "", prompt, params, time.time(), time.time() + 120)
        return self.client.submit(add)

    def held(self, engine_id: str, prompt: list[int]) -> int:
        """Leading full blocks of `prompt` in the engine's index (as the router sees it)."""
        hashes = block_hashes(prompt, BS)
        flags = self.redis.smismember(self.keys.engine_blocks(engine_id), hashes) if hashes else []
        return next((i for i, f in enumerate(flags) if not f), len(flags))

    def stat(self, engine_id: str, name: str) -> int:
        return int(float(self.redis.hget(self.keys.engine(engine_id), name) or 0))


@pytest.fixture(scope="module")
def stack(redis_server, tiny_llama_dir, tmp_path_factory):
    procs = Procs(tmp_path_factory.mktemp("cache-routing-logs"))
    s = None
    try:
        s = Stack(redis_server.url, RedisKeys(f"cr{uuid.uuid4().hex[:8]}"), tiny_llama_dir, procs)
        s.start_engine("0")
        s.start_engine("1")
        s.wait_ready("0", "1")
        yield s
    finally:
        if s is not None:
            s.client.stop()
        procs.close()


def _conversation(stack: Stack, user: list[int], turns: int) -> tuple[list[str], list[int]]:
    history, placed = list(SYSTEM), []
    for turn in range(turns):
        history += [u + turn for u in user]
        engine, reply = stack.run(history)
        placed.append(engine)
        history += reply
    return placed, history


def test_a_conversation_stays_on_the_engine_that_served_its_first_turn(stack):
    before = {e: stack.stat(e, "prefix_cache_hits") for e in ("0", "1")}
    placed, history = _conversation(stack, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], turns=4)
    assert len(set(placed)) == 1, placed
    first = placed[0]
    assert stack.held(first, history) >= len(history) // BS - 1
    assert stack.held("1" if first == "0" else "0", history) == 0
    hits = poll(lambda: stack.stat(first, "prefix_cache_hits") - before[first] >= 3 * len(SYSTEM)
                and stack.stat(first, "prefix_cache_hits") - before[first], 10, "the engine's hit counter")
    assert hits >= 3 * len(SYSTEM)  # turns 2..4 each reused at least the system prompt
    assert stack.client.selector.decisions["cache"] >= 3
    counts = read_routing_counts(stack.redis, stack.keys)
    assert counts.get(first, {}).get("cache", 0) >= 3, counts
    stack.first_engine = first


def test_a_second_conversation_sharing_only_the_system_prompt(stack):
    first = stack.first_engine
    other = "1" if first == "0" else "0"
    engine, _ = stack.run(SYSTEM + [900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913, 914, 915, 916])
    assert engine == first  # it holds the 3 system-prompt blocks, the other engine nothing
    hits = stack.client.selector.prefix_hits(SYSTEM + [1, 2, 3] * 20)
    assert hits[first] > 0 and hits[other] == 0


def test_an_engine_restart_drops_its_index_and_routing_falls_back_to_load(stack):
    first = getattr(stack, "first_engine", None) or stack.run(SYSTEM + [11, 12], max_tokens=2)[0]
    assert stack.redis.scard(stack.keys.engine_blocks(first)) > 0
    stack.procs.kill(stack.engines[first])
    poll(lambda: not stack.redis.exists(stack.keys.engine_blocks(first)), 30,
         "the coordinator to drop the dead engine's index")
    stack.start_engine(first)
    stack.wait_ready(first)
    assert stack.redis.scard(stack.keys.engine_blocks(first)) == 0
    before = dict(stack.client.selector.decisions)
    hits = stack.client.selector.prefix_hits(SYSTEM + [11, 12, 13])
    assert not any(hits.values()), hits
    stack.run(SYSTEM + [11, 12, 13], max_tokens=2)
    assert stack.client.selector.decisions["load"] == before["load"] + 1


def test_a_flood_on_one_cached_prefix_spills_to_the_other_engine(stack):
    prompt = [(13 * i) % 1000 + 1 for i in range(8 * BS + 3)]
    owner, _ = stack.run(prompt, max_tokens=2)
    other = "1" if owner == "0" else "0"
    poll(lambda: stack.held(owner, prompt) == 8, 10, "the prompt's blocks in the owner's index")
    handles = [stack.submit(prompt + [i + 1], max_tokens=24) for i in range(12)]
    placed = [h.engine_id for h in handles]
    for h in handles:
        for out in h:
            assert out.error_code is None, out.error_text()
    assert placed[:2] == [owner, owner], placed
    assert placed.count(other) >= 3, placed  # spilled instead of queueing everything behind the owner
    assert placed.count(owner) > placed.count(other), placed
