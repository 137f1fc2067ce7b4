"""Llama-family decoder (Llama, Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU, optional QKV bias,
optional tied embeddings, over a paged KV cache. Weight names follow the Hugging Face checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.attention import AttentionMetadata, PagedAttention
from worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker.layers.rotary import RotaryEmbedding
from worker.parallel_state import tp_group


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        tp = tp_group().size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
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
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [("gate", inter), ("up", inter)],
                                                 bias=getattr(config, "mlp_bias", False), dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=getattr(config, "mlp_bias", False),
                                           dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, rotary)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """Maps checkpoint names to packed layers: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""

    packed = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
              "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, config, dtype: torch.dtype, device: torch.device, max_positions: int):
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_positions, device, dtype)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(self.norm(hidden)).float()

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
