"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE, and no q/k/v bias."""

from __future__ import annotations

from worker.layers.norm import RMSNorm
from worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    qk_norm = RMSNorm


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
