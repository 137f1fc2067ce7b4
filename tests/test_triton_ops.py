"""The Triton layer ops (worker/kernels/triton_ops.py) against the torch references their callers keep:
RMSNorm (Llama and Gemma rounding) with and without the residual add, on strided [T, heads, d] views too,
RoPE in place on the q/k views of a packed qkv, SiLU-and-mul; odd sizes, float32 and float16 (under the
Triton interpreter without a GPU, bfloat16 on CUDA only). Then the layers pick them where the Triton path
serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from triton_interpret import load

ops, DEVICE, INTERPRETED = load("triton_ops")

from tests.ulp import assert_within_ulps  # noqa: E402
from worker.layers import activation, norm, rotary  # noqa: E402
from worker.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from worker.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def close(actual: torch.Tensor, expected: torch.Tensor, float32_rtol: float = 2e-6) -> None:
    """float32 to a few ulps (another summation order or exp); narrow dtypes within one ulp of theirs."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=float32_rtol, atol=1e-6)
    else:
        assert_within_ulps(actual, expected, ulps=1)


def make_norm(cls, size: int, dtype: torch.dtype):
    layer = cls(size, 1e-5, dtype)
    layer.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    return layer.to(DEVICE)


def data(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("tokens,size", [(1, 64), (7, 37), (33, 129)])
def test_rms_norm_matches_the_reference(cls, dtype, tokens, size) -> None:
    layer = make_norm(cls, size, dtype)
    x = data(tokens, size, dtype=dtype, seed=tokens)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, layer.weight, layer.eps, layer.weight_offset)
    close(out, layer.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("tokens,size", [(1, 64), (5, 93)])
def test_fused_add_rms_norm_in_place(cls, dtype, tokens, size) -> None:
    layer = make_norm(cls, size, dtype)
    x, residual = data(tokens, size, dtype=dtype, seed=1), data(tokens, size, dtype=dtype, seed=2)
    expected_residual = x + residual
    expected = layer.reference(expected_residual)
    ops.fused_add_rms_norm(x, residual, layer.weight, layer.eps, layer.weight_offset)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one rounding of one sum: exact
    close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype) -> None:
    """Qwen3's q/k norms run on [T, heads, d] views of the packed qkv output."""
    layer = make_norm(RMSNorm, 16, dtype)
    qkv = data(9, 3 * 4 * 16, dtype=dtype, seed=3)
    q = qkv[:, :64].view(9, 4, 16)
    assert not q.is_contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
    ops.rms_norm(out, q, layer.weight, layer.eps, 0.0)
    close(out, layer.reference(q))


def assert_rotation_within_rounding(actual: torch.Tensor, before: torch.Tensor, rope: RotaryEmbedding,
                                    positions: torch.Tensor) -> None:
    """``actual`` (RoPE of ``before``, neox halves) within the rounding error of torch's op sequence: each of
    y1 = x1 c - x2 s and y2 = x2 c + x1 s off the exact value by at most eps * (|x1 c| + |x2 s|) (two
    products and a sum, each rounded to half an ulp). Not bit-exact: on a GPU the compiler may fuse a
    product into the sum (FMA), which rounds fewer times (and so differs from torch where terms cancel)."""
    half = before.shape[-1] // 2
    x1, x2 = before[..., :half].double(), before[..., half:].double()
    c, s = (t[positions].double().unsqueeze(1) for t in (rope.cos, rope.sin))
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    scale = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), dim=-1)
    info = torch.finfo(actual.dtype)
    error = (actual.double() - exact).abs()
    bound = info.eps * scale + info.tiny
    assert (error <= bound).all(), (f"{int((error > bound).sum())} of {error.numel()} elements outside the rounding "
                                    f"bound; worst error / bound {float((error / bound).max()):.2f}")


def make_rotary(head_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=10000.0)
    return RotaryEmbedding(config, head_dim, 300, DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 8, 4, 64), (7, 3, 3, 18), (37, 8, 1, 32)])
def test_rope_in_place_on_qkv_views(dtype, tokens, heads, kv_heads, head_dim) -> None:
    rope = make_rotary(head_dim, dtype)
    qkv = data(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens, scale=1.0)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    q_before, k_before = q.clone(), k.clone()
    ref_q, ref_k = rope.reference(positions, q, k)
    ops.rotary_embedding(positions, q, k, rope.cos, rope.sin)
    for got, ref, before in ((q, ref_q, q_before), (k, ref_k, k_before)):
        assert_rotation_within_rounding(ref, before, rope, positions)  # the bound holds torch's own sequence
        assert_rotation_within_rounding(got, before, rope, positions)
        if INTERPRETED:  # no FMA contraction: the interpreter rounds each product and the sum as torch does
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1408), (5, 77), (3, 2500)])
def test_silu_and_mul(dtype, tokens, inter) -> None:
    wide = data(tokens, 2 * inter + 3, dtype=dtype, seed=inter, scale=4.0)
    x = wide[:, :2 * inter]  # rows 2I + 3 apart
    out = torch.empty(tokens, inter, dtype=dtype, device=DEVICE)
    ops.silu_and_mul(out, x)
    gate, up = x[:, :inter], x[:, inter:]
    close(out, F.silu(gate) * up, float32_rtol=1e-5)


def test_the_layers_take_the_triton_ops_where_the_triton_path_serves(monkeypatch) -> None:
    calls = []
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    for module in (norm, rotary, activation):  # the CPU's C++ kernels would serve these first
        monkeypatch.setattr(module, "fused_ops_for", lambda *tensors: None)
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "1")
    dtype = torch.float16
    layer = make_norm(RMSNorm, 32, dtype)
    x, residual = data(3, 32, dtype=dtype, seed=5), data(3, 32, dtype=dtype, seed=6)
    out, new_residual = layer(x.clone(), residual.clone())
    close(out, layer.reference(x + residual))
    close(layer(x), layer.reference(x))
    rope = make_rotary(16, dtype)
    q, k = data(3, 2, 16, dtype=dtype, seed=7, scale=1.0), data(3, 1, 16, dtype=dtype, seed=8, scale=1.0)
    positions = torch.tensor([0, 5, 9], device=DEVICE)
    got = rope(positions, q.clone(), k.clone())
    for rotated, before in zip(got, (q, k), strict=True):
        assert_rotation_within_rounding(rotated, before, rope, positions)
    close(activation.silu_and_mul(data(2, 64, dtype=dtype, seed=9)),
          (lambda t: F.silu(t[:, :32]) * t[:, 32:])(data(2, 64, dtype=dtype, seed=9)))
    assert calls == ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]
    monkeypatch.setenv("REDSERVE_TRITON_ATTENTION", "0")
    calls.clear()
    layer(x)
    assert calls == []


def test_the_smoke_test_runs_every_op_here() -> None:
    ops.smoke_test(DEVICE)
