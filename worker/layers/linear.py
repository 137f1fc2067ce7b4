"""Tensor-parallel linear layers, vocab-parallel embedding and LM head.

Each layer holds only this rank's shard and loads it straight from the checkpoint (a safetensors
slice is read partially). Column-parallel layers split output features; row-parallel layers split
input features and all-reduce their partial sums. With TP = 1 they are plain linears.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.packed_gemm import MIN_ROWS, PackedWeight
from worker.layers.small_gemm import MAX_ROWS
from worker.parallel_state import tp_all_gather_last_dim, tp_all_reduce, tp_group

PROJECTION_MIN_ROWS = MAX_ROWS + 1  # fewer rows: the small-batch kernel (worker.layers.small_gemm)


def _shape(loaded: Any) -> list[int]:
    return list(loaded.get_shape()) if hasattr(loaded, "get_shape") else list(loaded.shape)


def _as_tensor(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks; ``shards`` lists the logical outputs
    packed into this layer (e.g. q, k, v) as (name, full_size) pairs, each split evenly."""

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool, dtype: torch.dtype):
        super().__init__()
        tp = tp_group()
        self.shard_sizes = {name: _divide(size, tp.size, name) for name, size in shards}
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, _ in shards:
            self.shard_offsets[name] = offset
            offset += self.shard_sizes[name]
        self.weight = nn.Parameter(torch.empty(offset, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False) if bias else None
        self.gemm = PackedWeight(PROJECTION_MIN_ROWS)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str) -> None:
        size, rank = self.shard_sizes[shard], tp_group().rank
        offset = self.shard_offsets[shard]
        piece = loaded[rank * size:(rank + 1) * size]
        param.data[offset:offset + size].copy_(_as_tensor(piece))
        self.gemm.invalidate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b): input features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_per_rank = _divide(in_features, tp_group().size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.gemm = PackedWeight(PROJECTION_MIN_ROWS)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        if param is self.bias:
            param.data.copy_(_as_tensor(loaded))
            return
        rank, n = tp_group().rank, self.in_per_rank
        param.data.copy_(_as_tensor(loaded[:, rank * n:(rank + 1) * n]))
        self.gemm.invalidate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.gemm.matmul(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to a multiple of TP size)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        tp = tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        end = min(self.start + self.per_rank, _shape(loaded)[0])
        if end > self.start:
            param.data[:end - self.start].copy_(_as_tensor(loaded[self.start:end]))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_group().size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head split by vocabulary; logits are gathered to every rank (all ranks sample alike).

    On the CPU, from `MIN_ROWS` rows, the shard is multiplied through a oneDNN-packed copy made at the first
    call after loading (`worker.layers.packed_gemm`); elsewhere, or where packing is off, ``linear``
    (`worker.layers.small_gemm`: its kernel at a few rows, else ``F.linear``). Loading a shard, or
    tying the head to the embedding (a new Parameter), makes the copy again at the next call."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__(vocab_size, hidden_size, dtype)
        self.gemm = PackedWeight(MIN_ROWS)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        super().load_shard(param, loaded, shard)
        self.gemm.invalidate()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather_last_dim(self.gemm.matmul(hidden, self.weight))
        return logits[..., :self.vocab_size]
