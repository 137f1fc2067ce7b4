"""Which dtype an engine runs in, and why: ``--dtype auto`` picks the fastest dtype that is safe on the
hardware found; a forced dtype the CPU cannot compute natively gets one warning.

Rules:
- CUDA, auto: the checkpoint's dtype when it is bfloat16 or float16; a float32 checkpoint runs in
  bfloat16 where the GPU supports it, else float16 (as vLLM).
- CPU, auto: bfloat16 when the checkpoint is bfloat16 or float16, or the weights GGUF blocks, and the CPU
  computes bfloat16 natively (x86 AMX-BF16 or AVX512-BF16, Arm BF16), and for a float32 checkpoint (a GGUF
  file's dequantized conversion included) where the CPU has AMX-BF16 tiles; everything else runs in float32. vLLM's CPU build narrows
  every float32 checkpoint to bfloat16; here only where it was measured to win: on a 2-core Xeon with AMX
  (5 Dec 2026, served, against float32) the tiny model's c=64 throughput 2.1x and c=1 TPOT 0.54x,
  SmolLM2 Q4_1 blocks 2.6x and 0.94x. With AVX512-BF16 alone (AMD EPYC, 4 Dec 2026) bfloat16 lost at one
  stream (c=1 TPOT 10.7 against 7.9 ms), so a float32 checkpoint stays float32 there; but GGUF blocks
  (``--quantization gguf``) run in bfloat16 wherever the CPU has it: their many-row products use its bf16
  dot products (quant_gemm.cpp ``dot_matmul``) and one stream's the int8 path in either dtype. SmolLM2 Q4_1
  on a 2-core AMD EPYC (Zen 4, AVX512-BF16 without AMX; 6 Dec 2026, served by `bench_vs_vllm.py`, one
  sitting), bfloat16 against float32: c=64 470.6 against 225.8 tok/s, c=1 TPOT 9.2 against 12.2 ms. Without native bfloat16 a bf16 matmul is emulated and several times slower than
  float32 at batch > 1.
- CPU, forced: bfloat16 without native bfloat16, or float16 without native float16 (AMX-FP16,
  AVX512-FP16, Arm FP16 arithmetic), runs as asked, with one warning line at start.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

CPU_NATIVE_FLAGS = {
    torch.bfloat16: {"amx_bf16", "avx512_bf16", "bf16"},
    torch.float16: {"amx_fp16", "avx512_fp16", "fphp", "asimdhp"},
}
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str
    warning: str | None = None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (x86 ``flags``, Arm ``Features``); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_native(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes ``dtype`` natively (float32 always)."""
    if dtype not in CPU_NATIVE_FLAGS:
        return True
    return bool(CPU_NATIVE_FLAGS[dtype] & (cpu_flags() if flags is None else flags))


def choose_dtype(requested: torch.dtype | None, checkpoint: torch.dtype, device: str,
                 flags: frozenset[str] | None = None, cuda_bf16: bool | None = None,
                 quantized: bool = False) -> DtypeChoice:
    """``requested`` None means auto. ``flags`` and ``cuda_bf16`` default to this machine's. ``quantized``: the
    weights are served as GGUF blocks (``--quantization gguf``)."""
    name = str(checkpoint).removeprefix("torch.")
    if not device.startswith("cpu"):
        if requested is not None:
            return DtypeChoice(requested, "set by --dtype")
        if checkpoint in HALF_DTYPES:
            return DtypeChoice(checkpoint, f"auto: the checkpoint's dtype ({name})")
        bf16 = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        return DtypeChoice(torch.bfloat16 if bf16 else torch.float16,
                           f"auto: {name} checkpoint on a GPU {'with' if bf16 else 'without'} bfloat16")
    if requested is not None:
        if cpu_native(requested, flags):
            return DtypeChoice(requested, "set by --dtype")
        wanted = str(requested).removeprefix("torch.")
        return DtypeChoice(requested, "set by --dtype",
                           f"--dtype {wanted}: this CPU has no native {wanted} arithmetic, so matmuls are emulated "
                           f"and slow (several times float32 at batch > 1); --dtype auto picks float32 here")
    if checkpoint in HALF_DTYPES and cpu_native(torch.bfloat16, flags):
        return DtypeChoice(torch.bfloat16, f"auto: {name} checkpoint, CPU with native bfloat16")
    if quantized and cpu_native(torch.bfloat16, flags):
        return DtypeChoice(torch.bfloat16, "auto: GGUF blocks, CPU with native bfloat16")
    if checkpoint == torch.float32 and "amx_bf16" in (cpu_flags() if flags is None else flags):
        return DtypeChoice(torch.bfloat16, "auto: float32 checkpoint, CPU with AMX bfloat16 tiles")
    if checkpoint in HALF_DTYPES:
        return DtypeChoice(torch.float32, f"auto: {name} checkpoint, CPU without native bfloat16")
    return DtypeChoice(torch.float32, f"auto: {name} checkpoint")
