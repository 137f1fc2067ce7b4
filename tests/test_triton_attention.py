"""The Triton attention kernels (worker/kernels/triton_attention.py) against float64 attention by hand.

On a machine without a GPU they run under the Triton interpreter, on CPU tensors (tests/triton_interpret.py
sets it up before triton's first import; the ``interpret`` fixture around each test); bfloat16, which the
interpreter cannot multiply, is checked only on CUDA. Each case builds a real step with ``InputBatch.prepare`` (decodes first, then
prefill chunks) over shuffled, non-contiguous blocks, as tests/test_paged_attention.py does. Shapes stay
small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpret import load

kernels, DEVICE, INTERPRETED = load("triton_attention")

from protocol.sampling_params import SamplingParams  # noqa: E402
from protocol.step_types import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from worker.input_batch import InputBatch  # noqa: E402
from worker.layers import attention  # noqa: E402
from worker.layers.attention import PagedAttention  # noqa: E402

requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 needs a CUDA device")
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="the CPU model run needs the interpreter "
                                      "(tests/test_cuda_path.py runs the model on CUDA)")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}

# (num_computed, num_scheduled): decodes at and around block edges, fresh chunks, chunks over a prefix
MIXED = [(0, 1), (15, 1), (16, 1), (17, 1), (47, 1), (0, 5), (16, 16), (31, 9), (5, 40)]


class Step:
    """One step over requests (num_computed, num_scheduled) on a random cache of shuffled blocks."""

    def __init__(self, specs, *, kv_heads: int = 2, group: int = 2, dim: int = 32, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.specs, self.block_size, self.kv_heads, self.group = specs, block_size, kv_heads, group
        needed = [-(-(c + n) // block_size) for c, n in specs]
        pool = list(range(sum(needed) + 3))
        rng.shuffle(pool)
        self.tables, at = [], 0
        for size in needed:
            self.tables.append(pool[at:at + size])
            at += size
        heads, total = kv_heads * group, sum(n for _, n in specs)
        self.cache = torch.randn(2, len(pool) * block_size, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        self.q = (torch.randn(total, heads, dim, generator=gen) * 2).to(dtype).to(DEVICE)
        self.k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        self.v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
        sched = SchedulerOutput()
        for i, ((c, n), blocks) in enumerate(zip(specs, self.tables, strict=True)):
            sched.new_requests.append(NewRequestData(f"r{i}", [7] * (c + n), [], SamplingParams(max_tokens=1), blocks, c))
            sched.num_scheduled_tokens[f"r{i}"] = n
        batch = InputBatch(block_size, DEVICE, group, [1], use_triton=True)
        batch.update(sched)
        self.meta = batch.prepare(sched).meta

    def attention(self, **kw) -> torch.Tensor:
        """Through ``PagedAttention`` (writes the step's K/V, then attends): [T, H, d]."""
        heads, dim = self.q.shape[1:]
        attn = PagedAttention(heads, self.kv_heads, dim, **kw)
        return attn(self.q, self.k, self.v, self.cache, self.meta).view(self.q.shape).clone()

    def kernel(self, *, num_splits: int, tile: int = kernels.TILE_N, window=None, softcap=None) -> torch.Tensor:
        """Straight to ``unified_attention`` (the step's K/V must be in the cache already)."""
        out = torch.empty_like(self.q)
        return kernels.unified_attention(self.q, self.cache[0], self.cache[1], out, self.meta.unified,
                                         scale=self.q.shape[2] ** -0.5, sliding_window=window, softcap=softcap,
                                         num_splits=num_splits, tile=tile)

    def reference(self, *, window=None, softcap=None) -> torch.Tensor:
        """Float64 attention per request and head, from the cache after the step wrote its K/V."""
        q, cache, bs, group = self.q.cpu().double(), self.cache.cpu().double(), self.block_size, self.group
        out = torch.zeros(q.shape, dtype=torch.float64)
        order = sorted(range(len(self.specs)), key=lambda i: self.specs[i][1] != 1)  # decodes first
        start = 0
        for i in order:
            c, n = self.specs[i]
            slots = torch.tensor([self.tables[i][p // bs] * bs + p % bs for p in range(c + n)])
            keys, values = cache[0, slots], cache[1, slots]
            positions = torch.arange(c + n)
            for j in range(n):
                visible = positions <= c + j
                if window is not None:
                    visible &= positions > c + j - window
                for h in range(q.shape[1]):
                    scores = keys[:, h // group] @ q[start + j, h] * q.shape[2] ** -0.5
                    if softcap is not None:
                        scores = softcap * torch.tanh(scores / softcap)
                    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                    out[start + j, h] = probs @ values[:, h // group]
            start += n
        return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=tol, rtol=tol)


def check(specs, *, window=None, softcap=None, **kw) -> None:
    step = Step(specs, **kw)
    out = step.attention(sliding_window=window, softcap=softcap)
    assert_close(out, step.reference(window=window, softcap=softcap), kw.get("dtype", torch.float32))


# --- the layout InputBatch builds ----------------------------------------------------------------------


def test_the_unified_layout_holds_every_request_and_nothing_of_the_torch_path() -> None:
    step = Step([(4, 1), (0, 6), (16, 6), (31, 1)], block_size=16)
    meta, unified = step.meta, step.meta.unified
    assert meta.paged is None and meta.num_decodes == 0 and meta.decode_slots is None and meta.prefills == []
    # decodes first (in request order), then the chunks
    assert unified.query_start_loc.tolist() == [0, 1, 2, 8, 14]
    assert unified.seq_lens.tolist() == [5, 32, 6, 22]
    assert unified.num_seqs == 4 and unified.max_query_len == 6 and unified.max_seq_len == 32
    assert all(t.dtype == torch.int32 and t.device.type == DEVICE.type
               for t in (unified.block_tables, unified.query_start_loc, unified.seq_lens))
    tables = [step.tables[i] for i in (0, 3, 1, 2)]
    for row, blocks in zip(unified.block_tables.tolist(), tables, strict=True):
        assert row[:len(blocks)] == blocks


def test_the_switch(monkeypatch) -> None:
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "0")
    assert not attention.use_triton(torch.device("cuda"))
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    assert attention.use_triton(torch.device("cpu"))
    assert InputBatch(16, torch.device("cpu"), 1, [1], use_kernel=False).use_triton
    monkeypatch.delenv("REDSERVE_TRITON_ATTENTION")
    assert not attention.use_triton(torch.device("cpu"))
    attention.triton_smoke_test.cache_clear()
    if DEVICE.type == "cuda":
        assert attention.use_triton(torch.device("cuda"))  # where the kernels build, CUDA takes them by default
    else:  # here no CUDA device can run them: the smoke test fails and leaves CUDA on the torch path
        assert not attention.use_triton(torch.device("cuda"))
    attention.triton_smoke_test.cache_clear()
    batch = InputBatch(16, torch.device("cpu"), 1, [1], use_kernel=False)
    assert not batch.use_triton


def test_the_smoke_test_runs_both_kernels_here() -> None:
    kernels.smoke_test(DEVICE)


def test_kernels_that_fail_their_smoke_test_leave_the_torch_path_serving(monkeypatch, caplog) -> None:
    def broken(device):
        raise RuntimeError("ptxas fatal: unsupported GPU architecture\nmore lines")

    monkeypatch.setattr(kernels, "smoke_test", broken)
    monkeypatch.delenv("REDSERVE_TRITON_ATTENTION", raising=False)
    attention.triton_smoke_test.cache_clear()
    try:
        assert not attention.use_triton(torch.device("cuda", 0))
        assert attention.triton_smoke_test("cuda:0") == "RuntimeError: ptxas fatal: unsupported GPU architecture"
    finally:
        attention.triton_smoke_test.cache_clear()
    assert [r.levelname for r in caplog.records if "smoke test" in r.message] == ["WARNING"]


# --- the K/V write ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_index_copy_and_skips_negative_slots(dtype: torch.dtype) -> None:
    kv_heads, dim, tokens = 3, 40, 23  # neither a power of two: the padded lanes are masked
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 6 + 2 * kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 6:6 + kv_heads], qkv[:, 6 + kv_heads:]  # views into the projection's output, as the model's
    slots = torch.randperm(100, generator=gen)[:tokens]
    slots[[3, 11]] = -1  # padding rows
    cache = torch.randn(2, 100, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    expected = cache.clone()
    keep = slots >= 0
    expected[0, slots[keep]] = k[keep.to(DEVICE)]
    expected[1, slots[keep]] = v[keep.to(DEVICE)]
    kernels.write_kv(k, v, cache[0], cache[1], slots.to(DEVICE))
    assert torch.equal(cache, expected)


# --- attention against the reference --------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gqa_ratios_mixed_batch(group: int, dtype: torch.dtype) -> None:
    check(MIXED, kv_heads=2, group=group, dtype=dtype)


@pytest.mark.parametrize("tile", [16, 32])
def test_context_lengths_at_block_and_tile_edges(tile: int) -> None:
    edges = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65]
    specs = [(c - 1, 1) for c in edges] + [(0, c) for c in (15, 16, 17, 33)] + [(c - 3, 3) for c in (16, 17, 33)]
    step = Step(specs, kv_heads=1, group=4)
    step.attention()  # writes K/V
    assert_close(step.kernel(num_splits=1, tile=tile), step.reference(), torch.float32)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_sliding_window(window: int) -> None:
    check(MIXED + [(100, 1), (60, 30)], kv_heads=2, group=2, window=window)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap(window: int | None, dtype: torch.dtype) -> None:
    check(MIXED, kv_heads=2, group=4, softcap=5.0, window=window, dtype=dtype)


@pytest.mark.parametrize("dim,group", [(40, 3), (80, 1), (64, 6)])
def test_head_dims_and_groups_that_are_not_powers_of_two(dim: int, group: int) -> None:
    check([(0, 1), (8, 1), (9, 1), (8, 8), (3, 20)], kv_heads=1, group=group, dim=dim, block_size=8)


def test_prefix_hits_longer_than_a_query_tile() -> None:
    # chunks over a cached prefix, each spanning several query tiles, next to a fresh one and a decode
    check([(33, 50), (0, 70), (128, 1), (64, 17)], kv_heads=2, group=2)


def test_prefill_only_and_decode_only_steps() -> None:
    check([(0, 3), (20, 9)], kv_heads=2, group=2)
    check([(0, 1), (70, 1), (5, 1)], kv_heads=2, group=2)


# --- split-KV (flash decoding) --------------------------------------------------------------------------


LONG = [(299, 1), (1000, 1), (40, 1), (500, 4), (7, 1)]


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("window", [None, 50])
def test_split_kv_matches_the_single_pass(splits: int, window: int | None) -> None:
    step = Step(LONG, kv_heads=2, group=4)
    step.attention(sliding_window=window)  # writes K/V
    single = step.kernel(num_splits=1, window=window)
    split = step.kernel(num_splits=splits, window=window)
    torch.testing.assert_close(split, single, atol=2e-5, rtol=2e-5)
    assert_close(split, step.reference(window=window), torch.float32)


def test_split_kv_with_softcap_fp16_and_prefill_chunks() -> None:
    step = Step(MIXED, kv_heads=2, group=2, dtype=torch.float16)
    single = step.attention(softcap=5.0)
    assert_close(step.kernel(num_splits=4, softcap=5.0), single, torch.float16)


def test_a_long_decode_batch_splits_by_itself() -> None:
    step = Step([(1100, 1), (3, 1)], kv_heads=1, group=2)
    out = step.attention()
    # 2 programs, 264 wanted: min(132, 1101 // (32 * 4) = 8, 16) splits
    assert step.meta.unified.split_buffers[1].shape[2] == 8
    assert_close(out, step.reference(), torch.float32)


def test_split_heuristic() -> None:
    cpu = torch.device("cpu")  # counts as 132 multiprocessors
    assert kernels.choose_num_splits(programs=4, max_seq_len=512, device=cpu) == 1  # short context
    assert kernels.choose_num_splits(programs=264, max_seq_len=32768, device=cpu) == 1  # GPU already full
    assert kernels.choose_num_splits(programs=8, max_seq_len=32768, device=cpu) == 16
    assert kernels.choose_num_splits(programs=40, max_seq_len=32768, device=cpu) == 4  # 264 / 40 -> 6 -> 4
    assert kernels.choose_num_splits(programs=8, max_seq_len=1024, device=cpu) == 8  # 4 tiles per split


# --- the whole model -------------------------------------------------------------------------------------


@pytest.fixture
def tp1():
    from worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(0, 1, "", torch.device("cpu"))
    yield
    destroy_tensor_parallel()


@pytest.fixture
def tiny_gemma2_dir(tmp_path) -> str:
    from worker.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path / "tiny-gemma2", arch="gemma2", seed=2, hidden_size=64, num_layers=2,
                               num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512,
                               sliding_window=8))


def run_two_steps(model: str, use_triton: bool) -> list[torch.Tensor]:
    """Two steps of one runner, each step's logits over every row: a fresh prompt and the first chunk of
    another, then a decode, that prompt's second chunk, a new prompt and a prefix hit on the first."""
    from worker.config import EngineConfig
    from worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=256))
    runner.input_batch.use_triton, runner.input_batch.use_kernel = use_triton, not use_triton and \
        attention.paged_attention_kernel() is not None
    runner.init_kv_cache(32)
    a, b = [(7 * i) % 97 + 5 for i in range(21)], [(3 * i) % 89 + 5 for i in range(37)]
    first = SchedulerOutput(new_requests=[NewRequestData("a", a, [], SamplingParams(), [4, 9], 0),
                                          NewRequestData("b", b, [], SamplingParams(), [1, 2], 0)],
                            num_scheduled_tokens={"a": 21, "b": 20})
    second = SchedulerOutput(
        new_requests=[NewRequestData("c", [11, 12, 13, 14, 15], [], SamplingParams(), [6], 0),
                      NewRequestData("d", a[:16] + [40, 41, 42, 43, 44, 45], [], SamplingParams(), [4, 12], 16)],
        cached_requests=[CachedRequestData("a", [], 21), CachedRequestData("b", [3], 20)],
        num_scheduled_tokens={"a": 1, "b": 17, "c": 5, "d": 6})
    logits = []
    for sched in (first, second):
        runner.input_batch.update(sched)
        if sched is second:
            runner.input_batch.requests["a"].token_ids.append(77)  # what the first step sampled, say
        inputs = runner.input_batch.prepare(sched)
        assert (inputs.meta.unified is not None) == use_triton
        with torch.inference_mode():
            logits.append(runner.model.compute_logits(runner._forward(inputs)))
    return logits


@interpreted_only
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_tiny_model_through_triton_matches_the_cpu_path(tp1, arch: str, request) -> None:
    model = request.getfixturevalue(f"tiny_{arch}_dir")
    expected = run_two_steps(model, use_triton=False)
    actual = run_two_steps(model, use_triton=True)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


# --- on a real GPU ---------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("group", [1, 4])
def test_bfloat16_on_cuda(window: int | None, group: int) -> None:
    check(MIXED + [(100, 1), (60, 30)], kv_heads=2, group=group, window=window, dtype=torch.bfloat16)
    step = Step(LONG, kv_heads=2, group=group, dtype=torch.bfloat16)
    single = step.attention(sliding_window=window)
    assert_close(step.kernel(num_splits=4, window=window), single, torch.bfloat16)
    assert_close(single, step.reference(window=window), torch.bfloat16)
