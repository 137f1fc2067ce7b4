"""Serve a GGUF file's quantized tensors as their blocks: swap a built model's projections, embedding and LM
head for quantized ones and fill them straight from the file (``--quantization gguf``, the default for a
GGUF on the CPU; ``worker.config``).

Rules:
- A layer is served quantized when every checkpoint tensor it holds is a `BlockFormat` in the file: one
  format, or for a fused column-parallel projection one a shard (q and k in Q5_0 with v in Q8_0 make a
  `ShardedBlockWeight`); any other layer keeps its float weight from the converted directory, and one log
  line names how many stayed float and why. The
  format is each tensor's own: a Q4_K_M file holds Q4_K and Q6_K where a row is a multiple of 256 weights
  and other types where llama-quantize fell back (Q5_0, Q8_0: a model with 576 hidden features, as SmolLM2,
  gets k-quants only in ffn_down).
- The blocks are read with gguf's ``GGUFReader`` (a memory map) and copied into the layers; the reader is
  dropped after loading, so the file's pages are not held.
- ``llama`` files carry q and k with their rows permuted for llama.cpp's RoPE; the rows are put back as
  transformers' GGUF loader does (the converted directory is the reference: tests/test_gguf_quantized.py).
- A tied LM head (no ``output.weight``) shares the embedding's blocks; a last pipeline stage without the
  embedding reads ``token_embd.weight`` itself.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    quantized_twin,
)
from worker.layers.quantized_linear import BlockFormat, BlockQuantizedWeight
from worker.pipeline import MissingLayer

logger = logging.getLogger(__name__)

PERMUTED_ARCHITECTURES = ("llama",)  # q/k rows permuted by llama.cpp's converter (transformers undoes these)


class GGUFTensors:
    """The tensors of one GGUF file by Hugging Face name, as (format or None, blocks [rows, row bytes])."""

    def __init__(self, path: str, num_layers: int):
        import gguf

        self.reader = gguf.GGUFReader(path)
        self.arch = self.reader.fields["general.architecture"].contents()
        self.by_name = {t.name: t for t in self.reader.tensors}
        arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == self.arch)
        self.names = gguf.get_tensor_name_map(arch_id, num_layers)
        self.heads = self._field("attention.head_count")
        self.kv_heads = self._field("attention.head_count_kv") or self.heads

    def _field(self, key: str) -> int | None:
        field = self.reader.fields.get(f"{self.arch}.{key}")
        return None if field is None else int(field.contents())

    def gguf_name(self, hf_name: str) -> str | None:
        return self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    def format_of(self, hf_name: str) -> BlockFormat | None:
        tensor = self.by_name.get(self.gguf_name(hf_name) or "")
        if tensor is None or tensor.tensor_type.name not in BlockFormat.__members__:
            return None
        return BlockFormat[tensor.tensor_type.name]

    def blocks(self, hf_name: str) -> torch.Tensor:
        """The tensor's blocks [rows, row bytes] (q/k rows un-permuted, see the module rules)."""
        gguf_name = self.gguf_name(hf_name)
        data = np.asarray(self.by_name[gguf_name].data)
        if self.arch in PERMUTED_ARCHITECTURES and gguf_name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.heads if gguf_name.endswith(".attn_q.weight") else self.kv_heads
            data = data.reshape(heads, data.shape[0] // heads // 2, 2, data.shape[1]).swapaxes(1, 2)
            data = data.reshape(-1, data.shape[-1])  # a copy of this one tensor
        with warnings.catch_warnings():  # the map is read-only and torch warns about that: we only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)


def _sources(model: nn.Module, prefix: str, module: nn.Module) -> list[tuple[str | None, str]]:
    """(shard, checkpoint tensor name) pairs that fill ``module`` (named ``prefix`` in ``model``)."""
    if isinstance(module, ColumnParallelLinear):
        unpacked = {packed: name for name, (packed_layer, packed) in model.packed.items()
                    if prefix.endswith(f".{packed_layer}")}
        parent = prefix.rsplit(".", 1)[0]
        return [(shard, f"model.{parent}.{unpacked.get(shard, shard)}.weight") for shard, _ in module.shards]
    if isinstance(module, ParallelLMHead):
        return [(None, "lm_head.weight")]
    return [(None, f"model.{prefix}.weight")]


def _candidates(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for prefix, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            yield prefix, module


def _type_name(tensors: GGUFTensors, hf_name: str) -> str:
    tensor = tensors.by_name.get(tensors.gguf_name(hf_name) or "")
    return "absent" if tensor is None else tensor.tensor_type.name


def load_quantized_weights(model: nn.Module, gguf_path: str) -> set[str]:
    """Make ``model``'s layers quantized where the file allows (module rules) and fill them; returns the
    checkpoint names served from blocks (the float loader skips them: those layers have no weight Parameter)."""
    tensors = GGUFTensors(gguf_path, model.config.num_hidden_layers)
    served: set[str] = set()
    kept_float: Counter[str] = Counter()
    tied = getattr(model, "tie_word_embeddings", False) and tensors.gguf_name("lm_head.weight") not in tensors.by_name
    for prefix, module in list(_candidates(model)):
        sources = _sources(model, prefix, module)
        if isinstance(module, ParallelLMHead) and tied:
            if not isinstance(model.embed_tokens, MissingLayer):
                continue  # shares the embedding's blocks (`tie_lm_head`)
            sources = [(None, "model.embed_tokens.weight")]
        by_shard = {shard: tensors.format_of(name) for shard, name in sources}
        formats = set(by_shard.values())
        fmt: BlockFormat | dict[str, BlockFormat] | None = formats.pop() if len(formats) == 1 else None
        if fmt is None and None not in formats and isinstance(module, ColumnParallelLinear):
            fmt = by_shard  # shards of different block formats: `ShardedBlockWeight`
        if fmt is None:
            kept_float["+".join(sorted({_type_name(tensors, name) for _, name in sources}))] += 1
            continue
        quantized = quantized_twin(module, fmt)
        for shard, name in sources:
            quantized.load_quantized(shard, tensors.blocks(name))
            served.add("lm_head.weight" if isinstance(module, ParallelLMHead) else name)
        if quantized is not module:
            parent, _, attr = prefix.rpartition(".")
            setattr(model.get_submodule(parent), attr, quantized)
    formats = Counter(m.fmt.name for m in model.modules() if isinstance(m, BlockQuantizedWeight))
    logger.info("GGUF: %d layers served as blocks %s (%.1f MB)", sum(formats.values()), dict(formats),
                sum(b.nbytes for b in model.buffers() if b.dtype == torch.uint8) / 1e6)
    if kept_float:
        logger.info("GGUF: %d layers kept as float weights (their tensor types: %s; served quantized: %s)",
                    sum(kept_float.values()), dict(kept_float), [f.name for f in BlockFormat])
    del tensors  # the memory map closes with its last reference
    return served
