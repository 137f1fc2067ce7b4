"""The model's recommended sampling defaults (generation_config.json), applied to requests, as vLLM does.

Rules:
- ``--generation-config auto`` (the default, as in vLLM) reads ``temperature``, ``top_p``, ``top_k``,
  ``min_p`` and ``repetition_penalty`` from the model directory's generation_config.json (a GGUF
  model: its converted cache directory); ``vllm`` ignores the file (the OpenAI defaults apply).
- A default fills a field only where the request body leaves it out or sets it to null; a value the
  request gives always wins. Defaults of the wrong type are dropped with a warning (the file is not
  the caller's fault, so it never turns into a 400).
- The defaults in force are logged once per API process at startup.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("auto", "vllm")
FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def load_generation_defaults(model_dir: str, mode: str) -> dict[str, Any]:
    """The sampling defaults from `model_dir`'s generation_config.json ({} for mode ``vllm``)."""
    if mode == "vllm":
        return {}
    try:
        with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {name: value for name, kind in FIELDS.items()
            if (value := data.get(name)) is not None and _usable(name, value, kind)}


def apply_generation_defaults(body: Any, defaults: dict[str, Any]) -> Any:
    """`body` with each default filled in where the request leaves the field out or null."""
    if not defaults or not isinstance(body, dict):
        return body
    return {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}


def describe(defaults: dict[str, Any], mode: str) -> str:
    if mode == "vllm":
        return "generation defaults: none (--generation-config vllm ignores generation_config.json)"
    if not defaults:
        return "generation defaults: none (generation_config.json sets no sampling fields)"
    return f"generation defaults from generation_config.json: {defaults} (--generation-config vllm ignores them)"


def _usable(name: str, value: Any, kind: type) -> bool:
    ok = type(value) is int if kind is int else type(value) in (int, float)
    if not ok:
        logger.warning("generation_config.json: ignoring %s=%r (not a %s)", name, value, kind.__name__)
    return ok
