"""One config dataclass for an engine; checked in ``__post_init__``, derived values as properties.

It lives in worker/ because the workers are built from it (it travels to each TP/PP worker process); the
engine imports it from here, and worker/ imports nothing of engine/. A GGUF ``model`` is converted here, in
this process (it has torch), by ``worker.gguf_model.convert_gguf`` (``common.model_source``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from common.model_source import is_gguf, resolve_model_dir
from worker.dtype_choice import DtypeChoice, choose_dtype
from worker.gguf_model import convert_gguf

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
QUANTIZATIONS = ("auto", "none", "gguf", "int8")


@dataclass
class EngineConfig:
    """Everything an engine (and its workers) needs to know to run one model.

    ``model`` is an HF directory or a GGUF file (converted once, see ``common.model_source``).
    ``max_model_len`` None means the model's ``max_position_embeddings``. ``kv_cache_memory`` is the KV
    budget in bytes on CPU (default 1 GiB, or ``REDSERVE_CPU_KV_CACHE_BYTES``); on CUDA the budget is
    ``gpu_memory_utilization`` of the device minus what the weights and activations take.

    ``quantization``: ``gguf`` serves a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors as their blocks
    (``worker.gguf_weights``; CPU only), ``none`` its dequantized conversion, ``auto`` (the default) follows
    the file: ``gguf`` for a GGUF on the CPU, else ``none``; ``int8`` rounds a float checkpoint's projections and LM
    head to int8 blocks at load (``worker.int8_weights``; CPU only). ``gguf_file`` is the GGUF that ``model`` was
    converted from (set here; carried to the workers with the rest).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    remote_stages: int = 0  # the last pipeline stages, taken by worker hosts (`redserve worker`)
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly (CPU always does)
    # Overlapped steps (``engine.scheduler``): None = on where it pays, a CUDA engine that runs its model in its
    # own process (TP = PP = 1); True forces it (on a CPU it overlaps nothing but runs the same code: the tests).
    async_scheduling: bool | None = None
    quantization: str = "auto"
    gguf_file: str | None = None
    kv_tier_url: str | None = None  # the KV tier (engine.kv_tier): redis:// (a Valkey of its own, never the control Redis) or shm://

    def __post_init__(self) -> None:
        if is_gguf(self.model):
            self.gguf_file = os.path.abspath(self.model)
        self.model = resolve_model_dir(self.model, convert_gguf)  # a GGUF file: its converted HF dir (cached)
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model directory not found: {self.model}")
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {self.model} has no config.json")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"unsupported dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unsupported device {self.device!r}; use auto, cpu or cuda")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be >= 1")
        if not 0 <= self.remote_stages < self.pipeline_parallel_size:
            raise ValueError(f"remote_stages must be in [0, pipeline_parallel_size - 1 = "
                             f"{self.pipeline_parallel_size - 1}] (stage 0 runs on the engine's host)")
        if self.async_scheduling and self.world_size > 1:
            raise ValueError("async_scheduling runs the model in the engine's own process: it needs "
                             "tensor_parallel_size = pipeline_parallel_size = 1")
        if self.kv_tier_url and not self.enable_prefix_caching:
            raise ValueError("the KV tier stores and finds prefix blocks: it needs prefix caching on")
        if self.kv_tier_url and self.pipeline_parallel_size > 1:
            raise ValueError("the KV tier reads whole blocks between steps: it needs pipeline_parallel_size = 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be at least 2")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_cache_memory is None and self.device == "cpu":
            self.kv_cache_memory = int(os.environ.get("REDSERVE_CPU_KV_CACHE_BYTES", DEFAULT_CPU_KV_CACHE_BYTES))
        self.quantization = self._resolve_quantization()

    def _resolve_quantization(self) -> str:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unsupported quantization {self.quantization!r}; use one of {', '.join(QUANTIZATIONS)}")
        if self.quantization == "auto":
            return "gguf" if self.gguf_file is not None and self.device == "cpu" else "none"
        if self.quantization == "gguf" and self.gguf_file is None:
            raise ValueError("--quantization gguf needs a GGUF file as --model")
        if self.quantization == "gguf" and self.device != "cpu":
            raise ValueError("--quantization gguf runs on the CPU only; use --quantization none on CUDA")
        if self.quantization == "int8" and self.gguf_file is not None:
            raise ValueError("--quantization int8 rounds a float checkpoint's weights; a GGUF file is served as its "
                             "own blocks (gguf) or dequantized (none)")
        if self.quantization == "int8" and self.device != "cpu":
            raise ValueError("--quantization int8 runs on the CPU only; use --quantization none on CUDA")
        return self.quantization

    @property
    def quantized_gguf_file(self) -> str | None:
        """The GGUF file whose blocks the workers serve, or None (float weights from ``model``)."""
        return self.gguf_file if self.quantization == "gguf" else None

    @property
    def use_async_scheduling(self) -> bool:
        """Whether steps overlap: the next one is scheduled and launched before the last one's tokens are back."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") and self.world_size == 1

    @property
    def world_size(self) -> int:
        """Worker processes of one engine: TP x PP (1 runs the model in the engine's own process)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def dtype_choice(self, config_dtype: torch.dtype | str | None) -> DtypeChoice:
        """The dtype to run in and why (the rule: ``worker.dtype_choice``); ``config_dtype`` is the
        checkpoint's (float32 if it names none)."""
        if isinstance(config_dtype, torch.dtype):
            checkpoint = config_dtype
        else:
            checkpoint = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.float32)
        requested = None if self.dtype == "auto" else _DTYPES[self.dtype]
        return choose_dtype(requested, checkpoint, self.device, quantized=self.quantization == "gguf")

    def torch_dtype(self, config_dtype: torch.dtype | str | None) -> torch.dtype:
        return self.dtype_choice(config_dtype).dtype
