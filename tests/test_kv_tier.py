"""The KV tier (issue 30): engines store full prefix blocks in a Valkey of their own and a fresh engine loads a
missing prefix from it, with the tokens of recomputing it.

In-process engines (``engine.LLM``) over a real Valkey started with ``maxmemory`` and ``allkeys-lru``; the
whole stack (``redserve serve --kv-tier-memory``, an engine killed and restarted, HTTP) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import requests
import torch
from engine_helpers import greedy, make_llm, random_prompt
from stack_procs import Procs, cli, free_port, title, wait_for

from broker.kv_tier_store import KVTierStore
from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from protocol.kv_blocks import CorruptBlock, decode_block, encode_block
from protocol.prefix_hash import block_hashes
from protocol.sampling_params import SamplingParams
from redserve.proc_tree import children
from redserve.redis_server import EmbeddedRedis
from worker import kv_block_copy

PROMPT = random_prompt(300, seed=30)  # 18 full blocks before the last token's block
FULL_BLOCKS = (len(PROMPT) - 1) // 16


@pytest.fixture(scope="module")
def tier_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(maxmemory="128mb", maxmemory_policy="allkeys-lru", title="redserve-kv-tier") as server:
        yield server


@pytest.fixture
def tier_admin(tier_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """An admin client of the tier (KEYS, FLUSHALL), emptied around the test."""
    admin = redis.Redis.from_url(tier_server.admin_url)
    admin.flushall()
    yield admin
    admin.flushall()
    admin.close()


@pytest.fixture
def tier(tier_server: EmbeddedRedis, tier_admin: redis.Redis) -> str:
    return tier_server.url


def run(model_dir: str, tier_url: str | None, prompt: list[int] = PROMPT, **kwargs) -> tuple[list[int], dict, int]:
    """Greedy tokens of ``prompt`` on a fresh engine, its tier counters, its cached prompt tokens."""
    llm = make_llm(model_dir, kv_tier_url=tier_url, **kwargs)
    try:
        out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
        if llm.engine.kv_tier is not None:
            llm.engine.kv_tier.close()  # waits for the blocks being written
        stats = llm.engine.kv_tier.stats() if llm.engine.kv_tier is not None else {}
        return out.outputs[0].token_ids, stats, out.num_cached_tokens
    finally:
        llm.engine.shutdown()


# --- the block format, the copies, the scheduler -------------------------------------------------------------


def test_block_format_round_trip_and_every_damage_is_refused() -> None:
    tokens = list(range(16))
    value = encode_block(tokens, [b"\x01" * 100, b"\x02" * 60])
    assert [bytes(p) for p in decode_block(value, tokens)] == [b"\x01" * 100, b"\x02" * 60]
    damaged = bytearray(value)
    damaged[-1] ^= 0xFF
    for bad, why in [(bytes(damaged), "checksum"), (value[:-5], "checksum"), (b"XXXX" + value[4:], "format"),
                     (value[:8], "shorter")]:
        with pytest.raises(CorruptBlock, match=why):
            decode_block(bad, tokens)
    with pytest.raises(CorruptBlock, match="other tokens"):
        decode_block(value, [*tokens[:-1], 99])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_copy_moves_whole_blocks_between_caches(dtype: torch.dtype) -> None:
    block_size, blocks = 16, 6
    source = [torch.randn(2, blocks * block_size, 2, 8).to(dtype) for _ in range(3)]
    target = [torch.zeros_like(kv) for kv in source]
    pieces = kv_block_copy.start_read(source, [4, 1], block_size).pieces()
    assert [len(p) for p in pieces] == [kv_block_copy.piece_bytes(source, block_size)] * 2
    kv_block_copy.write(target, [0, 5], block_size, pieces)
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[:, 0:16], src[:, 64:80]) and torch.equal(dst[:, 80:96], src[:, 16:32])
        assert not dst[:, 16:80].any()
    with pytest.raises(ValueError, match="pieces of"):
        kv_block_copy.write(target, [0], block_size, [b"\x00" * 7])


def test_scheduler_passes_over_a_request_waiting_for_kv_and_admits_it_once_loaded() -> None:
    bm = BlockManager(64, 16)
    scheduler = Scheduler(SchedulerConfig(8, 512, 1024), bm, eos_token_ids=[])
    first, second = (Request(rid, list(range(40)), SamplingParams(max_tokens=4)) for rid in ("a", "b"))
    for request in (first, second):
        scheduler.add_request(request)
    first.status = RequestStatus.WAITING_FOR_KV
    assert list(scheduler.schedule().num_scheduled_tokens) == ["b"]
    ids = bm.adopt_blocks([(h, tuple(range(16 * i, 16 * i + 16))) for i, h in enumerate(block_hashes(list(range(40)), 16))])
    first.status = RequestStatus.WAITING
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 40 - 32}  # both adopted blocks were prefix-cache hits
    assert first.block_ids[:2] == ids


# --- engines over a real Valkey ------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_fresh_engine_loads_the_prefix_another_engine_computed(tiny_llama_dir: str, tier: str,
                                                                  tier_admin: redis.Redis,
                                                                  async_scheduling: bool) -> None:
    reference, _, _ = run(tiny_llama_dir, None)
    first, stored, cached = run(tiny_llama_dir, tier, async_scheduling=async_scheduling)
    assert first == reference and cached == 0
    assert stored["stored_blocks"] >= FULL_BLOCKS and stored["hit_blocks"] == 0
    second, loaded, cached = run(tiny_llama_dir, tier, async_scheduling=async_scheduling)
    assert second == reference
    assert loaded["hit_blocks"] == FULL_BLOCKS and cached == FULL_BLOCKS * 16
    assert loaded["corrupt_blocks"] == 0 and loaded["errors"] == 0
    per_value, overhead = stored["bytes_out"] // stored["stored_blocks"], len(encode_block(range(16), [b""]))
    assert loaded["bytes_in"] == FULL_BLOCKS * (per_value - overhead)  # every piece's bytes, no header's
    (meta,) = tier_admin.keys("rskv:*:meta")
    assert json.loads(tier_admin.get(meta))["num_layers"] > 0


def test_a_longer_prompt_loads_the_shared_part_and_computes_the_rest(tiny_llama_dir: str, tier: str) -> None:
    longer = PROMPT + random_prompt(50, seed=31)
    reference, _, _ = run(tiny_llama_dir, None, longer)
    run(tiny_llama_dir, tier)
    tokens, loaded, cached = run(tiny_llama_dir, tier, longer)
    assert tokens == reference
    assert loaded["hit_blocks"] == FULL_BLOCKS and loaded["miss_blocks"] == (len(longer) - 1) // 16 - FULL_BLOCKS


def test_a_mismatched_model_never_reads_the_tier(tiny_llama_dir: str, tiny_qwen2_dir: str, tier: str,
                                                 tier_admin: redis.Redis) -> None:
    run(tiny_llama_dir, tier)
    reference, _, _ = run(tiny_qwen2_dir, None)
    tokens, loaded, _ = run(tiny_qwen2_dir, tier)
    assert tokens == reference and loaded["hit_blocks"] == 0 and loaded["miss_blocks"] == FULL_BLOCKS
    _, other_dtype, _ = run(tiny_llama_dir, tier, dtype="bfloat16")
    assert other_dtype["hit_blocks"] == 0  # a bf16 engine's blocks are other bytes: another namespace
    assert len(tier_admin.keys("rskv:*:meta")) == 3


def test_a_corrupted_block_ends_the_run_and_the_rest_is_recomputed(tiny_llama_dir: str, tier: str,
                                                                   tier_admin: redis.Redis) -> None:
    reference, _, _ = run(tiny_llama_dir, None)
    run(tiny_llama_dir, tier)
    client = tier_admin
    (meta,) = client.keys("rskv:*:meta")
    namespace = meta.decode().split(":")[1]
    fifth = KVTierStore(tier, namespace).key(block_hashes(PROMPT, 16)[4])
    value = bytearray(client.get(fifth))
    value[len(value) // 2] ^= 0x40
    client.set(fifth, bytes(value))
    tokens, loaded, cached = run(tiny_llama_dir, tier)
    assert tokens == reference
    assert loaded["corrupt_blocks"] == 1 and loaded["hit_blocks"] == 4 and cached == 4 * 16


def test_a_dead_tier_means_recompute_never_a_failed_request(tiny_llama_dir: str) -> None:
    reference, _, _ = run(tiny_llama_dir, None)
    tokens, stats, cached = run(tiny_llama_dir, f"redis://127.0.0.1:{free_port()}/0")
    assert tokens == reference and cached == 0
    assert stats["errors"] >= 1 and stats["hit_blocks"] == 0


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from worker.models import tiny_model
    root = tmp_path_factory.mktemp("tier-archs")
    sizes = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=1024,
                 max_position_embeddings=256, sliding_window=20)  # a prompt past several windows
    return {arch: str(tiny_model.make_tiny_model(root / arch, arch=arch, **sizes)) for arch in tiny_model.ARCHS}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3"])
def test_every_architecture_continues_a_loaded_prefix_with_the_computed_tokens(arch_dirs: dict[str, str], tier: str,
                                                                               arch: str) -> None:
    prompt = random_prompt(150, seed=32)
    reference, _, _ = run(arch_dirs[arch], None, prompt)
    run(arch_dirs[arch], tier, prompt)
    tokens, loaded, _ = run(arch_dirs[arch], tier, prompt)
    assert loaded["hit_blocks"] == (len(prompt) - 1) // 16
    assert tokens == reference


# --- the whole stack -----------------------------------------------------------------------------------------


def test_serve_with_a_kv_tier_keeps_its_hits_across_an_engine_restart(tiny_llama_dir: str, tmp_path: Path) -> None:
    procs = Procs(tmp_path, env={"REDSERVE_STATE_DIR": str(tmp_path / "state")})
    port = free_port()
    serve = procs.start("serve", cli("serve", "--model", tiny_llama_dir, "--dtype", "float32", "--port", str(port),
                                     "--api-workers", "1", "--no-batch-worker", "--kv-tier-memory", "64mb"))
    base = f"http://127.0.0.1:{port}"
    model = Path(tiny_llama_dir).name

    def complete() -> dict | None:
        try:
            r = requests.post(f"{base}/v1/completions", timeout=30, json={
                "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        except requests.RequestException:
            return None
        return r.json() if r.status_code == 200 else None

    try:
        first = wait_for(complete, 120, "the stack to answer", watch=(serve,))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        tier_pid = wait_for(lambda: next((p for p in children(serve.pid) if title(p).startswith("redserve-kv-tier")),
                                         None), 10, "the KV tier process")
        stored = f'redserve:kv_tier_stored_blocks_total{{engine="0",model_name="{model}"}} {FULL_BLOCKS}.0'
        wait_for(lambda: stored in requests.get(f"{base}/metrics", timeout=10).text, 30,
                 "the prompt's blocks in the tier")  # stores are best effort: a kill before them loses them
        engine = next(p for p in children(serve.pid) if title(p).startswith("redserve-engine-0"))
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: any(title(p).startswith("redserve-engine-0") for p in children(serve.pid) if p != engine),
                 30, "the engine to be restarted")
        again = wait_for(complete, 120, "the restarted engine to answer", watch=(serve,))
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL_BLOCKS * 16  # from the tier
        hits = f'redserve:kv_tier_hit_tokens_total{{engine="0",model_name="{model}"}} {FULL_BLOCKS * 16}.0'
        wait_for(lambda: hits in requests.get(f"{base}/metrics", timeout=10).text, 20, "the engine's tier counters")
        assert title(tier_pid).startswith("redserve-kv-tier")
        status = subprocess.run(cli("status"), capture_output=True, text=True, timeout=60,
                                env={**os.environ, "REDSERVE_STATE_DIR": str(tmp_path / "state")})
        tier_rows = status.stdout.split("KV tier (README 'KV tier'):")[1].splitlines()
        assert tier_rows[2].split()[:3] == ["0", "1", str(FULL_BLOCKS)], status.stdout  # engine, lookups, hits
    finally:
        procs.close()


def test_tensor_parallel_engines_store_and_load_each_ranks_piece(tiny_llama_dir: str, tier: str) -> None:
    reference, _, _ = run(tiny_llama_dir, None)
    _, stored, _ = run(tiny_llama_dir, tier, tensor_parallel_size=2)
    tokens, loaded, cached = run(tiny_llama_dir, tier, tensor_parallel_size=2)
    assert stored["stored_blocks"] >= FULL_BLOCKS
    assert loaded["hit_blocks"] == FULL_BLOCKS and cached == FULL_BLOCKS * 16
    assert tokens == reference
    _, single, _ = run(tiny_llama_dir, tier)
    assert single["hit_blocks"] == 0  # TP = 1 engines hold whole blocks, TP = 2 ones two pieces: other namespaces
