"""GGUF block weights (worker/layers/quantized_linear.py) and their kernel (worker/kernels/csrc/quant_gemm.cpp)
against the gguf package's own dequantization and a float64 matmul, per format, over odd shapes.

The kernel's error bound, derived (not tuned): the kernel rounds each block of 32 values of a row of x to
int8 with the scale e = max|x| / 127 and the remainder to int8 again with the scale e / 256 (clamped to
+-127), so each value moves by at most e / 256 (one unit where the clamp bites, half a unit elsewhere), plus
the float32 rounding of the remainder before it is rounded: under 2^-23 |x|. The integer products are exact,
so

    |y - x . w| <= sum over blocks of  e_b 2^-8 (1 + 2^-10) * sum |w_i|  +  2^-23 |x| . |w|   (activations)
                 + (K / 32 + 9) 2^-24 * 3 * sum over blocks of max|w_b| * (|x_b|_1 + 32 e_b)  (float32 sums)

The second line: every term of the sum passes through at most K/32 + 9 float32 roundings (the int32 sum to
float, the block scale d * e, a chain of K/32 FMAs, the horizontal sum, the min term), and the decomposed
terms d*q and m of a weight are each at most 2 max|w_b| and max|w_b| (Q8_0: m = 0; Q4_0: m = -8 d; Q4_1:
m = the block min). bfloat16 output adds one rounding: at most 2^-8 of |y| (8 significant bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from worker.dtype_choice import cpu_flags
from worker.kernels import build
from worker.layers import quantized_linear
from worker.layers.quantized_linear import (
    DEQUANTIZED_GEMM_MIN_ROWS,
    KERNEL_MAX_ROWS,
    BlockFormat,
    BlockQuantizedWeight,
    dequantize,
    quant_gemm_kernel,
    quant_linear,
    tiled_linear,
)

FORMATS = [f for f in BlockFormat if f.block_weights == 32]  # the k-quants: tests/test_quant_gemm_k.py
SHAPES = [(1, 1, 32), (3, 7, 96), (17, 13, 64), (1, 33, 96), (3, 517, 576), (17, 130, 1536)]


@pytest.fixture(scope="module")
def kernel():
    module = quant_gemm_kernel()
    if module is None:
        pytest.skip("the quant_gemm kernel does not build here (no compiler); the torch path serves")
    return module


# The kernel as this CPU builds it, and built again without AVX-512 and without AVX2, so that each path is checked
# on a CPU that has AVX-512: the int8 path's 512-bit tile (Q4_0, Q4_1 and Q8_0 with AVX-512 BW and VNNI), its
# 256-bit one (the others, and older CPUs) and the plain loop; quant_matmul's float path in 8-lane vectors (bfloat16
# x widened to float32) and its plain loop. On a CPU with AMX the native build multiplies bfloat16 rows on its
# tiles, so a build without them keeps the vdpbf16ps path checked too.
KERNEL_VARIANTS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx2",)}
if "amx_tile" in cpu_flags():
    KERNEL_VARIANTS["noamx"] = ("-mno-amx-tile",)


@pytest.fixture(scope="module", params=list(KERNEL_VARIANTS))
def variant_kernel(request):
    if request.param == "native":
        module = quant_gemm_kernel()
    else:
        module = build.load_extension(f"quant_gemm_{request.param}", (build.CSRC / "quant_gemm.cpp",),
                                      KERNEL_VARIANTS[request.param])
    if module is None:
        pytest.skip(f"the quant_gemm kernel ({request.param}) does not build here; the torch path serves")
    return module


def quantized(fmt: BlockFormat, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, the gguf package's dequantization of them) of a random [n, k] weight with per-row scales."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1)))
    blocks = quants.quantize(w.astype(np.float32), GGMLQuantizationType(int(fmt)))
    return blocks, quants.dequantize(blocks, GGMLQuantizationType(int(fmt))).astype(np.float64)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(32, -1).view(m, k)
    x[:, :32] = 0  # an all-zero block: scale 0, no division by it
    return x


def error_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """The module docstring's bound, [M, N], for x [M, K] and the dequantized weight w [N, K]."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    e = xb.abs().amax(-1) / 127  # [M, B]
    wb = torch.from_numpy(w).view(w.shape[0], k // 32, 32)
    w_abs_sum, w_max = wb.abs().sum(-1), wb.abs().amax(-1)  # [N, B]
    activation = (e * 2 ** -8 * (1 + 2 ** -10)) @ w_abs_sum.T + 2 ** -23 * (x.double().abs() @ torch.from_numpy(w).abs().T)
    floats = (k // 32 + 9) * 2 ** -24 * 3 * ((xb.abs().sum(-1) + 32 * e) @ w_max.T)
    return activation + floats


def run_kernel(kernel, x: torch.Tensor, blocks: np.ndarray, fmt: BlockFormat, bias=None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"), dtype=x.dtype)
    kernel.quant_linear(out, x, torch.from_numpy(blocks), int(fmt), bias)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(n, k) for _, n, k in SHAPES] + [(1000, 32 * 3)])
def test_dequantize_equals_the_gguf_package(fmt, shape) -> None:
    blocks, reference = quantized(fmt, *shape, seed=shape[0])
    got = dequantize(torch.from_numpy(blocks), fmt, torch.float32)
    assert torch.equal(got.double(), torch.from_numpy(reference))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_within_the_activation_rounding_of_the_float_product(variant_kernel, fmt, m, n, k, bias) -> None:
    blocks, w = quantized(fmt, n, k, seed=m * 7 + n)
    x = activations(m, k, seed=n + k)
    b = torch.randn(n) if bias else None
    out = run_kernel(variant_kernel, x, blocks, fmt, b)
    exact = x.double() @ torch.from_numpy(w).T + (0 if b is None else b.double())
    error = (out.double() - exact).abs()
    bound = error_bound(x, w) + (0 if b is None else exact.abs() * 2 ** -23)
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())} at {divmod(int((error - bound).argmax()), n)}"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_activations_round_to_nearest(variant_kernel, fmt) -> None:
    """The bound above is a worst case; the typical error is sharper. Rounding the remainder to nearest leaves
    each value off by a uniform error in [-u/2, u/2], u = e / 256 (variance u^2 / 12), independent across
    values, so an output's error has standard deviation sigma = sqrt(sum u_b^2 / 12 * sum w_i^2); over
    2 x 2048 outputs the RMS of error / sigma is 1 within a few percent. Truncating would make it about 2."""
    blocks, w = quantized(fmt, 2048, 576, seed=11)
    x = activations(2, 576, seed=12)
    error = run_kernel(variant_kernel, x, blocks, fmt).double() - x.double() @ torch.from_numpy(w).T
    e = x.double().view(2, -1, 32).abs().amax(-1) / 127 / 256
    sigma = ((e ** 2 / 12) @ (torch.from_numpy(w) ** 2).view(2048, -1, 32).sum(-1).T).sqrt()
    rms = float((error / sigma).pow(2).mean().sqrt())
    assert 0.9 < rms < 1.1, rms


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", [(1, 33, 96), (3, 517, 576), (17, 13, 64)])
def test_bfloat16_activations_round_the_result_once(variant_kernel, fmt, m, n, k) -> None:
    blocks, w = quantized(fmt, n, k, seed=m + n)
    x = activations(m, k, seed=k).bfloat16()
    out = run_kernel(variant_kernel, x, blocks, fmt)
    exact = x.double() @ torch.from_numpy(w).T
    bound = error_bound(x.float(), w)
    assert ((out.double() - exact).abs() <= bound + (exact.abs() + bound) * 2 ** -8).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_large_weight_split_over_threads_gives_the_same_bits(variant_kernel, threads) -> None:
    """Rows of W are split over torch's threads in 4-row tiles; each output is computed the same way
    whoever computes it, and written once (NaN-filled out). 8191 rows leave a tail for the last task."""
    blocks, _ = quantized(BlockFormat.Q4_1, 8191, 576, seed=1)
    x = activations(3, 576, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_kernel(variant_kernel, x, blocks, BlockFormat.Q4_1)
        torch.set_num_threads(threads)
        assert torch.equal(run_kernel(variant_kernel, x, blocks, BlockFormat.Q4_1), single)
    finally:
        torch.set_num_threads(before)


def test_the_kernel_refuses_what_it_cannot_multiply(kernel) -> None:
    blocks, _ = quantized(BlockFormat.Q8_0, 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="bytes a row"):
        run_kernel(kernel, torch.randn(1, 96), blocks, BlockFormat.Q8_0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quant_linear(torch.empty(1, 4), torch.randn(1, 48), torch.from_numpy(blocks), 8, None)
    with pytest.raises(RuntimeError, match="not Q8_0"):  # 12: GGML's Q4_K, not served as blocks
        kernel.quant_linear(torch.empty(1, 4), torch.randn(1, 64), torch.from_numpy(blocks), 12, None)


def weight_of(fmt: BlockFormat, blocks: np.ndarray, k: int, dtype=torch.float32) -> BlockQuantizedWeight:
    weight = BlockQuantizedWeight(fmt, blocks.shape[0], k, dtype)
    weight.blocks.copy_(torch.from_numpy(blocks))
    return weight


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dequantizer", ["kernel", "torch"])
def test_the_tiled_path_equals_the_float_product(monkeypatch, fmt, m, n, k, dequantizer) -> None:
    """Many rows (or no kernel): a tile of weight rows at a time is dequantized (by the kernel's
    ``dequantize_rows``, or in torch without it) and multiplied in float (a small tile here: several tiles
    and a tail)."""
    if dequantizer == "kernel" and quant_gemm_kernel() is None:
        pytest.skip("the quant_gemm kernel does not build here")
    if dequantizer == "torch":
        monkeypatch.setattr(quantized_linear, "quant_gemm_kernel", lambda: None)
    monkeypatch.setattr(quantized_linear, "TILE_WEIGHTS", 5 * k)
    blocks, w = quantized(fmt, n, k, seed=n)
    x, b = activations(m, k, seed=m), torch.randn(n)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    torch.testing.assert_close(tiled_linear(x, weight_of(fmt, blocks, k), b).double(), exact, rtol=1e-5, atol=1e-4)


MATMUL_SHAPES = [(13, 13, 32), (17, 67, 96), (33, 130, 576), (40, 64, 1536), (64, 200, 576), (100, 7, 96)]


def matmul_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """The float32 rounding of ``quant_matmul``, [M, N]: every product passes through at most K + 40 roundings
    (a block's sum, its scale, the running sum over blocks, the block's min times its x sum); the decomposed
    terms d*q and m of a weight are each at most 2 max|w_b| (module docstring above), so 3 max|w_b| bounds them.
    The float32 path dequantizes first (Q4_1's FMA: one rounding of |w|), within the same sum."""
    m, k = x.shape
    xb = x.double().abs().view(m, k // 32, 32).sum(-1)
    w_max = torch.from_numpy(w).abs().view(w.shape[0], k // 32, 32).amax(-1)
    return (k + 40) * 2 ** -24 * 3 * (xb @ w_max.T)


def run_matmul(kernel, x: torch.Tensor, blocks: np.ndarray, fmt: BlockFormat, bias=None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"), dtype=x.dtype)
    kernel.quant_matmul(out, x, torch.from_numpy(blocks), int(fmt), bias)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_rows_multiply_to_float_rounding(variant_kernel, fmt, m, n, k, dtype) -> None:
    """``quant_matmul`` (the weights decoded once a call) has no activation rounding: bfloat16 x is multiplied
    as it is (the bf16 dot products' products are exact; with native bfloat16, AMX or AVX-512 BF16, each weight
    rounded once to bfloat16 first), float32 x in float32. Odd shapes leave a partial tile of rows, of columns
    and of a column block."""
    blocks, w = quantized(fmt, n, k, seed=m + n)
    x = activations(m, k, seed=k + m).to(dtype)
    b = torch.randn(n).to(dtype)
    out = run_matmul(variant_kernel, x, blocks, fmt, b)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    bound = matmul_bound(x.float(), w)
    if dtype == torch.bfloat16 and variant_kernel.native_bf16_matmul():  # each weight rounded to bfloat16 first
        bound = bound + 2 ** -8 * (x.double().abs() @ torch.from_numpy(w).abs().T)
    if dtype == torch.bfloat16:
        bound = bound + (exact.abs() + bound) * 2 ** -8  # the result rounded once to bfloat16
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())} at {divmod(int((error - bound).argmax()), n)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_rows_split_over_threads_give_the_same_bits(variant_kernel, dtype) -> None:
    """Column blocks of 64 are split over torch's threads; 1000 columns leave a partial block and 70 rows a
    partial tile of rows."""
    blocks, _ = quantized(BlockFormat.Q4_1, 1000, 576, seed=21)
    x = activations(70, 576, seed=22).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_matmul(variant_kernel, x, blocks, BlockFormat.Q4_1)
        torch.set_num_threads(3)
        assert torch.equal(run_matmul(variant_kernel, x, blocks, BlockFormat.Q4_1), single)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def q8_kernel(kernel):
    if not kernel.q8_matmul():
        pytest.skip("quant_matmul_q8 needs AVX-512 VNNI; quant_matmul serves many rows on this CPU")
    return kernel


def q8_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """``quant_matmul_q8``'s bound, [M, N]: each block of 32 values of a row of x rounded once to int8 with the
    scale e = max|x| / 127, so each value moves by at most e / 2 (+ the float32 rounding of x / e); the integer
    sums are exact; then every term passes through at most K / 32 + 9 float32 roundings as in the module
    docstring (the int32 sum to float, d * e, the chain of K / 32 FMAs, the min term, the store)."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    e = xb.abs().amax(-1) / 127
    wb = torch.from_numpy(w).view(w.shape[0], k // 32, 32)
    w_abs_sum, w_max = wb.abs().sum(-1), wb.abs().amax(-1)
    activation = (e * 0.5 * (1 + 2 ** -10)) @ w_abs_sum.T
    floats = (k // 32 + 9) * 2 ** -24 * 3 * ((xb.abs().sum(-1) + 32 * e) @ w_max.T)
    return activation + floats


def run_q8(kernel, x: torch.Tensor, blocks: np.ndarray, fmt: BlockFormat, bias=None) -> torch.Tensor:
    out = torch.full((x.shape[0], blocks.shape[0]), float("nan"), dtype=x.dtype)
    kernel.quant_matmul_q8(out, x, torch.from_numpy(blocks), int(fmt), bias)
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,n,k", MATMUL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_many_rows_with_q8_activations_are_within_their_rounding(q8_kernel, fmt, m, n, k, dtype) -> None:
    blocks, w = quantized(fmt, n, k, seed=m + n)
    x = activations(m, k, seed=k + m).to(dtype)
    b = torch.randn(n).to(dtype)
    out = run_q8(q8_kernel, x, blocks, fmt, b)
    exact = x.double() @ torch.from_numpy(w).T + b.double()
    bound = q8_bound(x.float(), w) + exact.abs() * 2 ** -23
    if dtype == torch.bfloat16:
        bound = bound + (exact.abs() + bound) * 2 ** -8
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"worst excess {float((error - bound).max())} at {divmod(int((error - bound).argmax()), n)}"
    # the bound is a worst case; rounding to nearest leaves the typical error near a quarter of it (a sign or
    # scale slip in a block would not)
    assert float(error.mean()) <= 0.25 * float(q8_bound(x.float(), w).mean())


def test_q8_rows_split_over_threads_give_the_same_bits(q8_kernel) -> None:
    blocks, _ = quantized(BlockFormat.Q4_0, 1000, 576, seed=23)
    x = activations(70, 576, seed=24).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_q8(q8_kernel, x, blocks, BlockFormat.Q4_0)
        torch.set_num_threads(3)
        assert torch.equal(run_q8(q8_kernel, x, blocks, BlockFormat.Q4_0), single)
    finally:
        torch.set_num_threads(before)


def test_the_layer_takes_each_path_by_its_rows(kernel, monkeypatch) -> None:
    blocks, w = quantized(BlockFormat.Q4_1, 40, 96, seed=3)
    weight = weight_of(BlockFormat.Q4_1, blocks, 96)
    few = activations(KERNEL_MAX_ROWS, 96, seed=4)
    assert torch.equal(quant_linear(few.view(2, -1, 96), weight).view(-1, 40), run_kernel(kernel, few, blocks, weight.fmt))
    for dtype in (torch.float32, torch.bfloat16):  # by default (REDSERVE_Q8_ACTIVATIONS unset): quant_matmul
        many = activations(KERNEL_MAX_ROWS + 1, 96, seed=5).to(dtype)
        assert torch.equal(quant_linear(many, weight), run_matmul(kernel, many, blocks, weight.fmt))
    monkeypatch.setattr(quantized_linear, "Q8_ACTIVATIONS", True)  # REDSERVE_Q8_ACTIVATIONS=1
    many_rows = run_q8 if kernel.q8_matmul() else run_matmul
    assert torch.equal(quant_linear(many, weight), many_rows(kernel, many, blocks, weight.fmt))
    q8_blocks, _ = quantized(BlockFormat.Q8_0, 40, 96, seed=6)  # Q8_0: never q8 activations
    assert torch.equal(quant_linear(many, weight_of(BlockFormat.Q8_0, q8_blocks, 96)),
                       run_matmul(kernel, many, q8_blocks, BlockFormat.Q8_0))
    monkeypatch.setattr(quantized_linear, "Q8_ACTIVATIONS", False)
    monkeypatch.setattr(quantized_linear, "quant_gemm_kernel", lambda: None)  # no compiler: the torch path
    assert torch.equal(quant_linear(few, weight), tiled_linear(few, weight))
    assert torch.equal(quant_linear(many, weight), tiled_linear(many, weight))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_dequantizes_rows_as_the_gguf_package(kernel, fmt) -> None:
    """Exact but for Q4_1's d * q + m, which the kernel rounds once (an FMA) where numpy rounds twice."""
    blocks, w = quantized(fmt, 77, 32 * 3, seed=9)
    out = torch.full((77, 96), float("nan"))
    kernel.dequantize_rows(out, torch.from_numpy(blocks), int(fmt))
    ulp = torch.from_numpy(w).abs() * 2 ** -23 if fmt is BlockFormat.Q4_1 else 0
    assert ((out.double() - torch.from_numpy(w)).abs() <= ulp).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_kernel_dequantizes_rows_to_bfloat16_as_torch_rounds(variant_kernel, fmt) -> None:
    """bfloat16 out: the float32 weights rounded once to nearest even, as ``.to(torch.bfloat16)`` rounds them (each
    build: AVX-512 BF16's conversion and the plain one)."""
    blocks, _ = quantized(fmt, 77, 32 * 5, seed=10)
    wide = torch.empty(77, 160)
    variant_kernel.dequantize_rows(wide, torch.from_numpy(blocks), int(fmt))
    out = torch.full((77, 160), float("nan"), dtype=torch.bfloat16)
    variant_kernel.dequantize_rows(out, torch.from_numpy(blocks), int(fmt))
    assert torch.equal(out.view(torch.int16), wide.bfloat16().view(torch.int16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 out"):
        variant_kernel.dequantize_rows(out.half(), torch.from_numpy(blocks), int(fmt))


def test_many_bfloat16_rows_on_amx_multiply_by_the_dequantized_weight(kernel, monkeypatch) -> None:
    """From DEQUANTIZED_GEMM_MIN_ROWS rows of bfloat16 x on AMX: F.linear with the weight dequantized to bfloat16,
    for weights of up to DEQUANTIZED_GEMM_MAX_WEIGHTS. Fewer rows, a larger weight, and every row elsewhere:
    quant_matmul."""
    blocks, _ = quantized(BlockFormat.Q4_1, 40, 96, seed=12)
    weight = weight_of(BlockFormat.Q4_1, blocks, 96, torch.bfloat16)
    bias = torch.randn(40).bfloat16()
    x = activations(DEQUANTIZED_GEMM_MIN_ROWS + 3, 96, seed=13).bfloat16()
    tiles = run_matmul(kernel, x, blocks, weight.fmt, bias)
    if kernel.amx_matmul():
        dequantized = torch.empty(40, 96, dtype=torch.bfloat16)
        kernel.dequantize_rows(dequantized, weight.blocks, int(weight.fmt))
        want = F.linear(x, dequantized, bias)
        with monkeypatch.context() as patch:
            patch.setattr(kernel, "quant_matmul", lambda *a: pytest.fail("quant_matmul ran"))
            assert torch.equal(quant_linear(x.view(1, -1, 96), weight, bias).view(-1, 40), want)
    monkeypatch.setattr(quantized_linear, "dequantized_linear", lambda *a: pytest.fail("dequantized_linear ran"))
    fewer = x[:DEQUANTIZED_GEMM_MIN_ROWS - 1]  # one row too few
    assert torch.equal(quant_linear(fewer, weight, bias), run_matmul(kernel, fewer, blocks, weight.fmt, bias))
    monkeypatch.setattr(quantized_linear, "DEQUANTIZED_GEMM_MAX_WEIGHTS", 40 * 96 - 1)  # one weight too many
    assert torch.equal(quant_linear(x, weight, bias), tiles)
    if not kernel.amx_matmul():
        assert torch.equal(quant_linear(x, weight, bias), tiles)


def test_embedding_rows_dequantize_in_the_model_dtype() -> None:
    blocks, w = quantized(BlockFormat.Q8_0, 50, 64, seed=6)
    weight = weight_of(BlockFormat.Q8_0, blocks, 64, torch.bfloat16)
    ids = torch.tensor([[3, 49], [0, 3]])
    rows = weight.rows(ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 2, 64)
    assert torch.equal(rows, torch.from_numpy(w)[ids].bfloat16())
