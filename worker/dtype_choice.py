"""Which dtype an engine runs in, and why: ``--dtype auto`` picks the fastest dtype that is safe on the
hardware found; a forced dtype the CPU cannot compute natively gets one warning.

Rules:
- CUDA, auto: the checkpoint's dtype when it is bfloat16 or float16; a float32 checkpoint runs in
  bfloat16 where the GPU supports it, else float16 (as vLLM).
- CPU, auto: bfloat16 when the CPU computes bfloat16 natively and the checkpoint is bfloat16 or float16, or the
  weights are GGUF blocks (Arm BF16 included), or the checkpoint is float32 (a GGUF file's dequantized
  conversion included) and the CPU is an x86 one with AMX-BF16 tiles or AVX512-BF16; everything else runs in
  float32. vLLM's CPU build narrows every float32 checkpoint to bfloat16; here only where it was measured to
  win, served, against float32: on a 2-core Xeon with AMX (5 Dec 2026) the tiny model's c=64 throughput 2.1x and
  c=1 TPOT 0.54x, SmolLM2 Q4_1 blocks 2.6x and 0.94x; on a 2-core AMD EPYC (Zen 4, AVX512-BF16 without AMX,
  6 Dec 2026, once the bf16 kernels used its dot products: csrc/bf16_rows.h, small_gemm's bf16 path) the tiny
  model's c=64 1.71x and c=1 TPOT 0.57x (1,621 against 947 tok/s, 3.90 against 6.85 ms; vLLM bf16 1,127 tok/s and
  7.21 ms in that sitting), SmolLM2 Q4_1 blocks c=64 2.08x and c=1 TPOT 0.76x (470.6 against 225.8
  tok/s, 9.2 against 12.2 ms). (Before those kernels, 4 Dec 2026, bfloat16 lost there at one stream: 10.7
  against 7.9 ms.) Arm's BF16 float32 rule is unmeasured, so a float32 checkpoint stays float32 there. Without
  native bfloat16 a bf16 matmul is emulated and several times slower than float32 at batch > 1.
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
X86_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})  # where a float32 checkpoint's bf16 was measured to win


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
    x86_bf16 = sorted(X86_BF16_FLAGS & (cpu_flags() if flags is None else flags))
    if checkpoint == torch.float32 and x86_bf16:
        return DtypeChoice(torch.bfloat16, f"auto: float32 checkpoint, CPU with {x86_bf16[0]}")
    if checkpoint in HALF_DTYPES:
        return DtypeChoice(torch.float32, f"auto: {name} checkpoint, CPU without native bfloat16")
    return DtypeChoice(torch.float32, f"auto: {name} checkpoint")
