"""Which GPUs each DP engine of a one-host stack gets.

Rules:
- Engine ``r`` of a stack with TP size ``T`` gets the ``T`` devices ``r*T .. r*T+T-1`` of the devices the
  launcher may use: the user's ``CUDA_VISIBLE_DEVICES`` list when set (engines pick from it), else
  ``0 .. count-1``. Its TP workers then see them as ``cuda:0 .. cuda:T-1``.
- No CUDA device (and no ``CUDA_VISIBLE_DEVICES`` of the user's): nothing is set, the engines run on the CPU.
- DP x TP larger than the devices at hand is a clear error before any engine starts.
- GPUs are counted without importing torch (the ``serve`` launcher never loads it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Mapping

NVIDIA_PROC_GPUS = "/proc/driver/nvidia/gpus"


def visible_devices(environ: Mapping[str, str], cuda_device_count: int) -> list[str]:
    """The device ids the stack may hand out: the user's CUDA_VISIBLE_DEVICES list, else every device."""
    user = environ.get("CUDA_VISIBLE_DEVICES")
    if user is not None:
        return [d.strip() for d in user.split(",") if d.strip()]
    return [str(i) for i in range(cuda_device_count)]


def engine_cuda_devices(dp_rank: int, tp_size: int, devices: list[str]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value of engine ``dp_rank``: its slice of ``devices`` (``tp_size`` is the
    engine's worker count, TP x PP)."""
    start = dp_rank * tp_size
    if start + tp_size > len(devices):
        raise ValueError(f"engine {dp_rank} needs devices {start}..{start + tp_size - 1} ({tp_size} workers: TP x PP) "
                         f"but only {len(devices)} are visible ({','.join(devices) or 'none'}); lower "
                         f"--data-parallel-size, --tensor-parallel-size or --pipeline-parallel-size, or set "
                         f"CUDA_VISIBLE_DEVICES")
    return ",".join(devices[start:start + tp_size])


def engine_device_env(dp_rank: int, tp_size: int, environ: Mapping[str, str] = os.environ,
                      cuda_device_count: int | None = None) -> dict[str, str]:
    """Environment to add to engine ``dp_rank``'s: ``CUDA_VISIBLE_DEVICES`` when CUDA devices exist."""
    if cuda_device_count is None:
        cuda_device_count = _cuda_device_count()
    devices = visible_devices(environ, cuda_device_count)
    if not devices or cuda_device_count == 0:
        return {}
    return {"CUDA_VISIBLE_DEVICES": engine_cuda_devices(dp_rank, tp_size, devices)}


def _cuda_device_count() -> int:
    """NVIDIA GPUs on this host, read without torch (the launcher stays torch-free): the driver's
    /proc entries, else ``nvidia-smi -L``; 0 when neither is there."""
    with contextlib.suppress(OSError):
        return len(os.listdir(NVIDIA_PROC_GPUS))
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return 0
    try:
        out = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())
