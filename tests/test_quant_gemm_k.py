"""GGUF k-quant weights, Q4_K and Q6_K (worker/layers/k_quants.py, worker/kernels/csrc/quant_gemm_k.cpp),
against the gguf package's own dequantization and a float64 matmul, per format, over odd shapes; the kernel
as built for this CPU and built again for the AVX2 path (-mno-avx512vnni -mno-avxvnni) and the plain loop
(-mno-avx2).

The kernel's error bound, derived as in tests/test_quant_gemm.py: x is rounded per block of 32 exactly as
the 32-weight kernel rounds it (each value moves by at most e / 256, plus 2^-23 |x| for the float32
remainder), and the integer products are exact, so

    |y - x . w| <= sum over 32-blocks of  e_b 2^-8 (1 + 2^-10) * sum |w_i|  +  2^-23 |x| . |w|   (activations)
                 + (K / 32 + 9) 2^-24 * 3 * sum over 32-blocks of t_b * (|x_b|_1 + 32 e_b)       (float32 sums)

where t_b bounds the decomposed terms of a weight of that block, not the weight itself: Q4_K's d sc q (up to
15 d sc) and dmin m; Q6_K's d sc q (up to 63 |d sc|) and its offset 32 d sc. Every term passes through at most K / 32 + 9
float32 roundings (the int32 sum to float, the scale products, a chain of K / 32 FMAs, the horizontal sums,
the min term). bfloat16 output adds one rounding: at most 2^-8 of |y|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from k_quant_blocks import dequantize as gguf_dequantize
from k_quant_blocks import quantize, random_blocks

from worker import parallel_state
from worker.kernels import build
from worker.layers import k_quants, quantized_linear
from worker.layers.linear import RowParallelLinear
from worker.layers.quantized_linear import (
    DEQUANTIZED_GEMM_MIN_ROWS,
    K_QUANT_KERNEL_MAX_ROWS,
    BlockFormat,
    BlockQuantizedWeight,
    dequantize,
    quant_linear,
    tiled_linear,
)

FORMATS = [BlockFormat.Q4_K, BlockFormat.Q6_K]
SHAPES = [(1, 1, 256), (2, 7, 512), (3, 13, 768), (5, 33, 256), (8, 130, 1536), (13, 9, 2304), (16, 517, 512)]
VARIANTS = {"native": (), "avx2": ("-mno-avx512vnni", "-mno-avxvnni"), "plain": ("-mno-avx2",)}


def variant_kernel(variant: str):
    if variant == "native":
        return k_quants.quant_gemm_k_kernel()
    return build.load_extension(f"quant_gemm_k_{variant}", (build.CSRC / "quant_gemm_k.cpp",), VARIANTS[variant])


@pytest.fixture(scope="module", params=list(VARIANTS))
def kernel(request):
    module = variant_kernel(request.param)
    if module is None:
        pytest.skip(f"the quant_gemm_k kernel ({request.param}) does not build here; the torch path serves")
    return module


@pytest.fixture(scope="module")
def native():
    module = k_quants.quant_gemm_k_kernel()
    if module is None:
        pytest.skip("the quant_gemm_k kernel does not build here (no compiler); the torch path serves")
    return module


def qtype(fmt: BlockFormat) -> GGMLQuantizationType:
    return GGMLQuantizationType(int(fmt))


def quantized(fmt: BlockFormat, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, the gguf package's dequantization of them) of a random [n, k] weight with per-row scales and
    offsets (Q4_K's mins matter)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))
    blocks = quantize(w, qtype(fmt))
    return blocks, gguf_dequantize(blocks, qtype(fmt)).astype(np.float64)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(32, -1).view(m, k)
    x[:, :32] = 0  # an all-zero block: scale 0, no division by it
    return x


def term_sizes(fmt: BlockFormat, blocks: np.ndarray) -> torch.Tensor:
    """t_b of the module docstring, [N, K / 32]: the largest decomposed term a weight of 32-block b has."""
    b = torch.from_numpy(blocks).reshape(blocks.shape[0], -1, fmt.block_bytes)
    if fmt is BlockFormat.Q4_K:
        halves = b[..., :4].contiguous().view(torch.float16).double()
        scales, mins = k_quants._q4_k_scales(b[..., 4:16])
        t = torch.maximum(15 * halves[..., 0:1] * scales, halves[..., 1:2] * mins)  # [N, blocks, 8]
    else:
        d = b[..., 208:210].contiguous().view(torch.float16).double()
        ds = (63 * d * b[..., 192:208].contiguous().view(torch.int8).double()).abs()  # [N, blocks, 16]
        t = ds.view(*ds.shape[:-1], 8, 2).amax(-1)
    return t.reshape(blocks.shape[0], -1)


def error_bound(x: torch.Tensor, w: np.ndarray, terms: torch.Tensor) -> torch.Tensor:
    """The module docstring's bound, [M, N], for x [M, K], the dequantized weight w [N, K] and t_b [N, K / 32]."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    e = xb.abs().amax(-1) / 127  # [M, B]
    wt = torch.from_numpy(w)
    w_abs_sum = wt.view(w.shape[0], k // 32, 32).abs().sum(-1)
    activation = (e * 2 ** -8 * (1 + 2 ** -10)) @ w_abs_sum.T + 2 ** -23 * (x.double().abs() @ wt.abs().T)
    floats = (k // 32 + 9) * 2 ** -24 * 3 * ((xb.abs().sum(-1) + 32 * e) @ terms.T)
    return activation + floats


def run_kernel(kernel, x: torch.Tensor, blocks: np.ndarray, fmt: BlockFormat, bias=None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"), dtype=x.dtype)
    kernel.quant_linear(out, x, torch.from_numpy(blocks), int(fmt), bias)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("blocks_from", ["quantizer", "random bytes"])
@pytest.mark.parametrize("shape", [(1, 256), (13, 768), (1000, 512)])
def test_dequantize_equals_the_gguf_package(fmt, blocks_from, shape) -> None:
    if blocks_from == "quantizer":
        blocks, reference = quantized(fmt, *shape, seed=shape[0])
    else:
        blocks = random_blocks(*shape, qtype(fmt), seed=shape[0])
        reference = gguf_dequantize(blocks, qtype(fmt)).astype(np.float64)
    got = dequantize(torch.from_numpy(blocks), fmt, torch.float32)
    assert got.shape == shape and torch.equal(got.double(), torch.from_numpy(reference))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_test_quantizer_is_close_to_its_input(fmt) -> None:
    """The quantizer only has to make valid blocks, but a wrong layout would show here as noise."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    error = np.abs(gguf_dequantize(quantize(w, qtype(fmt)), qtype(fmt)) - w)
    levels = 15 if fmt is BlockFormat.Q4_K else 62  # over a sub-block's range
    assert error.max() < (w.max() - w.min()) / levels


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_within_the_activation_rounding_of_the_float_product(kernel, fmt, m, n, k, bias) -> None:
    blocks, w = quantized(fmt, n, k, seed=m * 7 + n)
    x = activations(m, k, seed=n + k)
    b = torch.randn(n) if bias else None
    out = run_kernel(kernel, x, blocks, fmt, b)
    exact = x.double() @ torch.from_numpy(w).T + (0 if b is None else b.double())
    error = (out.double() - exact).abs()
    bound = error_bound(x, w, term_sizes(fmt, blocks)) + (0 if b is None else exact.abs() * 2 ** -23)
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())} at {divmod(int((error - bound).argmax()), n)}"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_random_blocks_multiply_within_the_bound(kernel, fmt) -> None:
    """Every bit pattern of scales, mins and quants (random bytes), signed Q6_K scales included."""
    blocks = random_blocks(45, 768, qtype(fmt), seed=4)
    w = gguf_dequantize(blocks, qtype(fmt)).astype(np.float64)
    x = activations(3, 768, seed=5)
    error = (run_kernel(kernel, x, blocks, fmt).double() - x.double() @ torch.from_numpy(w).T).abs()
    assert (error <= error_bound(x, w, term_sizes(fmt, blocks))).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_activations_round_to_nearest(native, fmt) -> None:
    """As in tests/test_quant_gemm.py: the RMS of error / sigma over 2 x 2048 outputs is 1 within a few percent
    when the remainder rounds to nearest (about 2 if it truncated)."""
    blocks, w = quantized(fmt, 2048, 512, seed=11)
    x = activations(2, 512, seed=12)
    error = run_kernel(native, x, blocks, fmt).double() - x.double() @ torch.from_numpy(w).T
    e = x.double().view(2, -1, 32).abs().amax(-1) / 127 / 256
    sigma = ((e ** 2 / 12) @ (torch.from_numpy(w) ** 2).view(2048, -1, 32).sum(-1).T).sqrt()
    rms = float((error / sigma).pow(2).mean().sqrt())
    assert 0.9 < rms < 1.1, rms


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 33, 512), (3, 517, 256), (16, 13, 768)])
def test_bfloat16_activations_round_the_result_once(native, fmt, m, n, k) -> None:
    blocks, w = quantized(fmt, n, k, seed=m + n)
    x = activations(m, k, seed=k).bfloat16()
    out = run_kernel(native, x, blocks, fmt)
    exact = x.double() @ torch.from_numpy(w).T
    bound = error_bound(x.float(), w, term_sizes(fmt, blocks))
    assert ((out.double() - exact).abs() <= bound + (exact.abs() + bound) * 2 ** -8).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_weight_split_over_threads_gives_the_same_bits(native, threads) -> None:
    blocks, _ = quantized(BlockFormat.Q4_K, 8191, 512, seed=1)
    x = activations(3, 512, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_kernel(native, x, blocks, BlockFormat.Q4_K)
        torch.set_num_threads(threads)
        assert torch.equal(run_kernel(native, x, blocks, BlockFormat.Q4_K), single)
    finally:
        torch.set_num_threads(before)


def test_the_kernel_refuses_what_it_cannot_multiply(native) -> None:
    blocks, _ = quantized(BlockFormat.Q4_K, 4, 512, seed=0)
    with pytest.raises(RuntimeError, match="bytes a row"):
        run_kernel(native, torch.randn(1, 768), blocks, BlockFormat.Q4_K)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native.quant_linear(torch.empty(1, 4), torch.randn(1, 576), torch.from_numpy(blocks), 12, None)
    with pytest.raises(RuntimeError, match="not Q4_K or Q6_K"):  # 3: Q4_1, the 32-weight kernel's
        native.quant_linear(torch.empty(1, 4), torch.randn(1, 512), torch.from_numpy(blocks), 3, None)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_dequantizes_rows_as_the_gguf_package(kernel, fmt) -> None:
    """Exact: the same float32 products and differences as numpy (no FMA contraction in the kernel)."""
    for blocks in (quantized(fmt, 77, 768, seed=9)[0], random_blocks(77, 768, qtype(fmt), seed=9)):
        out = torch.full((77, 768), float("nan"))
        kernel.dequantize_rows(out, torch.from_numpy(blocks), int(fmt))
        assert torch.equal(out, torch.from_numpy(gguf_dequantize(blocks, qtype(fmt))))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_dequantizes_rows_to_bfloat16_as_torch_rounds(kernel, fmt) -> None:
    blocks = random_blocks(45, 512, qtype(fmt), seed=11)
    out = torch.full((45, 512), float("nan"), dtype=torch.bfloat16)
    kernel.dequantize_rows(out, torch.from_numpy(blocks), int(fmt))
    want = torch.from_numpy(gguf_dequantize(blocks, qtype(fmt))).bfloat16()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def weight_of(fmt: BlockFormat, blocks: np.ndarray, k: int, dtype=torch.float32) -> BlockQuantizedWeight:
    weight = BlockQuantizedWeight(fmt, blocks.shape[0], k, dtype)
    weight.blocks.copy_(torch.from_numpy(blocks))
    return weight


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 7, 256), (17, 130, 768), (40, 33, 1536)])
@pytest.mark.parametrize("dequantizer", ["kernel", "torch"])
def test_the_tiled_path_equals_the_float_product(monkeypatch, fmt, m, n, k, dequantizer) -> None:
    if dequantizer == "kernel" and k_quants.quant_gemm_k_kernel() is None:
        pytest.skip("the quant_gemm_k kernel does not build here")
    if dequantizer == "torch":
        monkeypatch.setattr(k_quants, "quant_gemm_k_kernel", lambda: None)
    monkeypatch.setattr(quantized_linear, "TILE_WEIGHTS", 5 * k)
    blocks, w = quantized(fmt, n, k, seed=n)
    x, b = activations(m, k, seed=m), torch.randn(n)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    torch.testing.assert_close(tiled_linear(x, weight_of(fmt, blocks, k), b).double(), exact, rtol=1e-5, atol=1e-4)


def test_the_layer_takes_the_k_kernel_for_few_rows_and_the_torch_path_for_many(native, monkeypatch) -> None:
    blocks, _ = quantized(BlockFormat.Q6_K, 40, 512, seed=3)
    weight = weight_of(BlockFormat.Q6_K, blocks, 512)
    few = activations(2, 512, seed=4)
    assert torch.equal(quant_linear(few.view(1, 2, 512), weight).view(2, 40), run_kernel(native, few, blocks, weight.fmt))
    many = activations(K_QUANT_KERNEL_MAX_ROWS + 1, 512, seed=5)
    assert torch.equal(quant_linear(many, weight), tiled_linear(many, weight))
    monkeypatch.setattr(k_quants, "quant_gemm_k_kernel", lambda: None)  # no compiler: the torch path
    assert torch.equal(quant_linear(few, weight), tiled_linear(few, weight))


def test_a_k_quant_weight_needs_whole_256_blocks() -> None:
    with pytest.raises(ValueError, match="Q4_K weight needs in_features divisible by 256, got 576"):
        BlockQuantizedWeight(BlockFormat.Q4_K, 8, 576, torch.float32)
    assert BlockQuantizedWeight(BlockFormat.Q6_K, 8, 1536, torch.float32).blocks.shape == (8, 6 * 210)


def test_tensor_parallel_cuts_whole_256_blocks(monkeypatch) -> None:
    """SmolLM2's down_proj (1536 input features): 3 ranks of 512 take 2 whole blocks each, and put together
    they are the weight; 4 ranks of 384 would cut a block and are refused."""
    blocks, w = quantized(BlockFormat.Q4_K, 8, 1536, seed=7)
    pieces = []
    for rank in range(3):
        monkeypatch.setattr(parallel_state, "_TP", parallel_state.TPGroup(rank, 3))
        row = RowParallelLinear(1536, 8, False, torch.float32, BlockFormat.Q4_K)
        row.load_quantized(None, torch.from_numpy(blocks))
        pieces.append(dequantize(row.weight.blocks, BlockFormat.Q4_K, torch.float64))
    assert torch.equal(torch.cat(pieces, dim=1), torch.from_numpy(w))
    monkeypatch.setattr(parallel_state, "_TP", parallel_state.TPGroup(0, 4))
    with pytest.raises(ValueError, match="only on 256-weight blocks.*--quantization none"):
        RowParallelLinear(1536, 8, False, torch.float32, BlockFormat.Q4_K)
    RowParallelLinear(1536, 8, False, torch.float32, BlockFormat.Q8_0)  # 384 = 12 blocks of 32


# --- many rows of Q4_K with q8 activations (quant_matmul_q8, q8_matmul.h) ---------------------------------------


def q8_bound(x: torch.Tensor, w: np.ndarray, terms: torch.Tensor) -> torch.Tensor:
    """As `error_bound` with each value of x rounded once to int8 (within e / 2) instead of twice."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    e = xb.abs().amax(-1) / 127
    w_abs_sum = torch.from_numpy(w).view(w.shape[0], k // 32, 32).abs().sum(-1)
    activation = (e * 0.5 * (1 + 2 ** -10)) @ w_abs_sum.T
    floats = (k // 32 + 9) * 2 ** -24 * 3 * ((xb.abs().sum(-1) + 32 * e) @ terms.T)
    return activation + floats


@pytest.mark.parametrize("m,n,k", [(17, 13, 256), (33, 130, 768), (64, 67, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_q4_k_rows_with_q8_activations_are_within_their_rounding(native, m, n, k, dtype) -> None:
    if not native.q8_matmul():
        pytest.skip("quant_matmul_q8 needs AVX-512 VNNI")
    fmt = BlockFormat.Q4_K
    blocks, w = quantized(fmt, n, k, seed=m + k)
    x = activations(m, k, seed=n).to(dtype)
    b = torch.randn(n).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    native.quant_matmul_q8(out, x, torch.from_numpy(blocks), int(fmt), b)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    bound = q8_bound(x.float(), w, term_sizes(fmt, blocks)) + exact.abs() * 2 ** -23
    if dtype == torch.bfloat16:
        bound = bound + (exact.abs() + bound) * 2 ** -8
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())}"
    assert float(error.mean()) <= 0.25 * float(q8_bound(x.float(), w, term_sizes(fmt, blocks)).mean())
    with pytest.raises(RuntimeError, match="Q4_K only"):
        native.quant_matmul_q8(out, x, torch.from_numpy(quantized(BlockFormat.Q6_K, n, k, seed=1)[0]), 14, None)


def test_the_layer_takes_q8_for_many_q4_k_rows_and_tiles_for_q6_k(native, monkeypatch) -> None:
    if not native.q8_matmul():
        pytest.skip("quant_matmul_q8 needs AVX-512 VNNI")
    x = activations(K_QUANT_KERNEL_MAX_ROWS + 1, 512, seed=3)
    blocks, _ = quantized(BlockFormat.Q4_K, 40, 512, seed=4)
    assert torch.equal(quant_linear(x, weight_of(BlockFormat.Q4_K, blocks, 512)),  # by default: the tiles
                       tiled_linear(x, weight_of(BlockFormat.Q4_K, blocks, 512)))
    monkeypatch.setattr(quantized_linear, "Q8_ACTIVATIONS", True)  # REDSERVE_Q8_ACTIVATIONS=1
    for fmt in FORMATS:
        blocks, _ = quantized(fmt, 40, 512, seed=4)
        weight = weight_of(fmt, blocks, 512)
        if fmt is BlockFormat.Q4_K:
            want = torch.empty(x.shape[0], 40)
            native.quant_matmul_q8(want, x, torch.from_numpy(blocks), int(fmt), None)
        else:
            want = tiled_linear(x, weight)
        assert torch.equal(quant_linear(x, weight), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(17, 13, 256), (33, 130, 768), (64, 67, 1536)])
def test_many_bfloat16_rows_are_within_the_weights_bfloat16_rounding(native, fmt, m, n, k) -> None:
    """quant_matmul (AMX tiles, else AVX-512 BF16 dot products): each weight rounded once to bfloat16 (2^-8 of it),
    float32 sums (products of two bfloat16 exact), the result rounded once to bfloat16; odd shapes leave partial
    tiles of rows and columns."""
    if not native.native_bf16_matmul():
        pytest.skip("quant_matmul of the k-quants needs AMX tiles or AVX-512 BF16")
    blocks, w = quantized(fmt, n, k, seed=m + n)
    x = activations(m, k, seed=k + m).bfloat16()
    b = torch.randn(n).bfloat16()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    native.quant_matmul(out, x, torch.from_numpy(blocks), int(fmt), b)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    sizes = x.double().abs() @ torch.from_numpy(w).abs().T
    bound = (2 ** -8 + (k + 8) * 3 * 2 ** -24) * sizes
    bound = bound + (exact.abs() + bound) * 2 ** -8
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())}"
    with pytest.raises(RuntimeError, match="bfloat16 x only"):
        native.quant_matmul(torch.empty(m, n), x.float(), torch.from_numpy(blocks), int(fmt), None)


def test_the_layer_takes_quant_matmul_for_many_bfloat16_rows(native, monkeypatch) -> None:
    x = activations(K_QUANT_KERNEL_MAX_ROWS + 1, 512, seed=3).bfloat16()
    for fmt in FORMATS:
        weight = weight_of(fmt, quantized(fmt, 40, 512, seed=4)[0], 512, torch.bfloat16)
        if native.native_bf16_matmul():
            want = torch.empty(x.shape[0], 40, dtype=torch.bfloat16)
            native.quant_matmul(want, x, weight.blocks, int(fmt), None)
            # the tiles and F.linear (oneDNN on AMX) can give the same bits: make sure they are not what ran
            monkeypatch.setattr(quantized_linear, "tiled_linear", lambda *a: pytest.fail("the tiled path ran"))
        else:
            want = tiled_linear(x, weight)
            with pytest.raises(RuntimeError, match="neither AMX tiles nor AVX-512 BF16"):
                native.quant_matmul(torch.empty_like(want), x, weight.blocks, int(fmt), None)
        assert torch.equal(quant_linear(x, weight), want)


def test_many_bfloat16_rows_on_amx_multiply_by_the_dequantized_weight(native, monkeypatch) -> None:
    x = activations(DEQUANTIZED_GEMM_MIN_ROWS, 512, seed=5).bfloat16()
    for fmt in FORMATS:
        weight = weight_of(fmt, quantized(fmt, 40, 512, seed=6)[0], 512, torch.bfloat16)
        if native.amx_matmul():
            dequantized = torch.empty(40, 512, dtype=torch.bfloat16)
            native.dequantize_rows(dequantized, weight.blocks, int(fmt))
            want = F.linear(x, dequantized)
            monkeypatch.setattr(native, "quant_matmul", lambda *a: pytest.fail("quant_matmul ran"))
        else:
            want = tiled_linear(x, weight)
        assert torch.equal(quant_linear(x, weight), want)
        monkeypatch.undo()
