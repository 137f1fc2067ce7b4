"""Prefill chunks in the C++ paged-attention kernel's native paths (csrc/prefill_bf16.h, csrc/prefill_f32.h): each
tile against float64 attention, which dtypes and head dims they serve, and the runner sending chunks to them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_paged_attention import KERNEL, TOLERANCE, block_tables, needs_kernel

from worker.kernels import build


def prefill_reference(q, cache, tables, starts, lens, contexts, block_size, window) -> torch.Tensor:
    """Float64 attention of each sequence's queries (the last ``lens[s]`` positions of its context), causal."""
    heads, kv_heads = q.shape[1], cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s, (start, n, context) in enumerate(zip(starts, lens, contexts, strict=True)):
        positions = torch.arange(context)
        slots = tables[s, positions // block_size].long() * block_size + positions % block_size
        keys, values = cache[0, slots].double(), cache[1, slots].double()
        for i in range(n):
            pos = context - n + i
            visible = positions <= pos
            if window:
                visible &= positions > pos - window
            for h in range(heads):
                scores = keys[:, h * kv_heads // heads] @ q[start + i, h].double() * q.shape[2] ** -0.5
                probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=0)
                out[start + i, h] = probs @ values[:, h * kv_heads // heads]
    return out


# Prefill tiles take prefill_bf16.h's path in bfloat16 on a CPU with AVX512-BF16 (keys packed as dim pairs, 4 / 2 / 1
# rows a pass by head dim, 32 keys a step; the AVX2 build keeps the per-row walk), and prefill_f32.h's in float32
# with AVX2 (both builds: keys packed dim-major, 4 rows a pass, 16 keys a step). Chunks: fresh, over a cached
# prefix, shorter than a pass's rows, ending mid-block, and longer than a query tile.
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("group", "dim", "block_size", "window"), [
    (3, 64, 16, 0),     # SmolLM2's heads
    (2, 64, 16, 0),     # the tiny model's
    (1, 128, 8, 0),     # blocks smaller than a group of 16 keys; 2 rows a pass
    (4, 96, 32, 0),     # 48 dim pairs: three transposes a key group
    (2, 32, 16, 37),    # a window that starts mid-block and mid-step
    (1, 256, 16, 5),    # one row a pass; a window shorter than a step
])
def test_prefill_chunks_match_float64(attention_kernel, group: int, dim: int, block_size: int, window: int,
                                      dtype: torch.dtype) -> None:
    gen, rng = torch.Generator().manual_seed(group * dim + window), random.Random(dim + window)
    kv_heads = 2
    lens, contexts = [2, 7, 40, 17, 100, 3], [2, 39, 40, 81, 100, 200]  # context - len: the cached prefix
    tables, num_blocks = block_tables(contexts, block_size, rng)
    cache = (torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen) * 2).to(dtype)
    q = (torch.randn(sum(lens), kv_heads * group, dim, generator=gen) * 2).to(dtype)
    starts = [sum(lens[:s]) for s in range(len(lens))]
    out = torch.full_like(q, float("nan"))
    attention_kernel.paged_attention(out, q, cache[0], cache[1], tables, torch.tensor(starts, dtype=torch.int32),
                                  torch.tensor(lens, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32),
                                  block_size, dim ** -0.5, window, 0.0)
    expected = prefill_reference(q, cache, tables, starts, lens, contexts, block_size, window)
    tol = 2e-2 if dtype == torch.bfloat16 else TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@needs_kernel
def test_native_prefill_follows_dtype_head_dim_and_softcap(attention_kernel) -> None:
    flags = build._cpu_flags().split()
    native = attention_kernel is KERNEL and "avx512_bf16" in flags
    assert attention_kernel.native_prefill(torch.bfloat16, 64, 0.0) is native
    assert attention_kernel.native_prefill(torch.bfloat16, 128, 0.0) is native
    assert not attention_kernel.native_prefill(torch.bfloat16, 80, 0.0)  # not a multiple of 32
    assert attention_kernel.native_prefill(torch.float32, 80, 0.0) is ("avx2" in flags and "fma" in flags)
    assert not attention_kernel.native_prefill(torch.float32, 72, 0.0)  # not a multiple of 16
    assert not attention_kernel.native_prefill(torch.bfloat16, 64, 30.0)  # softcap: the caller's path
    assert not attention_kernel.native_prefill(torch.float32, 64, 30.0)
    assert not attention_kernel.native_prefill(torch.float16, 64, 0.0)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runner_sends_prefill_chunks_to_the_kernel_where_its_native_path_serves(tmp_path: Path,
                                                                                   dtype: torch.dtype) -> None:
    """Through the engine: the runner sets ``kernel_prefill_max_queries`` from the model (head dim 64, no softcap)
    and the kernel's ``native_prefill``; chunks up to that length attend in the kernel, longer ones through SDPA,
    and the first sampled row of each prompt matches transformers' float32 logits."""
    from engine_helpers import LogitsRecorder, greedy, hf_logits, make_llm, random_prompt

    import worker.models.tiny_model as tm
    from worker.layers.attention import PREFILL_KERNEL_MAX_QUERIES

    model = str(tm.make_tiny_model(tmp_path / "m", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                                   intermediate_size=256, vocab_size=1024, max_position_embeddings=1024))
    expected = PREFILL_KERNEL_MAX_QUERIES[dtype] if KERNEL.native_prefill(dtype, 64, 0.0) else 0
    llm = make_llm(model, dtype=str(dtype).removeprefix("torch."))
    try:
        runner = llm.engine.executor.runner
        assert runner.input_batch.kernel_prefill_max_queries == expected
        if expected == 0:
            pytest.skip(f"no native prefill path for {dtype} on this CPU")
        kernel_chunks, sdpa_chunks = [], []
        prepare = runner.input_batch.prepare

        def recorded(sched):
            inputs = prepare(sched)
            if inputs.meta.paged is not None:
                kernel_chunks.extend(n for n in inputs.meta.paged.query_lens.tolist() if n > 1)
            sdpa_chunks.extend(chunk.num_tokens for chunk in inputs.meta.prefills)
            return inputs

        runner.input_batch.prepare = recorded
        recorder = LogitsRecorder(llm)
        prompts = [random_prompt(40, 1), random_prompt(600, 2)]
        llm.generate(prompts, greedy(2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert 40 in kernel_chunks
    assert (600 in kernel_chunks) == (expected >= 600) and (600 in sdpa_chunks) == (expected < 600)
    for prompt in prompts:
        [row] = [logits for _, ctx, logits in recorder.rows if ctx == prompt]
        reference = hf_logits(model, prompt)[-1]
        tol = 1e-3 if dtype == torch.float32 else 0.05 * reference.abs().max().item()
        torch.testing.assert_close(row, reference, atol=tol, rtol=0)
