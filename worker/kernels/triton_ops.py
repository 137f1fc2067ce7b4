"""The decoder layer's small ops on CUDA as Triton kernels, one launch each where torch takes 4-12: RMSNorm
(Llama's and Gemma's) with the residual add folded in, RoPE in place on the q and k views of the qkv output,
and SiLU-and-mul of the packed gate/up projection.

Imports triton at the top: load it through ``worker.layers.fused_ops.triton_ops_for``, which returns None
where triton is missing or the kernels failed their smoke test, and the callers keep their torch path.
Under ``TRITON_INTERPRET=1`` they run on CPU tensors (the tests).

Rules:
- Rounding follows the Hugging Face op sequence in the tensor's dtype, as the CPU kernels do
  (csrc/fused_ops.cpp): the residual sum is rounded to the dtype; Llama's norm rounds x * rstd to the dtype
  before the weight multiply, Gemma's multiplies by (1 + w) in float32 and rounds once; RoPE rounds each
  product and then the sum (under the interpreter bit for bit as torch; on a GPU the compiler may fuse a
  product into the sum, an FMA, so results stay within the sequence's rounding error but not bit-exact); SiLU rounds the activation before the multiply. Sums of squares run in float32
  in the kernel's own order (float32 agrees with torch to a few ulps, narrow dtypes to one ulp).
- Rows may be strided (``row stride`` and, for [T, heads, d] views, a head stride); the last dim is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, res_ptr, w_ptr, eps, offset, n_cols, heads,
                     x_stride_t, x_stride_h, out_stride_t, out_stride_h, res_stride_t,
                     ADD_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x_at = x_ptr + t * x_stride_t + h * x_stride_h + cols
    x = tl.load(x_at, mask=ok, other=0.0)
    dtype = x.dtype
    if ADD_RESIDUAL:
        res_at = res_ptr + t * res_stride_t + cols
        x = (x.to(tl.float32) + tl.load(res_at, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_at, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if GEMMA:
        y = (xf * rstd * (offset + w.to(tl.float32))).to(dtype)
    else:
        y = ((xf * rstd).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + cols, y, mask=ok)


@triton.jit
def _rotate_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, heads, half, stride_t, stride_h,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t, h = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    ok = cols < half
    pos = tl.load(positions_ptr + t).to(tl.int64)
    x1_at = x_ptr + t * stride_t + h * stride_h + cols
    x1 = tl.load(x1_at, mask=ok, other=0.0)
    x2 = tl.load(x1_at + half, mask=ok, other=0.0)
    dtype = x1.dtype
    c = tl.load(cos_ptr + pos * half + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * half + cols, mask=ok, other=0.0).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    # each product rounded to the dtype, then the sum: two torch ops
    y1 = ((a * c).to(dtype).to(tl.float32) - (b * s).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)).to(dtype)
    tl.store(x1_at, y1, mask=ok)
    tl.store(x1_at + half, y2, mask=ok)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * out_stride + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, row stride, head stride) of a [T, d] or [T, heads, d] tensor with a contiguous last dim."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    """``out = norm(x)`` over the last dim; x and out [T, d] or [T, heads, d] (strided rows allowed)."""
    rows, heads, stride_t, stride_h = _rows(x)
    _, _, out_t, out_h = _rows(out)
    if rows:
        _rms_norm_kernel[(rows,)](out, x, x, weight, eps, offset, x.shape[-1], heads, stride_t, stride_h,
                                  out_t, out_h, 0, ADD_RESIDUAL=False, GEMMA=offset != 0.0,
                                  BLOCK=triton.next_power_of_2(x.shape[-1]))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: float) -> None:
    """In place: ``residual = x + residual``, then ``x = norm(residual)``; both [T, d], rows contiguous."""
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x, residual, weight, eps, offset, x.shape[-1], 1, x.stride(0), 0,
                                        x.stride(0), 0, residual.stride(0), ADD_RESIDUAL=True,
                                        GEMMA=offset != 0.0, BLOCK=triton.next_power_of_2(x.shape[-1]))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, d] and k [T, Hk, d] in place (neox halves) by rows ``positions`` of cos and sin
    [P, d / 2] (contiguous)."""
    half = q.shape[-1] // 2
    for x in (q, k):
        rows, heads, stride_t, stride_h = _rows(x)
        if rows:
            _rotate_kernel[(rows,)](x, positions, cos, sin, heads, half, stride_t, stride_h,
                                    BLOCK=triton.next_power_of_2(half))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = silu(x[:, :I]) * x[:, I:]`` for x [T, 2I] (strided rows allowed), out [T, I]."""
    n = x.shape[1] // 2
    block = min(1024, triton.next_power_of_2(n))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](out, x, n, x.stride(0), out.stride(0), BLOCK=block)


def smoke_test(device: torch.device, dtype: torch.dtype = torch.float16) -> None:
    """Compile and run every kernel once on ``device``; raises if one fails to or gives a non-finite value
    (`worker.layers.fused_ops.triton_ops_for` then keeps the torch path)."""
    x = torch.linspace(-2, 2, 3 * 40, device=device).to(dtype).view(3, 40)
    weight = torch.ones(40, dtype=dtype, device=device)
    out = torch.empty_like(x)
    rms_norm(out, x, weight, 1e-6, 0.0)
    fused_add_rms_norm(x.clone(), x.clone(), weight, 1e-6, 1.0)
    qkv = x.repeat(1, 2).view(3, 4, 20)
    cos = torch.ones(8, 10, dtype=dtype, device=device)
    rotary_embedding(torch.tensor([0, 3, 7], device=device), qkv[:, :2], qkv[:, 2:3], cos, cos)
    act = torch.empty(3, 20, dtype=dtype, device=device)
    silu_and_mul(act, x)
    if not all(torch.isfinite(t).all() for t in (out, qkv, act)):
        raise RuntimeError("a Triton layer op gave non-finite values on its smoke test")
