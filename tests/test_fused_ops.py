"""Fused decoder ops (worker/kernels/csrc/fused_ops.cpp) against their torch references: RMSNorm with
and without the residual add (Llama and Gemma rounding), RoPE in place on strided q/k views, the gated
activations; odd sizes, float32 and bfloat16. Then the tiny model with the kernels vs without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from tests.ulp import assert_within_ulps
from worker import sampler as sampler_module
from worker.layers import activation as activation_module
from worker.layers import norm as norm_module
from worker.layers import rotary as rotary_module
from worker.layers.activation import gelu_tanh_and_mul, silu_and_mul
from worker.layers.fused_ops import fused_ops_for
from worker.layers.norm import GemmaRMSNorm, RMSNorm
from worker.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


def assert_norm_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The kernel sums squares in another order than torch's mean (which order depends on the CPU's vector
    width): float32 agrees to a few ulps, and bfloat16, rounded after that sum, to one bfloat16 ulp."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        assert_within_ulps(out, expected, ulps=1)


@pytest.fixture(scope="module")
def ops():
    module = fused_ops_for(torch.empty(1))
    if module is None:
        pytest.skip("the fused_ops kernel does not build here (no compiler); the torch path serves")
    return module


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm / GemmaRMSNorm, written out."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def make_norm(cls: type[RMSNorm], size: int, dtype: torch.dtype) -> RMSNorm:
    norm = cls(size, 1e-5, dtype)
    norm.weight.data = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("tokens,size", [(1, 64), (7, 37), (33, 129), (64, 512)])
def test_rms_norm_kernel_matches_reference_and_hf(ops, cls, dtype, tokens, size) -> None:
    norm = make_norm(cls, size, dtype)
    x = (torch.randn(tokens, size, generator=torch.Generator().manual_seed(tokens)) * 3).to(dtype)
    out = norm(x)
    assert out.data_ptr() != x.data_ptr()
    assert_norm_close(out, norm.reference(x))
    assert_norm_close(out, hf_rms_norm(x, norm.weight, norm.eps, cls is GemmaRMSNorm))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("tokens,size", [(1, 64), (5, 93), (64, 512)])
def test_fused_add_rms_norm_matches_add_then_norm(ops, cls, dtype, tokens, size) -> None:
    norm = make_norm(cls, size, dtype)
    g = torch.Generator().manual_seed(size)
    x, residual = torch.randn(tokens, size, generator=g).to(dtype), torch.randn(tokens, size, generator=g).to(dtype)
    expected_residual = x + residual
    expected = hf_rms_norm(expected_residual, norm.weight, norm.eps, cls is GemmaRMSNorm)
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)  # one rounding of one sum: exact
    assert_norm_close(out, expected)


def test_bfloat16_norm_kernel_rounds_as_hugging_face_does(ops) -> None:
    """Nearly every bfloat16 value is Hugging Face's to the bit: x * rstd rounded to bfloat16, then times the
    weight and rounded again (Llama); only a value whose rstd differs in its last float32 bit may round the other
    way. A kernel that skipped the first rounding (one rounding of the float32 product) differs in ~20% of them."""
    norm = make_norm(RMSNorm, 576, torch.bfloat16)
    x = (4 * torch.randn(64, 576, generator=torch.Generator().manual_seed(5))).bfloat16()
    out = norm(x)
    expected = hf_rms_norm(x, norm.weight, norm.eps, False)
    assert (out.view(torch.int16) == expected.view(torch.int16)).float().mean() > 0.999


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(ops, dtype) -> None:
    """Qwen3's q/k norms run on [T, heads, d] views of the packed qkv output."""
    norm = make_norm(RMSNorm, 16, dtype)
    qkv = torch.randn(9, 3 * 4 * 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, :64].view(9, 4, 16)
    assert not q.is_contiguous()
    assert_norm_close(norm(q), hf_rms_norm(q, norm.weight, norm.eps, False))


def test_norm_uses_the_torch_path_without_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(norm_module, "fused_ops_for", lambda *tensors: None)
    norm = make_norm(RMSNorm, 48, torch.float32)
    x, residual = torch.randn(3, 48), torch.randn(3, 48)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(out, hf_rms_norm(x + residual, norm.weight, norm.eps, False), rtol=0, atol=0)


def make_rotary(head_dim: int, max_positions: int, dtype: torch.dtype) -> RotaryEmbedding:
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=10000.0)
    return RotaryEmbedding(config, head_dim, max_positions, torch.device("cpu"), dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    cos, sin = torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 8, 4, 64), (7, 3, 3, 18), (37, 8, 1, 32),
                                                            (64, 16, 2, 128)])
def test_rope_kernel_matches_reference_and_hf_in_place(ops, dtype, tokens, heads, kv_heads, head_dim) -> None:
    rotary = make_rotary(head_dim, 300, dtype)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 300, (tokens,), generator=g)
    ref_q, ref_k = rotary.reference(positions, q, k)
    hf_q, hf_k = (hf_rope(t, rotary.cos[positions], rotary.sin[positions]) for t in (q, k))
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place, no copies
    for out, ref, hf in ((out_q, ref_q, hf_q), (out_k, ref_k, hf_k)):
        # Elementwise, rounding each product and the sum as torch's ops do, no contraction: exact on any CPU.
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(out, hf, rtol=0, atol=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_rope_rejects_positions_past_the_table(ops) -> None:
    rotary = make_rotary(8, 10, torch.float32)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="position out of range"):
        rotary(torch.tensor([3, 10]), q, k)


# float32 and bfloat16 SiLU run in the kernel where it builds: its exp is within 2 ulp of torch's, so the float32
# product is within a few ulp, and a bfloat16 one within its last bit (an activation a float32 ulp from a
# rounding boundary may round the other way: an ulp of the activation, then of the product); float16 (torch's
# ops) is exact.
SILU_TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 1e-30}, torch.bfloat16: {"rtol": 2 ** -6, "atol": 1e-30}}


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 1408), (5, 77), (64, 1408)])
def test_gated_activations_match_act_then_mul(dtype, tokens, inter) -> None:
    x = (4 * torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate, up = x[:, :inter], x[:, inter:]
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, **SILU_TOLERANCE.get(dtype, {"rtol": 0, "atol": 0}))
    torch.testing.assert_close(gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, 16, 24])  # 17, 33 and 41 values: 16- and 8-lane passes and a scalar tail
def test_silu_kernel_at_the_edges_of_exp(ops, dtype, extra) -> None:
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 88.5, -88.5, 100.0, -100.0, 1e30,
                         float("inf"), float("nan"), 3.0, -3.0] + torch.linspace(-9, 9, extra).tolist()).to(dtype)
    up = torch.linspace(-2, 2, gate.numel()).to(dtype)
    out = torch.empty(1, gate.numel(), dtype=dtype)
    ops.silu_and_mul(out, torch.cat([gate, up]).unsqueeze(0))
    expected = F.silu(gate) * up
    torch.testing.assert_close(out[0], expected, **SILU_TOLERANCE[dtype], equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_kernel_on_rows_of_a_wider_tensor(ops, dtype) -> None:
    wide = torch.randn(6, 2 * 40 + 5).to(dtype)
    x = wide[:, :80]  # rows 85 apart: the kernel follows the row stride
    out = torch.empty(6, 40, dtype=dtype)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :40]) * x[:, 40:], **SILU_TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.silu_and_mul(out.half(), x.half())
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.silu_and_mul(out, x.half())


def test_bfloat16_silu_kernel_rounds_as_torch_does(ops) -> None:
    """Nearly every bfloat16 value is torch's to the bit (the activation rounded, then the product): a kernel that
    skipped the activation's rounding would differ on about half of them."""
    x = (4 * torch.randn(64, 2 * 1536, generator=torch.Generator().manual_seed(3))).bfloat16()
    out = torch.empty(64, 1536, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    expected = F.silu(x[:, :1536]) * x[:, 1536:]
    assert (out.view(torch.int16) == expected.view(torch.int16)).float().mean() > 0.999


# --- argmax for the sampler -------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 17, 8192, 49152])
def test_argmax_kernel_matches_torch(ops, vocab) -> None:
    x = torch.randn(13, vocab, generator=torch.Generator().manual_seed(vocab))
    out = torch.empty(13, dtype=torch.int64)
    ops.argmax_rows(out, x)
    assert torch.equal(out, x.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 7, 9, 8192, 49152])
def test_bfloat16_argmax_kernel_is_its_float32_copys(ops, vocab) -> None:
    """bfloat16 logits (a greedy batch's, left in the model's dtype) widen exactly, so the row's answer is the
    float32 copy's, ties included (bfloat16 rounding makes many)."""
    x = (torch.randn(13, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).bfloat16()
    x[0, vocab // 2] = x[0, vocab - 1] = 100.0  # a tie: the first index wins
    x[1, vocab - 1] = float("nan")
    out = torch.empty(13, dtype=torch.int64)
    ops.argmax_rows(out, x)
    assert torch.equal(out, x.float().argmax(dim=-1))
    assert out[0] == (vocab // 2 if vocab > 1 else 0) and out[1] == vocab - 1


def test_argmax_kernel_ties_nan_and_infinities(ops) -> None:
    x = torch.randn(6, 21)
    x[0, 3] = x[0, 17] = 50.0  # a tie: the first index wins
    x[1, 9] = x[1, 20] = float("nan")  # NaN counts as the maximum: the first NaN
    x[1, 2] = 50.0
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 19] = float("inf")
    x[4, 20] = float("nan")  # a NaN in the scalar tail
    x[5, 0] = 50.0
    out = torch.empty(6, dtype=torch.int64)
    ops.argmax_rows(out, x)
    assert out.tolist() == x.argmax(dim=-1).tolist() == [3, 9, 0, 19, 20, 0]


def test_argmax_kernel_follows_the_row_stride(ops) -> None:
    wide = torch.randn(5, 300)
    x = wide[:, 7:270]
    out = torch.empty(5, dtype=torch.int64)
    ops.argmax_rows(out, x)
    assert torch.equal(out, x.argmax(dim=-1))


def test_float16_and_other_devices_take_the_torch_path() -> None:
    assert fused_ops_for(torch.empty(1, dtype=torch.float16)) is None
    assert fused_ops_for(torch.empty(1), torch.empty(1, device="meta")) is None


# --- the tiny model with and without the kernels ------------------------------------------------------------


def test_tiny_model_same_tokens_and_logprobs_with_and_without_kernels(ops, tiny_llama_dir, monkeypatch) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=16, num_kv_blocks=64)
    prompts = [[10 + i for i in range(7)], [200 + 3 * i for i in range(21)]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    try:
        with_kernels = llm.generate(prompts, params)
        monkeypatch.setattr(norm_module, "fused_ops_for", lambda *tensors: None)
        monkeypatch.setattr(rotary_module, "fused_ops_for", lambda *tensors: None)
        monkeypatch.setattr(activation_module, "fused_ops_for", lambda *tensors: None)
        monkeypatch.setattr(sampler_module, "fused_ops_for", lambda *tensors: None)
        without = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for a, b in zip(with_kernels, without, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = [*zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True),
                 *zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)]
        assert len(pairs) > 6
        for entry_a, entry_b in pairs:
            assert entry_a[0] == pytest.approx(entry_b[0], abs=1e-4)
