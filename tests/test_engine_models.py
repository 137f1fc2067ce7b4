"""Checkpoint loading (errors, sharded safetensors) and model variants (bfloat16, rope scaling, Mistral)
against transformers on the tiny models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    GREEDY,
    PROMPTS,
    VOCAB,
    LogitsRecorder,
    assert_all_blocks_free,
    greedy,
    hf_greedy,
    make_llm,
    token_ids,
)
from safetensors.torch import load_file, save_file

from worker.model_loader import ModelLoadError

# --- loading ------------------------------------------------------------------------------------------------


def _copy(model_dir: str, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(model_dir, dst)
    return dst


def test_unsupported_architecture(llama_dir: str, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM"):
        make_llm(str(path))


def test_missing_weights(llama_dir: str, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        make_llm(str(path))


def test_missing_tensor(llama_dir: str, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        make_llm(str(path))


def _shard(path: Path) -> list[str]:
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for file, half in zip(files, halves, strict=True):
        save_file({n: tensors[n] for n in half}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "model.safetensors").unlink()
    return files


def test_sharded_checkpoint(model_dir: str, tmp_path: Path) -> None:
    path = _copy(model_dir, tmp_path)
    _shard(path)
    llm = make_llm(str(path))
    outputs = llm.generate(PROMPTS[2:5], GREEDY)
    assert token_ids(outputs) == [hf_greedy(model_dir, p) for p in PROMPTS[2:5]]


def test_missing_shard(llama_dir: str, tmp_path: Path) -> None:
    path = _copy(llama_dir, tmp_path)
    files = _shard(path)
    (path / files[1]).unlink()
    with pytest.raises(ModelLoadError, match=files[1]):
        make_llm(str(path))


def test_bfloat16_runs(model_dir: str) -> None:
    llm = make_llm(model_dir, dtype="bfloat16")
    assert llm.engine.executor.runner.kv_caches[0].dtype == torch.bfloat16
    recorder = LogitsRecorder(llm)
    outputs = llm.generate(PROMPTS, greedy(8))
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 8
        assert all(0 <= t < VOCAB for t in out.outputs[0].token_ids)
    assert len(recorder.rows) == 8 * len(PROMPTS)
    for _, _, row in recorder.rows:
        assert torch.isfinite(row).all()
        assert row.std() > 0
    assert_all_blocks_free(llm)


def _variant(base_dir: str, tmp_path, name: str, **changes) -> str:
    target = tmp_path / name
    shutil.copytree(base_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize("name,changes", [
    ("llama3-rope", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("linear-rope", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 500000.0}),
    ("mistral", {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None}),
])
def test_rope_scaling_and_mistral_match_hf(llama_dir: str, tmp_path, name: str, changes: dict) -> None:
    variant = _variant(llama_dir, tmp_path, name, **changes)
    outputs = make_llm(variant).generate(PROMPTS, greedy())
    assert token_ids(outputs) == [hf_greedy(variant, p) for p in PROMPTS]
