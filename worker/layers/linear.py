"""Tensor-parallel linear layers, vocab-parallel embedding and LM head.

Each layer holds only this rank's shard and loads it straight from the checkpoint (a safetensors
slice is read partially). Column-parallel layers split output features; row-parallel layers split
input features and all-reduce their partial sums. With TP = 1 they are plain linears.

Rules:
- A projection built with ``weight_format`` (a GGUF block format) holds its weight as blocks
  (`worker.layers.quantized_linear.BlockQuantizedWeight`, filled by ``load_quantized``) and has no float
  weight Parameter; the checkpoint's float copy of it is never read. Its TP split cuts whole blocks (32
  weights, 256 for Q4_K / Q6_K): a row-parallel shard whose input features are not a multiple of the block
  is a ValueError. A column-parallel projection may take one format a shard (``{shard: format}``): shards of
  different formats make a `ShardedBlockWeight` (a Q4_K_M file's q and k in Q5_0 beside v in Q8_0).
- A quantized embedding dequantizes the rows it looks up; a tied LM head shares its blocks (`tie_to`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.packed_gemm import MIN_ROWS, PackedWeight
from worker.layers.quantized_linear import (
    BlockFormat,
    BlockQuantizedWeight,
    QuantizedGemm,
    ShardedBlockWeight,
)
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

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool, dtype: torch.dtype,
                 weight_format: BlockFormat | dict[str, BlockFormat] | None = None):
        super().__init__()
        tp = tp_group()
        self.in_features, self.shards, self.dtype = in_features, shards, dtype
        self.shard_sizes = {name: _divide(size, tp.size, name) for name, size in shards}
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, _ in shards:
            self.shard_offsets[name] = offset
            offset += self.shard_sizes[name]
        if isinstance(weight_format, dict):  # one format a shard: one weight where they agree, else runs of them
            runs = _format_runs([(weight_format[name], self.shard_sizes[name]) for name, _ in shards])
            self.weight, self.gemm = (_projection_weight(offset, in_features, dtype, runs[0][0]) if len(runs) == 1
                                      else (ShardedBlockWeight(runs, in_features, dtype), QuantizedGemm()))
        else:
            self.weight, self.gemm = _projection_weight(offset, in_features, dtype, weight_format)
        self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str) -> None:
        size, rank = self.shard_sizes[shard], tp_group().rank
        offset = self.shard_offsets[shard]
        piece = loaded[rank * size:(rank + 1) * size]
        param.data[offset:offset + size].copy_(_as_tensor(piece))
        self.gemm.invalidate()

    def load_quantized(self, shard: str, blocks: torch.Tensor) -> None:
        """This rank's rows of ``shard`` from the whole tensor's blocks [full_size, row bytes]."""
        size, rank = self.shard_sizes[shard], tp_group().rank
        self.weight.block_rows(self.shard_offsets[shard], size).copy_(blocks[rank * size:(rank + 1) * size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b): input features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 weight_format: BlockFormat | None = None):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.in_per_rank = _divide(in_features, tp_group().size, "input features")
        if weight_format is not None and self.in_per_rank % weight_format.block_weights:
            raise ValueError(f"a {weight_format.name} weight splits over tensor_parallel_size {tp_group().size} "
                             f"only on {weight_format.block_weights}-weight blocks, and {in_features} input features give "
                             f"{self.in_per_rank} a rank; use another tensor_parallel_size or --quantization none")
        self.weight, self.gemm = _projection_weight(out_features, self.in_per_rank, dtype, weight_format)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        if param is self.bias:
            param.data.copy_(_as_tensor(loaded))
            return
        rank, n = tp_group().rank, self.in_per_rank
        param.data.copy_(_as_tensor(loaded[:, rank * n:(rank + 1) * n]))
        self.gemm.invalidate()

    def load_quantized(self, shard: str | None, blocks: torch.Tensor) -> None:
        """This rank's input features (whole blocks) from the whole tensor's blocks [out, row bytes]."""
        width = self.weight.blocks.shape[1]
        self.weight.blocks.copy_(blocks[:, tp_group().rank * width:(tp_group().rank + 1) * width])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.gemm.matmul(x, self.weight))
        return y if self.bias is None else y + self.bias


def _projection_weight(rows: int, in_features: int, dtype: torch.dtype, weight_format: BlockFormat | None):
    """A projection's weight and the gemm that multiplies it: float Parameter + packed copy, or GGUF blocks."""
    if weight_format is None:
        weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype), requires_grad=False)
        return weight, PackedWeight(PROJECTION_MIN_ROWS)
    return BlockQuantizedWeight(weight_format, rows, in_features, dtype), QuantizedGemm()


def _format_runs(shards: list[tuple[BlockFormat, int]]) -> list[tuple[BlockFormat, int]]:
    """(format, rows) of each shard in order -> the same with adjacent shards of one format merged."""
    runs: list[tuple[BlockFormat, int]] = []
    for fmt, rows in shards:
        if runs and runs[-1][0] is fmt:
            runs[-1] = (fmt, runs[-1][1] + rows)
        else:
            runs.append((fmt, rows))
    return runs


def quantized_twin(module: nn.Module, weight_format: BlockFormat | dict[str, BlockFormat]) -> nn.Module:
    """A projection's quantized twin (the same shapes and bias, its blocks still to fill), or an embedding / LM
    head itself made quantized (``quantize``): how GGUF blocks and ``--quantization int8`` swap a layer."""
    if isinstance(module, ColumnParallelLinear):
        return ColumnParallelLinear(module.in_features, module.shards, module.bias is not None, module.dtype,
                                    weight_format)
    if isinstance(module, RowParallelLinear):
        return RowParallelLinear(module.in_features, module.out_features, module.bias is not None, module.dtype,
                                 weight_format)
    module.quantize(weight_format)
    return module


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to a multiple of TP size)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        tp = tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.hidden_size, self.dtype = hidden_size, dtype
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)

    def quantize(self, weight_format: BlockFormat) -> None:
        """Hold the rows as GGUF blocks (filled by ``load_quantized``) instead of a float matrix."""
        del self.weight
        self.weight = BlockQuantizedWeight(weight_format, self.per_rank, self.hidden_size, self.dtype)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard: str | None = None) -> None:
        end = min(self.start + self.per_rank, _shape(loaded)[0])
        if end > self.start:
            param.data[:end - self.start].copy_(_as_tensor(loaded[self.start:end]))

    def load_quantized(self, shard: str | None, blocks: torch.Tensor) -> None:
        """This rank's rows from the whole vocabulary's blocks (padding rows stay zero: they dequantize to 0)."""
        end = min(self.start + self.per_rank, blocks.shape[0])
        if end > self.start:
            self.weight.blocks[:end - self.start].copy_(blocks[self.start:end])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, BlockQuantizedWeight):
            return self.weight.rows(ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_group().size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
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

    def quantize(self, weight_format: BlockFormat) -> None:
        super().quantize(weight_format)
        self.gemm = QuantizedGemm()

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (its Parameter, or its blocks when quantized)."""
        if isinstance(embedding.weight, BlockQuantizedWeight):
            del self.weight
            self.weight, self.gemm = embedding.weight, QuantizedGemm()
        else:
            self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather_last_dim(self.gemm.matmul(hidden, self.weight))
        return logits[..., :self.vocab_size]
