"""The Llama decoder layers as a flat list of kernel calls, for CPU steps that the C++ kernels serve whole.

Why: at one stream a decode step of a small model is mostly Python. SmolLM2-135M (30 layers, Q4_1 blocks,
bfloat16, one thread of a 2-core AMD EPYC) spent 18 ms a step, of which the kernels were about 12 ms: the
rest went to ``nn.Module`` calls, attribute lookups, dtype and device checks and the dispatch to a kernel,
each repeated for every op of every layer (about 400 Python calls a step). Here each layer is bound once
to its weights and kernels, and a step runs each op as one direct kernel call.

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
from worker.parallel_state import tp_group

Linear = Callable[[torch.Tensor], torch.Tensor]


def _bound_linear(proj: ColumnParallelLinear | RowParallelLinear) -> Linear:
    """``x -> proj(x)`` for 2-D contiguous x, with TP = 1 (no all-reduce)."""
    weight, gemm = proj.weight, proj.gemm
    if isinstance(gemm, QuantizedGemm):
        return bound_quant_linear(weight, proj.bias)
    if isinstance(proj, RowParallelLinear) and proj.bias is not None:
        bias = proj.bias
        return lambda x: gemm.matmul(x, weight).add_(bias)
    bias = proj.bias
    return lambda x: gemm.matmul(x, weight, bias)


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
        head_split=[attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
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
        tokens = hidden.shape[0]
        out = act = None  # attention's and the activation's outputs, reused by every layer of the same shapes
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            norm = layer.input_norm
            if residual is None:
                residual, hidden = hidden, torch.empty_like(hidden)
                rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            else:
                add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            q, k, v = layer.qkv(hidden).view(tokens, -1, layer.head_dim).split(layer.head_split, dim=1)
            if layer.q_norm is not None:
                rms_norm(q, q, layer.q_norm.weight, layer.q_norm.eps, layer.q_norm.offset)
                rms_norm(k, k, layer.k_norm.weight, layer.k_norm.eps, layer.k_norm.offset)
            rotary(positions, q, k, layer.cos, layer.sin)
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            write_kv(k_cache, v_cache, slots, k, v)
            if out is None or out.shape != q.shape:
                out = torch.empty(q.shape, dtype=q.dtype)
            paged(out, q, k_cache, v_cache, tables, starts, lens, contexts, block, layer.scale, layer.window,
                  layer.softcap)
            hidden = layer.o(out.view(tokens, -1))
            norm = layer.post_norm
            add_rms_norm(hidden, residual, norm.weight, norm.eps, norm.offset)
            gate_up = layer.gate_up(hidden)
            if act is None or act.shape[1] != gate_up.shape[1] // 2:
                act = torch.empty(tokens, gate_up.shape[1] // 2, dtype=gate_up.dtype)
            ops.silu_and_mul(act, gate_up)
            hidden = layer.down(act)
        return hidden, residual
