"""Whether a device runs the project's Triton kernels: the paged attention (``worker.kernels.triton_attention``)
and the layer ops (``worker.kernels.triton_ops``: RMSNorm with the residual add, RoPE, SiLU-and-mul).

Rules:
- CUDA takes them where triton imports and every kernel compiles and runs on that device (`triton_smoke_test`,
  once per device, at the engine's first step or the model's build); a failure logs one warning with the
  reason and the torch paths serve. No other device takes them by default.
- ``REDSERVE_TRITON_ATTENTION=0`` keeps CUDA on the torch paths; ``=1`` puts any device on the Triton path
  without the smoke test (a CPU only under ``TRITON_INTERPRET=1``: the tests run whole models that way).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

MODULES = ("triton_attention", "triton_ops")


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """``worker.kernels.<name>``, or None where triton is not installed."""
    try:
        return importlib.import_module(f"worker.kernels.{name}")
    except ImportError as exc:
        logger.info("Triton kernels unavailable (%s): the torch paths serve", exc)
        return None


def use_triton(device: torch.device) -> bool:
    """Whether steps on ``device`` run the Triton kernels (see the module rules)."""
    wanted = os.environ.get("REDSERVE_TRITON_ATTENTION", "")
    if wanted == "0" or (wanted != "1" and device.type != "cuda"):
        return False
    if any(triton_module(name) is None for name in MODULES):
        return False
    return wanted == "1" or triton_smoke_test(str(device)) is None


@functools.cache
def triton_smoke_test(device: str) -> str | None:
    """Why the Triton kernels cannot serve on ``device`` (one failed to compile or to run), or None."""
    try:
        for name in MODULES:
            triton_module(name).smoke_test(torch.device(device))
    except Exception as exc:  # noqa: BLE001 - a toolchain problem must leave serving on the torch paths
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        logger.warning("Triton kernels failed their smoke test on %s (%s); using the torch paths", device,
                       reason[:300])
        return reason
    return None
