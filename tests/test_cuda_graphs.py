"""Decode under CUDA graphs (worker/cuda_graphs.py).

On the CPU the graph runner's backend is the eager stand-in (``EagerGraph``: "replay" calls the captured
function again), so bucketing, padding and the static buffers run through the same code a GPU runs, the
Triton kernels under the interpreter (``REDSERVE_TRITON_ATTENTION=1``; tests/triton_interpret.py). The capture itself, in bfloat16, is checked on CUDA only.
"""

from __future__ import annotations

import logging

import pytest
import torch
from triton_interpret import load

kernels, DEVICE, INTERPRETED = load("triton_attention")

from protocol.sampling_params import SamplingParams  # noqa: E402
from protocol.step_types import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from worker import cuda_graphs  # noqa: E402
from worker.config import EngineConfig  # noqa: E402
from worker.cuda_graphs import CudaGraph, EagerGraph, capture_sizes, graphs_off_reason  # noqa: E402
from worker.layers.attention import UnifiedBatch  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="the eager stand-in runs on the CPU")

BLOCK = 16


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def tp1():
    from worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(0, 1, "", DEVICE)
    yield
    destroy_tensor_parallel()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from worker.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("graphs") / "tiny-llama", arch="llama", seed=3,
                               hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                               vocab_size=512, max_position_embeddings=2048))


# --- buckets and the switch ------------------------------------------------------------------------------


def test_capture_sizes() -> None:
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(5) == [1, 2, 4, 8]  # the last bucket holds max_num_seqs
    assert capture_sizes(1) == [1]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(4096)[-1] == cuda_graphs.MAX_CAPTURE_SIZE


def test_bucket_choice() -> None:
    runner = cuda_graphs.GraphRunner(lambda *a: None, sizes=[1, 2, 4, 8], max_blocks=2, block_size=BLOCK,
                                     hidden_size=8, dtype=torch.float32, device=torch.device("cpu"), max_seq_len=32,
                                     num_splits=lambda size: 1, backend=EagerGraph)
    assert [runner.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_when_graphs_are_off() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on = {"enforce_eager": False, "use_triton": True, "pipeline_parallel_size": 1}
    assert graphs_off_reason(device=cuda, **on) is None
    assert graphs_off_reason(device=cpu, **on) == "not a CUDA device"
    assert graphs_off_reason(device=cuda, **{**on, "enforce_eager": True}) == "--enforce-eager"
    assert graphs_off_reason(device=cuda, **{**on, "use_triton": False}) is not None
    assert graphs_off_reason(device=cuda, **{**on, "pipeline_parallel_size": 2}) is not None


def test_enforce_eager_flag_reaches_the_engine_config(tiny_llama, monkeypatch) -> None:
    from redserve.cli import build_parser, engine_config_from_args
    from redserve.stack import _ENGINE_SWITCHES, _flags

    monkeypatch.delenv("REDSERVE_ENFORCE_EAGER", raising=False)
    parser = build_parser()
    for command in ("engine", "serve"):
        assert not parser.parse_args([command, "--model", tiny_llama]).enforce_eager
        args = parser.parse_args([command, "--model", tiny_llama, "--enforce-eager", "--device", "cpu"])
        assert args.enforce_eager
    assert engine_config_from_args(args).enforce_eager
    assert "--enforce-eager" in _flags(args, [], _ENGINE_SWITCHES)  # serve passes it to its engines
    assert not EngineConfig(model=tiny_llama, device="cpu").enforce_eager
    monkeypatch.setenv("REDSERVE_ENFORCE_EAGER", "1")
    assert build_parser().parse_args(["engine", "--model", tiny_llama]).enforce_eager


# --- split-KV with a fixed split count ---------------------------------------------------------------------


def _decode_batch(seq_lens: list[int], *, kv_heads=2, group=2, dim=32, seed=0):
    """Decode rows (one query each) over random, shuffled blocks; returns q, cache, batch, tables."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    tables, at = [], 0
    for size in needed:
        tables.append(order[at:at + size])
        at += size
    width = max(needed)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, blocks in enumerate(tables):
        table[i, :len(blocks)] = torch.tensor(blocks)
    cache = torch.randn(2, len(order) * BLOCK, kv_heads, dim, generator=gen).to(DEVICE)
    q = (torch.randn(len(seq_lens), kv_heads * group, dim, generator=gen) * 2).to(DEVICE)
    batch = UnifiedBatch(BLOCK, table.to(DEVICE), torch.arange(len(seq_lens) + 1, dtype=torch.int32).to(DEVICE),
                         torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE), len(seq_lens), 1, max(seq_lens))
    return q, cache, batch, tables


def _reference(q, cache, seq_lens, tables, group, window=None) -> torch.Tensor:
    q, cache = q.cpu().double(), cache.cpu().double()
    out = torch.zeros_like(q)
    for i, n in enumerate(seq_lens):
        slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        keys, values = cache[0, slots], cache[1, slots]
        visible = torch.ones(n, dtype=torch.bool) if window is None else torch.arange(n) > n - 1 - window
        for h in range(q.shape[1]):
            scores = (keys[:, h // group] @ q[i, h]) * q.shape[2] ** -0.5
            out[i, h] = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0) @ values[:, h // group]
    return out


@pytest.mark.parametrize("window", [None, 8])
def test_a_fixed_split_count_is_right_for_short_contexts(window) -> None:
    """Under a graph the split count is fixed for max_model_len: at 16 splits most of these rows' splits
    get no key tile (lse = -inf), and the combine must weigh them 0, never NaN."""
    seq_lens = [1, 5, 32, 33, 70, 200]
    q, cache, batch, tables = _decode_batch(seq_lens)
    batch.num_splits = 16  # as GraphRunner sets it; unified_attention takes it when given none
    out = kernels.unified_attention(q, cache[0], cache[1], torch.empty_like(q), batch, scale=q.shape[2] ** -0.5,
                                    sliding_window=window)
    lse = batch.split_buffers[1]
    assert lse.shape[2] == 16
    assert torch.isinf(lse[0, :, 1:]).all() and (lse[0, :, 1:] < 0).all()  # the 1-key row: 15 empty splits
    assert torch.isfinite(lse[:, :, 0]).all()  # split 0 always has keys
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), _reference(q, cache, seq_lens, tables, 2, window),
                               atol=2e-4, rtol=2e-4)
    single = kernels.unified_attention(q, cache[0], cache[1], torch.empty_like(q), batch, num_splits=1,
                                       scale=q.shape[2] ** -0.5, sliding_window=window)
    torch.testing.assert_close(out, single, atol=2e-4, rtol=2e-4)


# --- the model through the graph runner ---------------------------------------------------------------------


class Driver:
    """Feeds one model runner a fixed schedule: prompts, then decodes with the token each step "sampled"
    (fixed here, so two runners see the same sequences). Blocks start at 1: block 0 stays untouched by
    real requests, so a padding row that wrote slot 0 would show."""

    def __init__(self, runner):
        self.runner = runner
        self.next_block = 1
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def _grow(self, req_id: str, length: int) -> list[int]:
        new = []
        while len(self.blocks.setdefault(req_id, [])) * BLOCK < length:
            self.blocks[req_id].append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def schedule(self, prompts: dict[str, list[int]], decodes: list[str]) -> SchedulerOutput:
        sched = SchedulerOutput()
        for req_id in decodes:
            new = self._grow(req_id, self.computed[req_id] + 1)
            sched.cached_requests.append(CachedRequestData(req_id, new, self.computed[req_id]))
            sched.num_scheduled_tokens[req_id] = 1
        for req_id, prompt in prompts.items():
            blocks = self._grow(req_id, len(prompt))
            sched.new_requests.append(NewRequestData(req_id, list(prompt), [], SamplingParams(temperature=0.0), blocks, 0))
            sched.num_scheduled_tokens[req_id] = len(prompt)
        return sched

    def step(self, prompts: dict[str, list[int]], decodes: list[str]) -> torch.Tensor:
        """The step's logits (rows of the requests it samples), computed as ``execute_model`` does."""
        sched = self.schedule(prompts, decodes)
        runner = self.runner
        runner.input_batch.update(sched)
        inputs = runner.input_batch.prepare(sched)
        with torch.inference_mode():
            logits = runner.model.compute_logits(runner._forward(inputs)[inputs.logits_indices]).clone()
        for req_id, n in sched.num_scheduled_tokens.items():
            self.computed[req_id] = self.computed.get(req_id, 0) + n
            state = runner.input_batch.requests[req_id]
            state.token_ids.append((7 * len(state.token_ids) + len(req_id)) % 500 + 1)
        return logits


PROMPTS = {f"r{i}": [(11 * i + 5 * j) % 400 + 3 for j in range(length)] for i, length in
           enumerate([5, 17, 9, 30, 3, 16])}

# (new prompts, decodes): every step after the first prefill
SCHEDULE = [
    ({k: PROMPTS[k] for k in ("r0", "r1", "r2", "r3", "r4")}, []),  # prefill: eager
    ({}, ["r0", "r1", "r2", "r3", "r4"]),  # 5 decodes: bucket 8
    ({}, ["r0", "r1", "r2", "r3", "r4"]),
    ({}, ["r0", "r1", "r2"]),  # the batch shrinks: rows 3.. back to padding
    ({"r5": PROMPTS["r5"]}, ["r3"]),  # mixed: eager
    ({}, ["r5"]),  # bucket 1
    ({}, ["r0", "r1", "r2", "r3", "r4", "r5"]),
]


def make_runner(model: str, **kw):
    from worker.model_runner import ModelRunner

    config = EngineConfig(model=model, dtype=kw.pop("dtype", "float32"), device=DEVICE.type,
                          max_model_len=kw.pop("max_model_len", 256), max_num_seqs=8, **kw)
    runner = ModelRunner(config)
    assert runner.input_batch.use_triton
    return runner


def random_cache(runner, blocks: int = 24) -> None:
    runner.init_kv_cache(blocks)
    gen = torch.Generator().manual_seed(1)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))


class ReplayCounter:
    def __init__(self, monkeypatch):
        self.count = 0
        original = EagerGraph.replay

        def counted(graph):
            self.count += 1
            original(graph)

        monkeypatch.setattr(EagerGraph, "replay", counted)


@interpreted_only
@pytest.mark.parametrize("splits", [None, 4])
def test_decode_through_the_graph_runner_matches_eager(tp1, tiny_llama, monkeypatch, splits) -> None:
    """Same logits as the eager Triton path step by step; only decode-only steps replay; padding rows never
    write the KV cache (block 0 keeps its random contents) and rows past a shrunk batch become padding.
    ``splits`` 4 fixes the graphs' split count as a long max_model_len would."""
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    eager, graphed = make_runner(tiny_llama), make_runner(tiny_llama)
    random_cache(eager)
    random_cache(graphed)
    assert graphed.graph_runner is None  # a CPU never captures by itself
    if splits is not None:
        monkeypatch.setattr(kernels, "choose_num_splits", lambda *a, **k: splits)
    before = [cache.clone() for cache in graphed.kv_caches]
    counter = ReplayCounter(monkeypatch)
    runner = graphed.capture_graphs(backend=EagerGraph)
    assert runner.sizes == [1, 2, 4, 8]
    assert all(runner.metas[size].unified.num_splits == (splits or 1) for size in runner.sizes)
    for cache, old in zip(graphed.kv_caches, before, strict=True):
        assert torch.equal(cache, old)  # capture (all rows padding) wrote nothing
    counter.count = 0

    expected_replays = [0, 1, 1, 1, 0, 1, 1]
    d_eager, d_graphed = Driver(eager), Driver(graphed)
    for (prompts, decodes), replays in zip(SCHEDULE, expected_replays, strict=True):
        old = [cache.clone() for cache in graphed.kv_caches]
        counted = counter.count
        want = d_eager.step(prompts, decodes)
        got = d_graphed.step(prompts, decodes)
        assert counter.count - counted == replays, (prompts.keys(), decodes)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if replays:
            rows = len(decodes)
            assert runner.slot_mapping[rows:].eq(-1).all() and runner.seq_lens[rows:].eq(1).all()
            written = torch.zeros(graphed.kv_caches[0].shape[1], dtype=torch.bool)
            for cache, prior in zip(graphed.kv_caches, old, strict=True):
                written |= (cache != prior).flatten(2).any(-1).any(0)
            expected = set(runner.slot_mapping[:rows].tolist())
            assert set(torch.nonzero(written).flatten().tolist()) <= expected  # no padding row wrote
        for cache, first in zip(graphed.kv_caches, before, strict=True):
            assert torch.equal(cache[:, :BLOCK], first[:, :BLOCK])  # block 0: no request's, no padding row's


@interpreted_only
def test_static_buffers_are_reused_and_big_batches_stay_eager(tp1, tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    eager, graphed = make_runner(tiny_llama), make_runner(tiny_llama)
    random_cache(eager)
    random_cache(graphed)
    runner = graphed.capture_graphs(backend=EagerGraph, sizes=[1, 2])
    counter = ReplayCounter(monkeypatch)
    buffers = {name: getattr(runner, name).data_ptr() for name in
               ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc", "seq_lens", "hidden")}
    meta = runner.metas[2]
    d_eager, d_graphed = Driver(eager), Driver(graphed)
    prompts = {k: PROMPTS[k] for k in ("r0", "r1", "r2")}
    for driver in (d_eager, d_graphed):
        driver.step(prompts, [])
    outputs = []
    original_run = runner.run

    def run(inputs):
        hidden = original_run(inputs)
        outputs.append(hidden.data_ptr())
        return hidden

    monkeypatch.setattr(runner, "run", run)
    for decodes, replays in ((["r0", "r1"], 1), (["r1", "r2"], 1), (["r0", "r1", "r2"], 0)):  # 3 > biggest bucket
        counted = counter.count
        torch.testing.assert_close(d_graphed.step({}, decodes), d_eager.step({}, decodes), atol=1e-4, rtol=1e-4)
        assert counter.count - counted == replays
    assert outputs == [buffers["hidden"]] * 2  # the step's hidden is the static output
    assert buffers == {name: getattr(runner, name).data_ptr() for name in buffers}
    assert runner.metas[2] is meta and meta.unified.block_tables.data_ptr() == buffers["block_tables"]
    assert meta.slot_mapping.data_ptr() == buffers["slot_mapping"]


@interpreted_only
def test_execute_model_samples_the_same_tokens(tp1, tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    eager, graphed = make_runner(tiny_llama), make_runner(tiny_llama)
    eager.init_kv_cache(24)
    graphed.init_kv_cache(24)
    graphed.capture_graphs(backend=EagerGraph)
    counter = ReplayCounter(monkeypatch)
    results = []
    for runner in (eager, graphed):
        driver, tokens = Driver(runner), []
        prompts = {k: PROMPTS[k] for k in ("r0", "r1", "r2")}
        for step in range(5):
            sched = driver.schedule(prompts if step == 0 else {}, [] if step == 0 else list(prompts))
            out = runner.execute_model(sched)
            tokens.append({r: t.token_id for r, t in out.sampled.items()})
            for req_id, n in sched.num_scheduled_tokens.items():
                driver.computed[req_id] = driver.computed.get(req_id, 0) + n
        results.append(tokens)
    assert counter.count == 4
    assert results[0] == results[1]


@interpreted_only
def test_cpu_init_never_captures_and_logs_nothing_about_it(tp1, tiny_llama, monkeypatch, caplog) -> None:
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    runner = make_runner(tiny_llama)
    caplog.clear()  # the model's path (a tmp dir named graphs*) is in the load line
    with caplog.at_level(logging.INFO):
        runner.init_kv_cache(24)
    assert runner.graph_runner is None
    assert not [r.message for r in caplog.records if "graph" in r.getMessage().lower()]


# --- on a real GPU ---------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("max_model_len", [256, 2048])
def test_capture_and_replay_match_eager_in_bfloat16(tp1, tiny_llama, caplog, monkeypatch, max_model_len) -> None:
    """At 2048 the small buckets' graphs run 16 splits (as a long context would) over these short
    contexts, where eager runs one."""
    blocks = max_model_len // BLOCK + 8
    with caplog.at_level(logging.INFO, logger="worker.cuda_graphs"):
        graphed = make_runner(tiny_llama, dtype="bfloat16", max_model_len=max_model_len)
        random_cache(graphed, blocks)
    eager = make_runner(tiny_llama, dtype="bfloat16", enforce_eager=True, max_model_len=max_model_len)
    random_cache(eager, blocks)
    assert eager.graph_runner is None
    runner = graphed.graph_runner
    assert runner is not None and runner.sizes == [1, 2, 4, 8]
    assert all(isinstance(g, CudaGraph) for g in runner.graphs.values())
    assert "captured 4 CUDA graphs" in caplog.text and "MiB of device memory" in caplog.text
    for size in runner.sizes:
        assert runner.metas[size].unified.num_splits == kernels.choose_num_splits(
            size * graphed.num_kv_heads, max_model_len, DEVICE)
    if max_model_len == 2048:
        assert runner.metas[1].unified.num_splits > 1
    replays = 0
    original = CudaGraph.replay

    def counted(graph):
        nonlocal replays
        replays += 1
        original(graph)

    monkeypatch.setattr(CudaGraph, "replay", counted)
    d_eager, d_graphed = Driver(eager), Driver(graphed)
    for prompts, decodes in SCHEDULE:
        want, got = d_eager.step(prompts, decodes), d_graphed.step(prompts, decodes)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    assert replays == 5
