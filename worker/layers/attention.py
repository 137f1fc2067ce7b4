"""Attention over the paged KV cache, for prefill (with or without a cached prefix) and decode.

The flattened batch puts decode tokens (one query per request) first, then each prefill chunk.
K/V of the step are written to their slots first; every query then reads its context from the cache
through its block table. The cache is head-major, ``[2, kv_heads, num_slots, head_dim]``, so one
``index_select`` gathers a batch's context already laid out as ``[kv_heads, batch, length, d]`` and the
batched matmuls need no further copy. GQA is folded into the query axis (the queries of one KV head
attend together), so K/V are never repeated. Runs on CPU and CUDA with plain torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int
    num_tokens: int
    num_computed: int
    slot_index: torch.Tensor | None
    causal_mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step layout shared by every layer. ``decode_slots`` [B, L] holds the cache slot of each
    context position of each decode request (padding points at slot 0 and is masked out)."""

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]; kv_cache: [2, KVH, num_slots, d]. Returns [T, H*d]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[:meta.num_decodes] = self._decode(q[:meta.num_decodes], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        batch, length = meta.decode_slots.shape
        shape = (self.num_kv_heads, batch, length, self.head_dim)
        slots = meta.decode_slots.view(-1)
        keys = k_cache.index_select(1, slots).view(shape)
        values = v_cache.index_select(1, slots).view(shape)
        queries = q.view(batch, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * self.scale
        scores.masked_fill_(meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out = torch.matmul(probs, values)
        return out.transpose(0, 1).reshape(batch, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        n = chunk.num_tokens
        if chunk.num_computed:
            keys = k_cache.index_select(1, chunk.slot_index)
            values = v_cache.index_select(1, chunk.slot_index)
        else:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
        queries = q.transpose(0, 1).reshape(self.num_kv_heads, self.group * n, self.head_dim)
        mask = chunk.causal_mask
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(self.num_heads, n, self.head_dim).transpose(0, 1)
