"""Gemma 2 and Gemma 3 (text-only ``Gemma3ForCausalLM``) on the Llama pieces.

Rules:
- Norms scale by (1 + w) (``GemmaRMSNorm``); every layer has four: before and after attention, before
  and after the MLP (``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``).
- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype, as Hugging Face does.
- The MLP is GeGLU with the tanh-approximated GELU (``hidden_activation: gelu_pytorch_tanh``).
- Attention scale is ``query_pre_attn_scalar ** -0.5``; Gemma 2 caps attention scores
  (``attn_logit_softcapping``); both cap the final logits when ``final_logit_softcapping`` is set.
- Sliding and full layers alternate by ``config.layer_types``. Gemma 3 adds per-head q/k norms and a
  separate RoPE per layer type (``rope_parameters[layer_type]``: local base frequency for sliding layers).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.activation import gelu_tanh_and_mul
from worker.layers.norm import GemmaRMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, rotary: RotaryEmbedding, layer_idx: int):
        super().__init__()
        qk_norm = GemmaRMSNorm if config.model_type == "gemma3_text" else None
        self.self_attn = LlamaAttention(config, dtype, rotary, layer_idx, qk_norm)
        self.mlp = LlamaMLP(config, dtype, act_and_mul=gelu_tanh_and_mul)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """(hidden, residual) in and out as ``LlamaDecoderLayer``; the post-norms apply to a block's output
        before it joins the residual stream (folded into the next pre-norm)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM; checkpoint names as Llama's, LM head tied."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, max_positions: int):
        nn.Module.__init__(self)
        self.config = config
        rotaries = self._rotaries(config, dtype, device, max_positions)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.build_stage(config, dtype, lambda i: GemmaDecoderLayer(config, dtype, rotaries[layer_types[i]], i),
                         lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device="cpu").item()
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def _rotaries(config, dtype, device, max_positions) -> dict[str, RotaryEmbedding]:
        """One RoPE table per layer type when ``rope_parameters`` is keyed by layer type (Gemma 3)."""
        head_dim = head_dim_of(config)
        params = getattr(config, "rope_parameters", None) or {}
        if "full_attention" in params:
            return {kind: RotaryEmbedding(config, head_dim, max_positions, device, dtype, layer_type=kind)
                    for kind in ("full_attention", "sliding_attention")}
        shared = RotaryEmbedding(config, head_dim, max_positions, device, dtype)
        return {"full_attention": shared, "sliding_attention": shared}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """float32 always: the final soft-cap is applied to the widened logits."""
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
