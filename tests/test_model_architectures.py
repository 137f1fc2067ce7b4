"""Mistral (sliding window), Qwen3, Gemma 2, Gemma 3 and Phi-3 against transformers, token for token.

Each architecture is a tiny random-weight model from ``make-tiny-model --arch X`` with a 20-token sliding
window (every layer for Mistral/Qwen3/Phi-3, alternate layers for Gemma), so prompts and generations
that run past the window check that prefill, chunked prefill and decode mask tokens older than it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    LogitsRecorder,
    greedy,
    hf_greedy,
    hf_logits,
    make_llm,
    random_prompt,
    requires_devices,
    token_ids,
)

import worker.models.tiny_model as tm
from worker.model_loader import ModelLoadError

WINDOW = 20
SIZES = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=1024,
             max_position_embeddings=256, sliding_window=WINDOW)
# Within the window, one block past it, and far past it (prefill alone spans > 2 windows).
PROMPTS = [random_prompt(n, 100 + seed) for seed, n in enumerate((3, 37, 50))]
MAX_TOKENS = 10
LOGIT_TOLERANCE = 1e-4
NEW_ARCHS = ("mistral", "qwen3", "gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: str(tm.make_tiny_model(root / arch, arch=arch, **SIZES)) for arch in NEW_ARCHS}


def _check_against_hf(model_dir: str, **llm_kwargs) -> float:
    """Greedy tokens equal HF generate; returns the largest logit difference over every sampled row."""
    llm = make_llm(model_dir, **llm_kwargs)
    recorder = LogitsRecorder(llm)
    outputs = token_ids(llm.generate(PROMPTS, greedy(MAX_TOKENS)))
    assert outputs == [hf_greedy(model_dir, p, MAX_TOKENS) for p in PROMPTS]
    return max((hf_logits(model_dir, ctx)[-1] - row).abs().max().item() for _, ctx, row in recorder.rows)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_matches_hf(arch_dirs: dict[str, str], arch: str) -> None:
    assert _check_against_hf(arch_dirs[arch]) < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_chunked_prefill_past_the_window_matches_hf(arch_dirs: dict[str, str], arch: str) -> None:
    assert _check_against_hf(arch_dirs[arch], max_num_batched_tokens=16) < LOGIT_TOLERANCE


def _variant(base_dir: str, tmp_path: Path, **changes) -> str:
    target = tmp_path / "variant"
    shutil.copytree(base_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_window_changes_the_reference(arch_dirs: dict[str, str], tmp_path: Path) -> None:
    """The parity tests above only guard the window if the window changes what HF generates."""
    full = _variant(arch_dirs["mistral"], tmp_path, sliding_window=None)
    assert [hf_greedy(full, p, MAX_TOKENS) for p in PROMPTS] != \
           [hf_greedy(arch_dirs["mistral"], p, MAX_TOKENS) for p in PROMPTS]


def test_phi3_longrope_matches_hf(arch_dirs: dict[str, str], tmp_path: Path) -> None:
    """longrope with short/long factors: HF uses the short ones while the sequence fits
    ``original_max_position_embeddings`` (all the sequences here do)."""
    half = SIZES["hidden_size"] // SIZES["num_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half,
            "partial_rotary_factor": 1.0}
    variant = _variant(arch_dirs["phi3"], tmp_path, rope_parameters=rope, rope_scaling=rope,
                       original_max_position_embeddings=64)
    assert _check_against_hf(variant) < LOGIT_TOLERANCE


def test_phi3_checkpoint_is_fused(arch_dirs: dict[str, str]) -> None:
    from safetensors import safe_open
    with safe_open(str(Path(arch_dirs["phi3"]) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names


def test_gemma3_local_and_global_rope_differ(arch_dirs: dict[str, str]) -> None:
    llm = make_llm(arch_dirs["gemma3"])
    layers = llm.engine.executor.runner.model.layers
    assert layers[0].self_attn.attn.sliding_window == WINDOW and layers[1].self_attn.attn.sliding_window is None
    assert not torch.equal(layers[0].self_attn.rotary.cos, layers[1].self_attn.rotary.cos)


def test_unsupported_architecture_lists_supported(arch_dirs: dict[str, str], tmp_path: Path) -> None:
    path = _variant(arch_dirs["qwen3"], tmp_path, architectures=["FancyNewForCausalLM"])
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM") as info:
        make_llm(path)
    for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(info.value)


def test_longrope_positions_past_the_original_length_use_long_factors() -> None:
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker.layers.rotary import RotaryEmbedding

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i for i in range(8)],
            "long_factor": [8.0] * 8, "original_max_position_embeddings": 64}
    config = Phi3Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, max_position_embeddings=256,
                        original_max_position_embeddings=64, rope_parameters=rope)
    rotary = RotaryEmbedding(config, 16, 256, torch.device("cpu"), torch.float32)
    for seq_len, rows in ((None, slice(0, 64)), (65, slice(64, 256))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=seq_len)
        positions = torch.arange(256, dtype=torch.float32)[rows]
        torch.testing.assert_close(rotary.cos[rows], torch.outer(positions, inv_freq).cos() * scale)


def test_gemma3_scaled_global_rope_matches_hf(arch_dirs: dict[str, str], tmp_path: Path) -> None:
    """Gemma 3 4B and up scale only the global layers' RoPE (linear, factor 8)."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    assert _check_against_hf(_variant(arch_dirs["gemma3"], tmp_path, rope_parameters=rope)) < LOGIT_TOLERANCE


@requires_devices(2)
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])  # q/k norms + per-layer RoPE; fused weights split per rank
def test_tensor_parallel_2_matches_hf(arch_dirs: dict[str, str], arch: str) -> None:
    llm = make_llm(arch_dirs[arch], tensor_parallel_size=2)
    try:
        outputs = token_ids(llm.generate(PROMPTS, greedy(MAX_TOKENS)))
    finally:
        llm.shutdown()
    assert outputs == [hf_greedy(arch_dirs[arch], p, MAX_TOKENS) for p in PROMPTS]


def test_partial_rotary_factor_is_refused(arch_dirs: dict[str, str], tmp_path: Path) -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported"):
        make_llm(_variant(arch_dirs["phi3"], tmp_path, rope_parameters=rope))
