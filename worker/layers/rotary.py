"""Rotary position embeddings (neox layout, as Llama/Qwen2/Mistral in Hugging Face format).

Scaled variants (linear, llama3, yarn, longrope) take their frequencies from transformers'
``ROPE_INIT_FUNCTIONS`` so they match the reference implementation exactly.

Rules:
- ``rotary(positions, q, k)`` returns the rotated q and k; on the kernel paths (C++ on the CPU, Triton on
  CUDA) they are q and k themselves, rotated in place (no cos/sin gather, no temporaries), so callers keep
  only what it returns.
- Computed in the model dtype with cos/sin rounded to it, each product and sum rounded, as the Hugging
  Face implementation does; the kernel and ``reference`` agree exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.layers.fused_ops import fused_ops_for, triton_ops_for

_SUPPORTED = {"default", "linear", "llama3", "yarn", "longrope"}


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters; ``layer_type`` picks one entry of a per-layer-type dict (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params[layer_type] if layer_type is not None else params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device, dtype: torch.dtype,
                 layer_type: str | None = None):
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in _SUPPORTED:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {sorted(_SUPPORTED)}")
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE is applied to the whole head)")
        cos, sin = _cos_sin_table(config, params, head_dim, max_positions, layer_type)
        # Computed on the CPU whatever the default device (the reference's numbers), then moved once.
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, d], k: [T, kv_heads, d] (views with a contiguous last dim are fine)."""
        ops = fused_ops_for(q, k, self.cos) or triton_ops_for(q, k, self.cos)
        if ops is None or q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1:
            return self.reference(positions, q, k)
        ops.rotary_embedding(positions.long().contiguous(), q, k, self.cos, self.sin)
        return q, k

    def reference(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _cos_sin_table(config, params: dict, head_dim: int, max_positions: int,
                   layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, head_dim / 2] float32 cos and sin, every tensor explicitly on the CPU."""
    cpu = torch.device("cpu")
    rope_type = params["rope_type"]
    extra = {"layer_type": layer_type} if layer_type is not None else {}
    if rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu) / head_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponent), 1.0
    else:
        with cpu:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, cpu, **extra)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq.float().to(cpu))
    if rope_type == "longrope":
        freqs = _longrope_long_rows(config, params, freqs, extra)
    return freqs.cos() * scaling, freqs.sin() * scaling


def _longrope_long_rows(config, params: dict, freqs: torch.Tensor, extra: dict) -> torch.Tensor:
    """Positions at or past ``original_max_position_embeddings`` take the long factors. Hugging Face
    switches a whole sequence to them once it grows past that length (and recomputes its cache); a paged
    cache keeps the keys already written, so only the positions beyond use the long factors."""
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                         None)
    if not original or original >= freqs.shape[0]:
        return freqs
    cpu = torch.device("cpu")
    with cpu:
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, cpu, seq_len=original + 1, **extra)
    positions = torch.arange(original, freqs.shape[0], dtype=torch.float32, device=cpu)
    freqs[original:] = torch.outer(positions, long_inv_freq.float().to(cpu))
    return freqs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
