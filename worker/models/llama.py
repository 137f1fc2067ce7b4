"""Llama-family decoder (Llama, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU, optional QKV bias,
optional tied embeddings, per-layer sliding windows, over a paged KV cache. Weight names follow the
Hugging Face checkpoints. Qwen3, Gemma 2/3 and Phi-3 subclass these pieces. Under pipeline parallelism a
model holds only its stage's modules (``worker.pipeline``).

Rules:
- A layer's sliding window comes from ``config.layer_types`` when the config has it (Qwen2/3, Gemma),
  else from ``config.sliding_window`` for every layer (Mistral); None means full attention.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from worker.layers.activation import silu_and_mul
from worker.layers.attention import AttentionMetadata, PagedAttention
from worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.models.llama_kernel_path import LlamaKernelPath
from worker.parallel_state import pp_group, tp_group
from worker.pipeline import MissingLayer, local_layers


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The attention window of layer ``layer_idx`` (see the module rules)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    """Packed q/k/v projection, RoPE and paged attention. Reads the optional Gemma knobs from the config
    (``query_pre_attn_scalar``, ``attn_logit_softcapping``); ``qk_norm`` adds per-head q/k norms that run
    before RoPE (Qwen3, Gemma 3)."""

    def __init__(self, config, dtype: torch.dtype, rotary: RotaryEmbedding, layer_idx: int,
                 qk_norm: type[RMSNorm] | None = None):
        super().__init__()
        tp = tp_group().size
        self.head_dim = head_dim_of(config)
        num_kv = config.num_key_value_heads or config.num_attention_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [
            ("q", config.num_attention_heads * self.head_dim),
            ("k", num_kv * self.head_dim),
            ("v", num_kv * self.head_dim),
        ], bias=bias, dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False), dtype=dtype)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = num_kv // tp
        self.rotary = rotary
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=scalar ** -0.5 if scalar else None,
                                   sliding_window=sliding_window_of(config, layer_idx),
                                   softcap=getattr(config, "attn_logit_softcapping", None))
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with the default ``act_and_mul``, GeGLU with
    ``gelu_tanh_and_mul`` (``worker.layers.activation``)."""

    def __init__(self, config, dtype: torch.dtype, act_and_mul=silu_and_mul):
        super().__init__()
        self.act_and_mul = act_and_mul
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [("gate", inter), ("up", inter)],
                                                 bias=getattr(config, "mlp_bias", False), dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=getattr(config, "mlp_bias", False),
                                           dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    qk_norm: type[RMSNorm] | None = None

    def __init__(self, config, dtype: torch.dtype, rotary: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, rotary, layer_idx, self.qk_norm)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """(hidden, residual) in and out, vLLM style: the sum of the two is the layer's output stream, and
        each norm folds the pending residual add in (``RMSNorm(x, residual)``). ``residual`` None: first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def is_plain_layer(layer: nn.Module) -> bool:
    """Whether ``layer`` computes exactly what `LlamaDecoderLayer` does with RMSNorms and SiLU (its class or a
    subclass that only sets ``qk_norm``): what `LlamaKernelPath` may bind."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (layer.input_layernorm, layer.post_attention_layernorm) if attn is not None else ()
    return (type(layer).forward is LlamaDecoderLayer.forward and attn is not None and mlp is not None
            and type(attn).forward is LlamaAttention.forward and type(mlp).forward is LlamaMLP.forward
            and mlp.act_and_mul is silu_and_mul
            and all(type(n).forward is RMSNorm.forward for n in norms)
            and all(n is None or type(n).forward is RMSNorm.forward for n in (attn.q_norm, attn.k_norm)))


class LlamaForCausalLM(nn.Module):
    """Maps checkpoint names to packed layers: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""

    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    layer_cls = LlamaDecoderLayer

    def __init__(self, config, dtype: torch.dtype, device: torch.device, max_positions: int):
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, device, dtype)
        self.build_stage(config, dtype, lambda i: self.layer_cls(config, dtype, rotary, i),
                         lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def build_stage(self, config, dtype: torch.dtype, make_layer, make_norm) -> None:
        """The modules this pipeline stage holds (``worker.pipeline``); the others are ``MissingLayer``s."""
        pp = pp_group()
        self.layer_range = local_layers(config.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) if pp.is_first
                             else MissingLayer())
        self.layers = nn.ModuleList(make_layer(i) if i in self.layer_range else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.norm = make_norm() if pp.is_last else MissingLayer()
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype) if pp.is_last else MissingLayer()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """This stage's layers. The first stage embeds ``input_ids``; later stages continue from the
        previous stage's ``intermediate`` (hidden, residual). The last stage returns the final hidden stream
        before the last norm (``compute_logits`` applies it to the rows it needs); the others return
        (hidden, residual) for the next stage."""
        hidden, residual = (self.embed(input_ids), None) if intermediate is None else intermediate
        kernel_path = self.kernel_path()
        if kernel_path is not None and kernel_path.serves(meta, hidden):
            hidden, residual = kernel_path.forward(positions, hidden, residual, kv_caches, meta)
        else:
            for i, kv_cache in zip(self.layer_range, kv_caches, strict=True):
                hidden, residual = self.layers[i](positions, hidden, residual, kv_cache, meta)
        if not pp_group().is_last:
            return hidden, residual
        return hidden + residual

    def kernel_path(self) -> LlamaKernelPath | None:
        """This stage's layers bound to the CPU kernels (`worker.models.llama_kernel_path`), built at the first
        call; None where that path cannot serve the model, or with ``REDSERVE_KERNEL_PATH=0``."""
        if not hasattr(self, "_kernel_path"):
            enabled = os.environ.get("REDSERVE_KERNEL_PATH", "1") != "0"
            layers = [self.layers[i] for i in self.layer_range]
            plain = enabled and all(is_plain_layer(layer) for layer in layers)
            self._kernel_path = LlamaKernelPath.build(layers) if plain else None
        return self._kernel_path

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The logits of these rows, float32; with ``float32=False`` in the LM head's dtype where that is already
        their final value (a greedy batch's argmax reads them as they are: no widened copy of [rows, vocab])."""
        logits = self.lm_head.compute_logits(self.norm(hidden))
        return logits.float() if float32 else logits

    def resolve_weight(self, name: str) -> tuple[nn.Module, nn.Parameter, str | None] | None:
        """The module, parameter and shard id that a checkpoint tensor loads into; None to skip it."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in self.packed:
            parts[-2], shard = self.packed[parts[-2]]
        module_path, param_name = parts[:-1], parts[-1]
        module: nn.Module = self
        for part in module_path:
            if not hasattr(module, part):
                return None
            module = getattr(module, part)
        param = getattr(module, param_name, None)
        if not isinstance(param, nn.Parameter):
            return None
        return module, param, shard
