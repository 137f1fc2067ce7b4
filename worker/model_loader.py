"""Load a Hugging Face model directory from disk: config (AutoConfig), weights (safetensors, sharded
or not). Each TP rank reads only its own shard of every tensor, and each pipeline stage only the tensors
of the modules it holds (``worker.pipeline``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, GenerationConfig

from worker.models.registry import ARCHITECTURES
from worker.pipeline import MissingLayer

logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message names the missing file or unsupported feature."""


def load_config(model_dir: str):
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read config.json in {model_dir}: {exc}") from exc
    archs = getattr(config, "architectures", None) or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ModelLoadError(f"unsupported architecture {archs or config.model_type!r} in {model_dir}; "
                             f"supported: {sorted(ARCHITECTURES)}")
    return config


def eos_token_ids(model_dir: str, config) -> list[int]:
    """EOS ids from generation_config.json when present, else config.json."""
    ids = None
    if (Path(model_dir) / "generation_config.json").is_file():
        ids = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def weight_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing weight shards named in its index: {missing}")
        return [root / n for n in names]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights found in {model_dir} (expected model.safetensors "
                             "or model.safetensors.index.json)")
    return files


def build_model(model_dir: str, config, dtype: torch.dtype, device: torch.device, max_positions: int,
                gguf_file: str | None = None, int8: bool = False) -> nn.Module:
    """The model with its weights; ``gguf_file``: serve that file's quantized tensors as blocks
    (``worker.gguf_weights``), the rest from ``model_dir`` (its converted directory); ``int8``: the float
    projections and LM head rounded to int8 blocks once loaded (``worker.int8_weights``)."""
    arch = next(a for a in config.architectures if a in ARCHITECTURES)
    with torch.device(device):
        model = ARCHITECTURES[arch](config, dtype, device, max_positions)
    files = weight_files(model_dir)
    quantized = set()
    if gguf_file is not None:
        from worker.gguf_weights import load_quantized_weights
        quantized = load_quantized_weights(model, gguf_file)
    loaded = load_weights(model, files)
    if "lm_head.weight" not in loaded | quantized and not isinstance(model.lm_head, MissingLayer):  # tied
        if isinstance(model.embed_tokens, MissingLayer):  # a later pipeline stage: read the rows itself
            _load_tied_head(model.lm_head, files, model_dir)
        else:
            model.lm_head.tie_to(model.embed_tokens)
        loaded.add("lm_head.weight")
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise ModelLoadError(f"checkpoint in {model_dir} lacks weights for: {missing[:8]}")
    if int8:
        from worker.int8_weights import quantize_int8
        quantize_int8(model)
    return model.eval()


def _load_tied_head(lm_head: nn.Module, files: list[Path], model_dir: str) -> None:
    """Load the embedding matrix into the LM head of a last pipeline stage that holds no embedding."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.removeprefix("model.") == "embed_tokens.weight":
                    lm_head.load_shard(lm_head.weight, f.get_slice(name))
                    return
    raise ModelLoadError(f"checkpoint in {model_dir} has neither lm_head.weight nor embed_tokens.weight")


def load_weights(model: nn.Module, files: list[Path]) -> set[str]:
    """Copy every checkpoint tensor into its (sharded) parameter; returns the parameter names filled."""
    param_names = {id(p): n for n, p in model.named_parameters()}
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = model.resolve_weight(name)
                if target is None:
                    continue
                module, param, shard = target
                tensor = f.get_slice(name)
                if hasattr(module, "load_shard"):
                    module.load_shard(param, tensor, shard)
                else:
                    param.data.copy_(tensor[:])
                loaded.add(param_names[id(param)])
    return loaded
