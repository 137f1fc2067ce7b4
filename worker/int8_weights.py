"""``--quantization int8``: a float checkpoint's projections and LM head rounded to int8 once at load, and served
by the quantized-weight kernels.

Why blocks, not one scale a row: each row is rounded in blocks of 32 weights with one float16 scale a block,
GGUF's Q8_0 layout (8.5 bits a weight against 8 for a scale a row), so the int8 kernels that serve GGUF files
serve it as they are (`worker.layers.quantized_linear`: the int8 path at a few rows, ``quant_matmul`` beyond, the
TP split on whole blocks), and a block's scale follows its own 32 weights: an outlier costs the precision of its
block, not of its whole row.

Rules:
- The rounding is ggml's own (``quantize_q8_0``: d = max |w| / 127 in float32, q = w * (1 / d) rounded half away
  from zero, d stored as float16): byte for byte what the ``gguf`` package writes for the same tensor
  (tests/test_int8_weights.py).
- Quantized: every column- and row-parallel projection and the LM head whose input features are a multiple of
  32 (this rank's, for a row-parallel shard); a tied head shares the embedding's blocks, and the embedding then
  dequantizes the rows it looks up. The rest keep their float weights (one log line names them): norms, biases,
  a projection with other widths.
- Runs after the float weights are loaded, layer by layer, so the float and int8 copies of one layer coexist,
  never of the whole model. CPU only (``worker.config``: the kernels are the CPU's); the KV cache stays in the
  model dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    quantized_twin,
)
from worker.layers.quantized_linear import BLOCK, BlockFormat, BlockQuantizedWeight
from worker.pipeline import MissingLayer

logger = logging.getLogger(__name__)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float [rows, K] (K a multiple of 32) -> Q8_0 blocks uint8 [rows, K / 32 * 34], as ggml rounds them."""
    rows, k = weight.shape
    w = weight.detach().to(torch.float32).reshape(rows, k // BLOCK, BLOCK)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = w * inverse
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)  # roundf: half away from zero
    d16 = d.to(torch.float16).view(torch.uint8)  # [rows, blocks, 2], little-endian as in the file
    return torch.cat([d16, q.view(torch.uint8)], dim=-1).reshape(rows, -1).contiguous()


def _twin(module: nn.Module) -> nn.Module:
    """A projection's Q8_0 twin, its blocks filled from the float weight."""
    twin = quantized_twin(module, BlockFormat.Q8_0)
    twin.weight.blocks.copy_(quantize_q8_0(module.weight))
    if module.bias is not None:
        twin.bias.data.copy_(module.bias.data)
    return twin


def _quantize_vocab(module: VocabParallelEmbedding) -> None:
    """The embedding (or an untied LM head) made Q8_0 in place."""
    blocks = quantize_q8_0(module.weight)
    quantized_twin(module, BlockFormat.Q8_0).weight.blocks.copy_(blocks)


def quantize_int8(model: nn.Module) -> None:
    """``model``'s float projections and LM head made Q8_0 blocks (module rules)."""
    kept_float: list[str] = []
    head = getattr(model, "lm_head", None)
    tied = isinstance(head, ParallelLMHead) and head.weight is getattr(model.embed_tokens, "weight", None)
    for prefix, module in list(model.named_modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if isinstance(module.weight, BlockQuantizedWeight):
                continue
            if module.weight.shape[1] % BLOCK:
                kept_float.append(prefix)
                continue
            parent, _, attr = prefix.rpartition(".")
            setattr(model.get_submodule(parent), attr, _twin(module))
    if isinstance(head, ParallelLMHead) and not isinstance(head.weight, BlockQuantizedWeight):
        if head.weight.shape[1] % BLOCK:
            kept_float.append("lm_head")
        elif tied and not isinstance(model.embed_tokens, MissingLayer):
            _quantize_vocab(model.embed_tokens)
            head.tie_to(model.embed_tokens)
        else:
            _quantize_vocab(head)
    weights = {id(m.weight): m.weight for m in model.modules()
               if isinstance(getattr(m, "weight", None), BlockQuantizedWeight)}  # a tied head counts once
    logger.info("int8: %d layers quantized to Q8_0 blocks (%.1f MB)", len(weights),
                sum(w.blocks.nbytes for w in weights.values()) / 1e6)
    if kept_float:
        logger.info("int8: %d layers kept float (input features not a multiple of %d): %s", len(kept_float), BLOCK,
                    kept_float[:8])
