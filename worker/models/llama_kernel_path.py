"""The Llama decoder layers as a flat list of kernel calls, for CPU steps that the C++ kernels serve whole.

Why: at one stream a decode step of a small model is mostly Python. SmolLM2-135M (30 layers, Q4_1 blocks,
bfloat16, one thread of a 2-core AMD EPYC) spent 18 ms a step, of which the kernels were about 12 ms: the
rest went to ``nn.Module`` calls, attribute lookups, dtype and device checks and the dispatch to a kernel,
each repeated for every op of every layer (about 400 Python calls a step). Here each layer is bound once
to its weights and kernels, and a step runs each op as one direct kernel call. The projections and attention
write into buffers allocated once a step (`_StepBuffers`), with the qkv output's q/k/v views made once, rather
than four new tensors and a view-and-split (~10 us) every layer. Measured offline (the engine in one process,
bfloat16, batch 1, steps alternating between the two forwards, 596 steps each, p50; 2-core AMD EPYC Zen 4, 6 Dec
2026): SmolLM2 Q4_1 7.12 -> 6.60 ms, Q8_0 8.24 -> 7.67 ms, the tiny model 4.10 -> 3.87 ms (batch 16 9.47 -> 9.11,
batch 64 level: its projections take the oneDNN path, which allocates its own output).

Rules:
- Serves a step only when `LlamaKernelPath.serves` says so: CPU, TP = 1, float32 or bfloat16, the
  ``fused_ops`` and ``paged_attention`` kernels built, and every row of the step attended by the paged
  kernel (``meta.paged`` set, no torch decode rows, no SDPA prefill chunks). Other steps, and every other
  device, run the modules as before.
- Binds only layers whose forwards are exactly `LlamaDecoderLayer`'s, `LlamaAttention`'s (optional per-head
  q/k norms: Qwen3) and `LlamaMLP`'s with SiLU (``worker.models.llama.is_plain_layer``); a model with any
  other layer gets no kernel path (Gemma, Phi-3: their own forwards).
- Same kernels, same arguments, same order as the modules' own paths: the tokens are the modules' tokens
  (tests/test_llama_kernel_path.py holds the logits equal).
- Bound at the first step it serves, after loading: the weights of a loaded model are never replaced.
- A dense projection of up to ``small_gemm.MAX_ROWS`` rows calls the small-batch kernel the module would
  (``small_linear``) into its buffer; more rows go through the module's gemm (a new tensor), as do quantized
  ones past their kernel's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from worker.layers.attention import AttentionMetadata, paged_attention_kernel
from worker.layers.fused_ops import fused_ops_for
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.quantized_linear import QuantizedGemm, bound_quant_linear
from worker.layers.small_gemm import KERNEL_DTYPES, MAX_ROWS, small_gemm_kernel
from worker.parallel_state import tp_group

Linear = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
"""``(x, out) -> proj(x)``: written into ``out`` (a [rows, out_features] buffer of x's dtype, or None) where the
kernel that serves these rows can, else a new tensor; callers use what it returns."""


def _bound_linear(proj: ColumnParallelLinear | RowParallelLinear) -> Linear:
    """``proj(x)`` for 2-D contiguous x, with TP = 1 (no all-reduce)."""
    weight, gemm, bias = proj.weight, proj.gemm, proj.bias
    if isinstance(gemm, QuantizedGemm):
        return bound_quant_linear(weight, bias)
    row_bias = isinstance(proj, RowParallelLinear) and bias is not None  # added after the product, as the module
    kernel = (small_gemm_kernel() if weight.device.type == "cpu" and weight.dtype in KERNEL_DTYPES
              and weight.is_contiguous() and (bias is None or bias.dtype == weight.dtype) else None)

    def linear(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if kernel is not None and out is not None and x.shape[0] <= MAX_ROWS and x.dtype == weight.dtype:
            kernel.small_linear(out, x, weight, None if row_bias else bias)  # the module's own small-batch kernel
            return out.add_(bias) if row_bias else out
        return gemm.matmul(x, weight).add_(bias) if row_bias else gemm.matmul(x, weight, bias)

    return linear


@dataclass
class _Norm:
    weight: torch.Tensor
    eps: float
    offset: float

    @classmethod
    def of(cls, norm: RMSNorm) -> _Norm:
        return cls(norm.weight, norm.eps, norm.weight_offset)


@dataclass
class _Layer:
    input_norm: _Norm
    post_norm: _Norm
    q_norm: _Norm | None
    k_norm: _Norm | None
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    head_split: list[int]  # q, k, v heads of the qkv output seen as [tokens, heads, head_dim]
    intermediate: int  # the MLP's width (gate_up gives twice that)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float
    window: int
    softcap: float


def _bind_layer(layer) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        input_norm=_Norm.of(layer.input_layernorm), post_norm=_Norm.of(layer.post_attention_layernorm),
        q_norm=_Norm.of(attn.q_norm) if attn.q_norm is not None else None,
        k_norm=_Norm.of(attn.k_norm) if attn.k_norm is not None else None,
        qkv=_bound_linear(attn.qkv_proj), o=_bound_linear(attn.o_proj),
        gate_up=_bound_linear(mlp.gate_up_proj), down=_bound_linear(mlp.down_proj),
        head_split=[attn.num_heads, attn.num_kv_heads, attn.num_kv_heads],
        intermediate=mlp.down_proj.in_per_rank, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim, cos=attn.rotary.cos, sin=attn.rotary.sin, scale=attn.attn.scale,
        window=attn.attn.sliding_window or 0, softcap=attn.attn.softcap or 0.0)


class LlamaKernelPath:
    """A model's decoder layers bound to the CPU kernels (see the module rules)."""

    def __init__(self, layers: list[_Layer], ops: ModuleType, attention: ModuleType):
        self.layers, self.ops, self.attention = layers, ops, attention

    @classmethod
    def build(cls, model_layers: list) -> LlamaKernelPath | None:
        """The bound layers (each one checked plain by the caller: `worker.models.llama.is_plain_layer`), or
        None where the kernel path cannot serve them."""
        if tp_group().size != 1 or not model_layers:
            return None
        probe = model_layers[0].input_layernorm.weight
        if probe.device.type != "cpu" or probe.dtype not in (torch.float32, torch.bfloat16):
            return None
        ops, attention = fused_ops_for(probe), paged_attention_kernel()
        if ops is None or attention is None:
            return None
        return cls([_bind_layer(layer) for layer in model_layers], ops, attention)

    @staticmethod
    def serves(meta: AttentionMetadata, hidden: torch.Tensor) -> bool:
        """Whether the paged kernel attends every row of this step (and the stream is on the CPU)."""
        return (meta.paged is not None and meta.unified is None and not meta.num_decodes and not meta.prefills
                and hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.is_contiguous())

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) through every bound layer, as the modules compute it."""
        ops, attention = self.ops, self.attention
        rms_norm, add_rms_norm, rotary = ops.rms_norm, ops.fused_add_rms_norm, ops.rotary_embedding
        write_kv, paged = attention.write_kv, attention.paged_attention
        batch, slots = meta.paged, meta.slot_mapping
        tables, starts, lens, contexts, block = (batch.block_tables, batch.query_start, batch.query_lens,
                                                 batch.context_lens, batch.block_size)
        positions = positions.long().contiguous()
        buf = _StepBuffers.of(self.layers[0], hidden)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            norm = layer.input_norm
            if residual is None:
                residual, hidden = hidden, buf.hidden
                rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            else:
                add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            qkv = layer.qkv(hidden, buf.qkv)
            q, k, v = buf.q_k_v if qkv is buf.qkv else buf.split(qkv, layer)
            if layer.q_norm is not None:
                rms_norm(q, q, layer.q_norm.weight, layer.q_norm.eps, layer.q_norm.offset)
                rms_norm(k, k, layer.k_norm.weight, layer.k_norm.eps, layer.k_norm.offset)
            rotary(positions, q, k, layer.cos, layer.sin)
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            write_kv(k_cache, v_cache, slots, k, v)
            paged(buf.attention, q, k_cache, v_cache, tables, starts, lens, contexts, block, layer.scale,
                  layer.window, layer.softcap)
            hidden = layer.o(buf.attention_rows, buf.hidden)
            norm = layer.post_norm
            add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            gate_up = layer.gate_up(hidden, buf.gate_up)
            ops.silu_and_mul(buf.act, gate_up)
            hidden = layer.down(buf.act, buf.hidden)
        return hidden, residual


@dataclass
class _StepBuffers:
    """The outputs every layer of one step writes in turn, allocated once a step instead of once a layer (and the
    q/k/v views of the qkv output made once): each is read before the next layer writes it. ``hidden`` takes the
    first norm's output and every o and down projection's: the one before is consumed (by qkv, by gate_up) by
    then. A step's buffers are its own, so what a step returns (the hidden stream, or a pipeline stage's send)
    is never overwritten by the next."""

    hidden: torch.Tensor  # [tokens, hidden size]
    qkv: torch.Tensor  # [tokens, (heads + 2 kv heads) x head dim]
    q_k_v: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # views of qkv: [tokens, heads, head dim] each
    attention: torch.Tensor  # [tokens, heads, head dim]
    attention_rows: torch.Tensor  # the same, [tokens, heads x head dim]
    gate_up: torch.Tensor  # [tokens, 2 x intermediate]
    act: torch.Tensor  # [tokens, intermediate]

    @classmethod
    def of(cls, layer: _Layer, hidden: torch.Tensor) -> _StepBuffers:
        tokens, dtype = hidden.shape[0], hidden.dtype
        qkv = torch.empty(tokens, sum(layer.head_split) * layer.head_dim, dtype=dtype)
        attention = torch.empty(tokens, layer.num_heads, layer.head_dim, dtype=dtype)
        gate_up = torch.empty(tokens, 2 * layer.intermediate, dtype=dtype)
        return cls(torch.empty_like(hidden), qkv, cls.split(qkv, layer), attention,
                   attention.view(tokens, -1), gate_up, torch.empty(tokens, layer.intermediate, dtype=dtype))

    @staticmethod
    def split(qkv: torch.Tensor, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.view(qkv.shape[0], -1, layer.head_dim).split(layer.head_split, dim=1)
