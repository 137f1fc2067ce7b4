"""The Triton kernel modules for tests: compiled on a GPU, or run by the Triton interpreter on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when it decorates a kernel (its own library's included, at ``import
triton``) and again when one runs. Without a GPU, `load` sets it from before triton's first import until
the kernel module is imported, and the tests set it around each test (the ``interpret`` fixture they
define with `INTERPRET_ENV`), never for the rest of the run. Import this before anything imports triton.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

_interpreting = False  # triton was first imported here, under the interpreter


def load(name: str) -> tuple[ModuleType, torch.device, bool]:
    """(``worker.kernels.<name>``, the device its tests run on, whether interpreted); skips the calling
    module where triton is missing or was imported before the interpreter could be set up."""
    global _interpreting
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        _interpreting = True
    set_here = _interpreting and "TRITON_INTERPRET" not in os.environ
    if set_here:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        from worker.layers.triton_path import MODULES, triton_module

        for each in MODULES:  # all of them now, under the interpreter, whichever test module comes first
            triton_module(each)
        module = triton_module(name)
    finally:
        if set_here:
            del os.environ["TRITON_INTERPRET"]
    if module is None:
        pytest.skip(f"worker.kernels.{name} does not import", allow_module_level=True)
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = any(isinstance(v, InterpretedFunction) for v in vars(module).values())
    if not (interpreted or torch.cuda.is_available()):
        pytest.skip("no GPU, and triton was imported before this module could set TRITON_INTERPRET=1 "
                    "(run it with TRITON_INTERPRET=1)", allow_module_level=True)
    return module, torch.device("cpu" if interpreted else "cuda"), interpreted
