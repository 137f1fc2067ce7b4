"""Optional C++ CPU kernels; every one has a pure-PyTorch fallback (see ``worker.kernels.build``)."""

from worker.kernels.build import available_extensions, load_extension

__all__ = ["available_extensions", "load_extension"]
