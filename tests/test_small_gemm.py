"""The small-batch linear kernel (worker/kernels/csrc/small_gemm.cpp) against ``F.linear``: every row count
it serves, sizes that are not multiples of its 8-wide steps or 4-row blocks, bias;
what it hands to ``F.linear``; then the tiny model with the kernel vs without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import small_gemm as small_gemm_module
from worker.layers.small_gemm import MAX_ROWS, linear, small_gemm_kernel


@pytest.fixture(scope="module")
def kernel():
    module = small_gemm_kernel()
    if module is None:
        pytest.skip("the small_gemm kernel does not build here (no compiler); F.linear serves")
    return module


def operands(rows: int, out_features: int, in_features: int, bias: bool):
    g = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    return x, weight, torch.randn(out_features, generator=g) if bias else None


@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (1024, 512), (513, 1408), (4099, 65)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear(kernel, rows, out_features, in_features, bias) -> None:
    x, weight, b = operands(rows, out_features, in_features, bias)
    out = torch.full((rows, out_features), float("nan"))
    kernel.small_linear(out, x, weight, b)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (6, 31), (5, 33), (1024, 512), (513, 1408)])
@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_kernel_rounds_a_float32_sum_once(kernel, rows, out_features, in_features, bias) -> None:
    """The bf16 products are exact in float32 and summed there (vdpbf16ps, or widened FMAs), then rounded
    once after the bias: within one bf16 rounding of the float32 result, summation order aside (K = 31/33
    straddle the 32-wide step's masked tail)."""
    x, weight, b = (t.bfloat16() if t is not None else None for t in operands(rows, out_features, in_features, bias))
    out = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
    kernel.small_linear(out, x, weight, b)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    scale = F.linear(x.double().abs(), weight.double().abs()).clamp(min=1.0)  # float32 summation error bound
    error = (out.double() - exact).abs()
    assert (error <= exact.abs() * 2 ** -8 + scale * 1e-6).all(), float((error - exact.abs() * 2 ** -8).max())
    torch.testing.assert_close(linear(x, weight, b), out, rtol=0, atol=0)  # the layer takes the kernel


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_weight_split_over_threads_equals_f_linear(kernel, threads) -> None:
    """Weights past the kernel's per-thread share (1 MiB) are split over torch's threads in 4-row blocks; an odd
    row count leaves a tail for the last task. Every output column is written exactly once (NaN-filled out)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3):
            x, weight, b = operands(rows, 5003, 768, True)  # 15 MB of W: up to 15 tasks
            out = torch.full((rows, 5003), float("nan"))
            kernel.small_linear(out, x, weight, b)
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_linear_uses_the_kernel_up_to_max_rows(kernel, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(small_gemm_module, "small_gemm_kernel", lambda: calls.append(1) or kernel)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x, weight, b = operands(rows, 96, 80, True)
        torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    assert len(calls) == 2


@pytest.mark.parametrize("case", ["float16", "3-d", "strided x", "strided weight"])
def test_other_inputs_take_f_linear(case, monkeypatch) -> None:
    monkeypatch.setattr(small_gemm_module, "small_gemm_kernel", lambda: pytest.fail("kernel called"))
    x, weight, b = operands(2, 24, 16, True)
    if case == "float16":
        x, weight, b = x.half(), weight.half(), b.half()
    elif case == "3-d":
        x = x.unsqueeze(0)
    elif case == "strided x":
        x = torch.randn(16, 2).t()
    else:
        weight = torch.randn(16, 24).t()
    torch.testing.assert_close(linear(x, weight, b), F.linear(x, weight, b))


def test_without_the_kernel_f_linear_serves(monkeypatch) -> None:
    monkeypatch.setattr(small_gemm_module, "small_gemm_kernel", lambda: None)
    x, weight, b = operands(1, 24, 16, True)
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))


def test_kernel_rejects_wrong_shapes(kernel) -> None:
    x, weight, _ = operands(2, 24, 16, False)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        kernel.small_linear(torch.empty(2, 23), x, weight, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16, one dtype"):
        kernel.small_linear(torch.empty(2, 24), x.double(), weight, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16, one dtype"):
        kernel.small_linear(torch.empty(2, 24, dtype=torch.bfloat16), x.bfloat16(), weight, None)


def test_tiny_model_same_tokens_and_logprobs_with_and_without_kernel(kernel, tiny_llama_dir, monkeypatch) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, num_kv_blocks=64)
    prompts = [[10 + i for i in range(7)], [200 + 3 * i for i in range(21)], [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    try:
        with_kernel = llm.generate(prompts, params)
        monkeypatch.setattr(small_gemm_module, "small_gemm_kernel", lambda: None)
        without = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for a, b in zip(with_kernel, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == 8
        for entry_a, entry_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert entry_a[0] == pytest.approx(entry_b[0], abs=1e-4)
