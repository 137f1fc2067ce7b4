"""``python -m worker.kernels``: build every C++ kernel into the cache now (``make install`` runs it).

Rules:
- Exits 0 even when a kernel cannot be built: serving then uses the PyTorch fallback, so an install on a
  machine without a compiler still succeeds (with one warning line per kernel).
"""

from __future__ import annotations

import logging
import time

from worker.kernels.build import available_extensions, cache_root, load_extension


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in available_extensions():
        started = time.perf_counter()
        if load_extension(name) is not None:
            print(f"C++ kernel {name}: ready in {cache_root()} ({time.perf_counter() - started:.1f}s)")


if __name__ == "__main__":
    main()
