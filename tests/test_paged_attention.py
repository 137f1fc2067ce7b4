"""Paged attention: the C++ CPU kernel, the pure-torch path and a naive float64 reference agree.

Each case builds a real step with ``InputBatch.prepare`` (decodes first, then prefill chunks) over
shuffled, non-contiguous blocks, runs ``PagedAttention`` once with the kernel layout and once with the
torch layout over copies of one random cache, and compares both with attention computed by hand.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from protocol.sampling_params import SamplingParams
from protocol.step_types import NewRequestData, SchedulerOutput
from worker.input_batch import InputBatch
from worker.kernels import build
from worker.layers.attention import PagedAttention, paged_attention_kernel, write_kv

KERNEL = paged_attention_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the C++ kernel could not be built here")
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def run_step(specs: list[tuple[int, int]], *, kv_heads: int, group: int, dim: int = 64, block_size: int = 16,
             dtype: torch.dtype = torch.float32, window: int | None = None, softcap: float | None = None,
             use_kernel: bool, seed: int = 0) -> tuple:
    """One step over requests (num_computed, num_scheduled): (out [T, H, d], cache after, q, blocks, sizes)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in specs]
    pool = list(range(sum(needed) + 3))
    rng.shuffle(pool)
    heads, total = kv_heads * group, sum(n for _, n in specs)
    cache = torch.randn(2, len(pool) * block_size, kv_heads, dim, generator=gen).to(dtype)
    q = (torch.randn(total, heads, dim, generator=gen) * 2).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    sched = SchedulerOutput()
    for i, ((c, n), blocks) in enumerate(zip(specs, split(pool, needed), strict=False)):
        sched.new_requests.append(NewRequestData(f"r{i}", [7] * (c + n), [], SamplingParams(max_tokens=1), blocks, c))
        sched.num_scheduled_tokens[f"r{i}"] = n
    batch = InputBatch(block_size, torch.device("cpu"), group, [1], use_kernel=use_kernel)
    batch.kernel_max_queries = 10**6  # the kernel serves cached-prefix chunks too
    batch.update(sched)
    inputs = batch.prepare(sched)
    attn = PagedAttention(heads, kv_heads, dim, sliding_window=window, softcap=softcap)
    out = attn(q, k, v, cache, inputs.meta).view(total, heads, dim).clone()
    return out, cache, q, pool, needed


def split(pool: list[int], sizes: list[int]) -> list[list[int]]:
    out, at = [], 0
    for size in sizes:
        out.append(pool[at:at + size])
        at += size
    return out


def row_starts(specs: list[tuple[int, int]]) -> list[int]:
    """Where each request's queries sit: decodes first, then the rest, each group in request order."""
    order = sorted(range(len(specs)), key=lambda i: specs[i][1] != 1)
    starts, at = [0] * len(specs), 0
    for i in order:
        starts[i] = at
        at += specs[i][1]
    return starts


def reference(specs, cache, q, pool, needed, *, kv_heads, group, block_size=16, window=None, softcap=None):
    """Float64 attention per request, per head, from the cache after the step wrote its K/V."""
    heads, dim = q.shape[1], q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for (c, n), blocks, start in zip(specs, split(pool, needed), row_starts(specs), strict=True):
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(c + n)])
        keys, values = cache[0, slots].double(), cache[1, slots].double()
        for i in range(n):
            pos = c + i
            visible = torch.arange(c + n) <= pos
            if window is not None:
                visible &= torch.arange(c + n) > pos - window
            for h in range(heads):
                scores = keys[:, h // group] @ q[start + i, h].double() * dim ** -0.5
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                out[start + i, h] = probs @ values[:, h // group]
    return out


def check(specs, **kw) -> None:
    dtype = kw.get("dtype", torch.float32)
    tol = TOLERANCE[dtype]
    shape = {key: kw[key] for key in ("kv_heads", "group", "block_size", "window", "softcap") if key in kw}
    torch_out, cache, q, pool, needed = run_step(specs, use_kernel=False, **kw)
    kernel_out, kernel_cache, *_ = run_step(specs, use_kernel=True, **kw)
    assert torch.equal(cache, kernel_cache)  # both wrote the step's K/V to the same slots
    expected = reference(specs, cache, q, pool, needed, **shape)
    torch.testing.assert_close(torch_out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(kernel_out.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(kernel_out.float(), torch_out.float(), atol=tol, rtol=tol)


MIXED = [(0, 1), (15, 1), (16, 1), (17, 1), (47, 1), (0, 5), (16, 16), (31, 9), (5, 40)]


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_ratios_mixed_batch(group: int, dtype: torch.dtype) -> None:
    check(MIXED, kv_heads=2, group=group, dtype=dtype)


# Fresh prompts of one length side by side (one batched SDPA call: `AttentionMetadata.prefill_runs`), broken by a
# shorter one and by a chunk over a cached prefix, beside decodes.
RUNS = [(0, 1), (20, 1), (0, 24), (0, 24), (0, 24), (0, 7), (0, 24), (0, 24), (16, 24), (0, 24)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 10])
def test_fresh_prompts_of_one_length_attend_as_one_batch(dtype: torch.dtype, window: int | None) -> None:
    check(RUNS, kv_heads=2, group=3, dtype=dtype, window=window)


def test_prefill_runs_group_adjacent_fresh_chunks_of_one_length() -> None:
    sched, first = SchedulerOutput(), 0
    for i, (c, n) in enumerate(RUNS):
        count = -(-(c + n) // 16)
        sched.new_requests.append(NewRequestData(f"r{i}", [7] * (c + n), [], SamplingParams(), list(range(first, first + count)), c))
        sched.num_scheduled_tokens[f"r{i}"] = n
        first += count
    batch = InputBatch(16, torch.device("cpu"), 3, [1], use_kernel=False)
    batch.update(sched)
    runs = batch.prepare(sched).meta.prefill_runs()
    assert [[(c.num_computed, c.num_tokens) for c in run] for run in runs] == [
        [(0, 24)] * 3, [(0, 7)], [(0, 24)] * 2, [(16, 24)], [(0, 24)]]
    assert [run[0].start for run in runs] == [2, 74, 81, 129, 153]


@needs_kernel
@pytest.mark.parametrize("context", [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 200])
def test_decode_at_block_boundaries(context: int) -> None:
    check([(context - 1, 1), (context, 1), (context + 1, 1)], kv_heads=4, group=2)


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window: int, dtype: torch.dtype) -> None:
    check(MIXED + [(100, 1), (60, 30)], kv_heads=2, group=2, window=window, dtype=dtype)


@needs_kernel
@pytest.mark.parametrize("window", [None, 9])
def test_softcap(window: int | None) -> None:
    check(MIXED, kv_heads=2, group=4, softcap=5.0, window=window)


@needs_kernel
@pytest.mark.parametrize("dim", [36, 40, 80, 128])  # 36: no 8-lane path; 80: 64 + 16 lanes
def test_head_dims_and_block_sizes(dim: int) -> None:
    check([(0, 1), (8, 1), (9, 1), (8, 8), (3, 20)], kv_heads=1, group=3, dim=dim, block_size=8)


@needs_kernel
def test_cached_prefix_chunks_longer_than_a_query_tile() -> None:
    check([(33, 50), (0, 70), (128, 1), (64, 17)], kv_heads=2, group=2)


@needs_kernel
def test_kernel_layout_sends_decodes_and_short_cached_prefix_chunks_to_the_kernel() -> None:
    sched = SchedulerOutput()
    for i, (c, n) in enumerate([(4, 1), (0, 6), (16, 6)]):
        sched.new_requests.append(NewRequestData(f"r{i}", [7] * (c + n), [], SamplingParams(), [2 * i, 2 * i + 1], c))
        sched.num_scheduled_tokens[f"r{i}"] = n
    batch = InputBatch(16, torch.device("cpu"), 2, [1], use_kernel=True)
    batch.update(sched)
    batch.kernel_max_queries = 5
    short_only = batch.prepare(sched).meta
    assert short_only.paged.query_lens.tolist() == [1] and [c.num_computed for c in short_only.prefills] == [0, 16]
    batch.kernel_max_queries = 6
    meta = batch.prepare(sched).meta
    assert meta.num_decodes == 0 and [c.num_computed for c in meta.prefills] == [0]  # the fresh chunk: SDPA
    assert meta.paged.query_start.tolist() == [0, 7] and meta.paged.query_lens.tolist() == [1, 6]
    assert meta.paged.context_lens.tolist() == [5, 22]
    assert meta.paged.block_tables[0, 0] == 0 and meta.paged.block_tables[1].tolist() == [4, 5]


def test_kernel_builds_where_a_compiler_is() -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here: the torch path serves")
    assert KERNEL is not None, "a C++ compiler is present but the paged-attention kernel did not build"


def load_in_subprocess(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "from worker.kernels import load_extension; print(load_extension('paged_attention'))"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)


def test_no_compiler_falls_back_with_one_warning_line() -> None:
    result = load_in_subprocess({"CXX": "no-such-c++-compiler"})
    assert result.returncode == 0 and result.stdout.strip() == "None"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "PyTorch fallback" in lines[0]


def test_failed_build_falls_back_with_one_warning_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    code = f"from worker.kernels import load_extension; print(load_extension('broken', ({str(broken)!r},)))"
    env = {**os.environ, "REDSERVE_KERNEL_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "None"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "failed to build" in lines[0], result.stderr


def test_a_build_killed_midway_does_not_block_the_next(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    env = {**os.environ, "REDSERVE_KERNEL_CACHE_DIR": str(tmp_path / "cache")}
    code = ("from pathlib import Path; from worker.kernels import build; "
            f"d = build.cache_root() / ('broken-' + build.build_key([Path({str(broken)!r})])); "
            "d.mkdir(parents=True); (d / 'lock').touch(); "  # what torch leaves when a build is killed
            f"print(build.load_extension('broken', ({str(broken)!r},)))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "None" and "failed to build" in result.stderr


def test_build_key_follows_the_sources_and_the_shared_headers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "CSRC", tmp_path)
    source, header = tmp_path / "k.cpp", tmp_path / "shared.h"
    source.write_text('#include "shared.h"\nint a;\n')
    header.write_text("int h;\n")
    first = build.build_key([source])
    assert build.build_key([source]) == first
    header.write_text("int g;\n")
    second = build.build_key([source])
    assert second != first
    source.write_text('#include "shared.h"\nint b;\n')
    assert build.build_key([source]) != second


def test_build_key_follows_where_torch_and_python_are_installed(tmp_path: Path, monkeypatch) -> None:
    """Two venvs (a checkout's and a CI clone's) share the cache but not a build: the ninja command names their
    include dirs, and a build dir shared by both would be rebuilt by each in turn."""
    monkeypatch.setattr(build, "CSRC", tmp_path)
    source = tmp_path / "k.cpp"
    source.write_text("int a;\n")
    here = build.build_key([source])
    monkeypatch.setattr(build.sys, "prefix", str(tmp_path / "other-venv"))
    assert build.build_key([source]) != here


def test_build_key_follows_the_cpu_flags(tmp_path: Path, monkeypatch) -> None:
    """One cache shared by two kinds of CPU (a compose volume) keeps a -march=native build per kind."""
    monkeypatch.setattr(build, "CSRC", tmp_path)
    source = tmp_path / "k.cpp"
    source.write_text("int a;\n")
    monkeypatch.setattr(build, "_cpu_flags", lambda: "x86_64 x86_64 flags : fpu sse2 avx2")
    avx2 = build.build_key([source])
    monkeypatch.setattr(build, "_cpu_flags", lambda: "x86_64 x86_64 flags : fpu sse2 avx2 avx512f")
    assert build.build_key([source]) != avx2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_kernel_matches_index_copy(dtype: torch.dtype) -> None:
    kv_heads, dim, tokens = 4, 64, 37
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 8 + 2 * kv_heads, dim, generator=gen).to(dtype)
    k, v = qkv[:, 8:8 + kv_heads], qkv[:, 8 + kv_heads:]  # views into the projection's output, as the model's
    slots = torch.randperm(200, generator=gen)[:tokens]
    cache = torch.randn(2, 200, kv_heads, dim, generator=gen).to(dtype)
    expected = cache.clone()
    expected[0].index_copy_(0, slots, k)
    expected[1].index_copy_(0, slots, v)
    KERNEL.write_kv(cache[0], cache[1], slots, k, v)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot out of range"):
        KERNEL.write_kv(cache[0], cache[1], torch.tensor([0, 200] + [1] * (tokens - 2)), k, v)
    assert torch.equal(cache, expected)  # a bad slot is caught before anything is written


def test_write_kv_falls_back_to_index_copy_for_strided_rows() -> None:
    kv_heads, dim = 2, 8
    k = torch.randn(dim, 5, kv_heads).permute(1, 2, 0)  # [5, KVH, d] with a strided head dim
    v = torch.randn(5, kv_heads, dim)
    slots = torch.tensor([9, 0, 4, 3, 7])
    cache = torch.zeros(2, 10, kv_heads, dim)
    write_kv(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache[0, slots], k) and torch.equal(cache[1, slots], v)


@needs_kernel
def test_install_entry_point_finds_the_built_kernel() -> None:
    result = subprocess.run([sys.executable, "-m", "worker.kernels"], capture_output=True, text=True,
                            timeout=300, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0 and "C++ kernel paged_attention: ready" in result.stdout


def test_two_checkouts_with_the_same_sources_share_one_build(tmp_path: Path) -> None:
    """A build is compiled from a copy in its build dir: loading the same source from another path (a second
    checkout) reuses it instead of rebuilding over it."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    source = ("#include <pybind11/pybind11.h>\nint answer() { return 42; }\n"
              "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"answer\", &answer); }\n")
    env = {**os.environ, "REDSERVE_KERNEL_CACHE_DIR": str(tmp_path / "cache")}
    built = []
    for checkout in ("a", "b"):
        path = tmp_path / checkout / "answer.cpp"
        path.parent.mkdir()
        path.write_text(source)
        code = f"from worker.kernels import load_extension; print(load_extension('answer', ({str(path)!r},)).answer())"
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.stdout.strip() == "42", result.stderr
        [so] = (tmp_path / "cache").glob("answer-*/answer.so")
        built.append(so.stat().st_mtime_ns)
    assert built[0] == built[1], "the second checkout rebuilt the extension"


def block_tables(contexts: list[int], block_size: int, rng: random.Random) -> tuple[torch.Tensor, int]:
    """Block tables for sequences of these contexts over a shuffled pool (5 blocks spare), and the pool's size."""
    blocks = [-(-c // block_size) for c in contexts]
    pool = list(range(sum(blocks) + 5))
    rng.shuffle(pool)
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    for s, part in enumerate(split(pool, blocks)):
        tables[s, :len(part)] = torch.tensor(part, dtype=torch.int32)
    return tables, len(pool)


def decode_reference(q, cache, tables, contexts, block_size, window, softcap) -> torch.Tensor:
    """Float64 decode attention of each row over its sequence's cached keys."""
    heads, kv_heads, dim = q.shape[1], cache.shape[2], q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, context in enumerate(contexts.tolist()):
        positions = torch.arange(context)
        slots = tables[s, positions // block_size].long() * block_size + positions % block_size
        keys, values = cache[0, slots].double(), cache[1, slots].double()
        visible = positions > context - 1 - window if window else torch.ones(context, dtype=torch.bool)
        for h in range(heads):
            scores = keys[:, h * kv_heads // heads] @ q[s, h].double() * dim ** -0.5
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
            out[s, h] = probs @ values[:, h * kv_heads // heads]
    return out


@needs_kernel
@pytest.mark.parametrize(("group", "dim", "block_size", "window", "softcap"), [
    (3, 64, 16, 0, 0.0),    # SmolLM2's heads
    (1, 64, 16, 0, 0.0),
    (2, 128, 8, 0, 0.0),    # blocks smaller than the 16 keys of a pass
    (4, 96, 32, 0, 0.0),    # 32 dims a value pass; two passes a block
    (6, 64, 16, 23, 0.0),   # rows accumulated 4 + 2; a window that starts mid-block
    (16, 32, 16, 0, 30.0),  # the widest group the path serves, with softcap
    (20, 64, 16, 0, 0.0),   # wider than that: the AVX2 path
    (2, 40, 16, 0, 0.0),    # not a multiple of 32: the AVX2 path
])
def test_bfloat16_decode_matches_float64(attention_kernel, group: int, dim: int, block_size: int, window: int,
                                         softcap: float) -> None:
    gen, rng = torch.Generator().manual_seed(group * dim + block_size), random.Random(dim)
    kv_heads, contexts = 2, [1, 15, 16, 17, 33, 100, 161]
    tables, num_blocks = block_tables(contexts, block_size, rng)
    cache = (torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen) * 2).to(torch.bfloat16)
    q = (torch.randn(len(contexts), kv_heads * group, dim, generator=gen) * 2).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    rows = torch.arange(len(contexts), dtype=torch.int32)
    attention_kernel.paged_attention(out, q, cache[0], cache[1], tables, rows, torch.ones_like(rows),
                                  torch.tensor(contexts, dtype=torch.int32), block_size, dim ** -0.5, window, softcap)
    expected = decode_reference(q, cache, tables, torch.tensor(contexts), block_size, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window", [0, 23, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_decode_batches_split_by_keys_match_one_pass(attention_kernel, threads: int, window: int,
                                                           dtype: torch.dtype) -> None:
    """With fewer tiles than 4 a thread, and one KV head a task not spreading evenly over the threads (SmolLM2's 3 KV
    heads at batch 1 on 2 or 4 threads, batch 2 on 4), a decode with keys for two or more pieces of two blocks is
    split by keys (pieces over all KV heads, merged after the pass): the same attention as one pass (one thread
    never splits) and as float64, with and without a sliding window."""
    kv_heads, group, dim, block_size = 3, 3, 64, 16
    gen, rng = torch.Generator().manual_seed(window + threads), random.Random(window)
    for contexts in ([1000], [33, 300], [5, 64]):
        tables, num_blocks = block_tables(contexts, block_size, rng)
        cache = (torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen) * 2).to(dtype)
        q = (torch.randn(len(contexts), kv_heads * group, dim, generator=gen) * 2).to(dtype)
        rows = torch.arange(len(contexts), dtype=torch.int32)
        outs = []
        before = torch.get_num_threads()
        try:
            for n in (1, threads):
                torch.set_num_threads(n)
                out = torch.full_like(q, float("nan"))
                attention_kernel.paged_attention(out, q, cache[0], cache[1], tables, rows, torch.ones_like(rows),
                                              torch.tensor(contexts, dtype=torch.int32), block_size, dim ** -0.5,
                                              window, 0.0)
                outs.append(out)
        finally:
            torch.set_num_threads(before)
        expected = decode_reference(q, cache, tables, torch.tensor(contexts), block_size, window, 0.0)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(outs[1].double(), expected, atol=tol, rtol=tol)
        torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol / 10, rtol=tol / 10)

