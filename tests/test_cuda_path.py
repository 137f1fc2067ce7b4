"""What a CUDA start needs, proven on the CPU: every model and RoPE variant builds on a non-CPU default
device (``meta`` exposes any tensor left on the CPU), and the KV cache is sized from device memory after
a profile run (a fake memory reporter stands in for the GPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from worker.config import EngineConfig
from worker.device_memory import MemorySnapshot, kv_cache_budget
from worker.layers.rotary import RotaryEmbedding
from worker.model_loader import ARCHITECTURES
from worker.model_runner import ModelRunner
from worker.models.tiny_model import tiny_config
from worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel

GiB = 1 << 30
MiB = 1 << 20

ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 64},
}

# The make-tiny-model arch that builds each served architecture's own config class.
TINY_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
             "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}


def _config(arch: str, rope: dict | None):
    config = tiny_config(TINY_ARCH.get(arch, "llama"), hidden_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256,
                         max_position_embeddings=256)
    config.architectures = [arch]
    if rope is not None:
        config.rope_parameters = {**rope, "rope_theta": 10000.0}
    return config


@pytest.fixture
def tp1():
    init_tensor_parallel(0, 1, "", torch.device("cpu"))
    yield
    destroy_tensor_parallel()


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_model_and_rope_builds_on_a_non_cpu_default_device(tp1, arch: str, rope: str) -> None:
    config = _config(arch, ROPE_VARIANTS[rope])
    meta = torch.device("meta")
    with meta:  # as build_model does with the engine's device (cuda:N)
        model = ARCHITECTURES[arch](config, torch.float32, meta, 256)
    placed = {name: t.device for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert placed and all(d == meta for d in placed.values()), placed
    rotary = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    q, k = torch.empty(3, 4, 16, device=meta), torch.empty(3, 2, 16, device=meta)
    q_out, k_out = rotary(torch.arange(3, device=meta), q, k)
    assert q_out.device == meta and k_out.shape == k.shape


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
def test_rope_tables_do_not_depend_on_the_default_device(rope: str) -> None:
    config = _config("LlamaForCausalLM", ROPE_VARIANTS[rope])
    cpu = RotaryEmbedding(config, 16, 256, torch.device("cpu"), torch.float32)
    with torch.device("meta"):
        RotaryEmbedding(config, 16, 256, torch.device("meta"), torch.float32)  # builds, and leaves `cpu` alone
    assert torch.isfinite(cpu.cos).all() and cpu.cos.shape == (256, 8)


# --- KV cache sizing from device memory ---------------------------------------------------------------------


def test_budget_is_the_allowed_share_minus_weights_activations_and_foreign_use() -> None:
    snap = MemorySnapshot(total=80 * GiB, free=60 * GiB, torch_peak=20 * GiB, torch_allocated=16 * GiB,
                          torch_reserved=17 * GiB)
    # non-torch 3 GiB, activations 20 - 16 - 1 (probe) = 3 GiB: 0.9 * 80 - (3 + 17 + 3) = 49 GiB
    assert kv_cache_budget(snap, 0.9, probe_kv_bytes=1 * GiB) == 49 * GiB


def test_memory_of_other_processes_is_not_ours_and_the_budget_is_never_negative() -> None:
    crowded = MemorySnapshot(total=80 * GiB, free=10 * GiB, torch_peak=5 * GiB, torch_allocated=4 * GiB,
                             torch_reserved=4 * GiB)  # another process holds 66 GiB
    # free 10 - activations 1 - the 10 % kept back (8)
    assert kv_cache_budget(crowded, 0.9) == 1 * GiB
    full = MemorySnapshot(total=8 * GiB, free=0, torch_peak=8 * GiB, torch_allocated=7 * GiB,
                          torch_reserved=8 * GiB)
    assert kv_cache_budget(full, 0.5) == 0


class FakeDeviceMemory:
    """A GPU of `total` bytes holding the runner's weights: reports what the profile run would measure.
    The peak it reports is what the runner really allocated as KV cache during the profile, plus a fixed
    amount of activations, so a probe cache that is never allocated (or a huge one) shows up."""

    def __init__(self, runner: ModelRunner, total: int, weights: int, activations: int) -> None:
        self.runner, self.total, self.weights, self.activations = runner, total, weights, activations
        self.peak_kv = 0
        self.calls: list[str] = []
        original = runner.profile_run

        def profile_run(num_tokens: int) -> None:
            self.peak_kv = max(self.peak_kv, sum(t.numel() * t.element_size() for t in runner.kv_caches))
            self.calls.append(f"profile_run({num_tokens})")
            original(num_tokens)

        runner.profile_run = profile_run

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def release_cached(self) -> None:
        assert self.runner.kv_caches == [], "the probe cache must be freed before the real one is sized"
        self.calls.append("release_cached")

    def snapshot(self) -> MemorySnapshot:
        used = self.weights + 512 * MiB  # weights + CUDA context
        return MemorySnapshot(total=self.total, free=self.total - used, torch_peak=self.weights + self.peak_kv
                              + self.activations, torch_allocated=self.weights, torch_reserved=self.weights)


@pytest.fixture
def long_context_model(tiny_llama_dir: str, tmp_path) -> str:
    target = tmp_path / "long-llama"
    shutil.copytree(tiny_llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def test_a_long_context_model_gets_a_cache_sized_from_device_memory(tp1, long_context_model: str) -> None:
    config = EngineConfig(model=long_context_model, dtype="float32", device="cpu", max_model_len=8192,
                          max_num_batched_tokens=256, gpu_memory_utilization=0.9)
    runner = ModelRunner(config)
    memory = FakeDeviceMemory(runner, total=4 * GiB, weights=1 * GiB, activations=256 * MiB)
    runner.memory = memory
    blocks = runner.determine_num_kv_blocks()
    assert memory.calls == ["reset_peak", "profile_run(256)", "release_cached"]
    assert 0 < memory.peak_kv < 8192 // 16 * runner.kv_bytes_per_block  # a probe cache, not a full one
    # 0.9 * 4 GiB - (0.5 GiB context + 1 GiB weights + 0.25 GiB activations) = 1.85 GiB of KV cache
    assert blocks == int((0.9 * 4 * GiB - 1.75 * GiB) // runner.kv_bytes_per_block)
    assert blocks * config.block_size >= 8192
    runner.init_kv_cache(blocks)
    assert runner.kv_caches[0].shape[1] == blocks * config.block_size


def test_too_little_device_memory_says_which_flag_to_change(tp1, long_context_model: str) -> None:
    config = EngineConfig(model=long_context_model, dtype="float32", device="cpu", max_model_len=8192,
                          max_num_batched_tokens=256, gpu_memory_utilization=0.5)
    runner = ModelRunner(config)
    runner.memory = FakeDeviceMemory(runner, total=2 * GiB, weights=1 * GiB - 64 * MiB, activations=0)
    with pytest.raises(Exception, match="--gpu-memory-utilization"):
        runner.init_kv_cache(runner.determine_num_kv_blocks())


# --- on a real GPU (scripts/gpu-check.sh) ----------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_cuda_engine_starts_with_a_long_context_and_matches_the_cpu(long_context_model: str, rope: str) -> None:
    from engine import LLM, SamplingParams

    config_path = Path(long_context_model) / "config.json"
    config = json.loads(config_path.read_text())
    if ROPE_VARIANTS[rope] is not None:
        config.pop("rope_parameters", None)
        config["rope_scaling"] = ROPE_VARIANTS[rope]
    config_path.write_text(json.dumps(config))
    prompts = [[5, 17, 99, 4, 250, 31], list(range(40, 140))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gpu = LLM(long_context_model, dtype="float32", device="cuda", max_model_len=8192)
    try:
        assert gpu.engine.num_kv_blocks * 16 >= 8192  # sized from device memory after the profile run
        on_gpu = [o.outputs[0].token_ids for o in gpu.generate(prompts, params)]
    finally:
        gpu.engine.executor.shutdown()
    cpu = LLM(long_context_model, dtype="float32", device="cpu", max_model_len=8192)
    assert on_gpu == [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
