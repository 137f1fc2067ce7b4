"""Phi-3: the Llama decoder whose checkpoints store q/k/v fused (``qkv_proj``) and gate/up fused
(``gate_up_proj``).

Rules:
- A fused tensor is read whole and split into its logical parts (q, k, v / gate, up) at load, so each
  part is then sharded across TP ranks like the unfused Llama weights.
- ``rope_type: longrope``: short factors below ``original_max_position_embeddings`` (exactly Hugging
  Face while a sequence fits it), long factors at positions past it; see ``worker.layers.rotary``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from worker.layers.linear import ColumnParallelLinear
from worker.models.llama import LlamaForCausalLM
from worker.parallel_state import tp_group


class FusedColumnLoader:
    """Loads a fused checkpoint tensor into a packed ``ColumnParallelLinear`` part by part."""

    def __init__(self, layer: ColumnParallelLinear):
        self.layer = layer

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        full = loaded if hasattr(loaded, "shape") and not hasattr(loaded, "get_shape") else loaded[:]
        tp, offset = tp_group().size, 0
        for name, size in self.layer.shard_sizes.items():
            self.layer.load_shard(param, full[offset:offset + size * tp], name)
            offset += size * tp
        if offset != full.shape[0]:
            raise ValueError(f"fused tensor has {full.shape[0]} rows, expected {offset}")


class Phi3ForCausalLM(LlamaForCausalLM):
    fused = ("qkv_proj", "gate_up_proj")

    def resolve_weight(self, name: str) -> tuple[Any, nn.Parameter, str | None] | None:
        target = super().resolve_weight(name)
        if target is None or name.split(".")[-2] not in self.fused:
            return target
        module, param, _ = target
        return FusedColumnLoader(module), param, None
