"""Build and load redserve's C++ CPU kernels (``worker/kernels/csrc/<name>.cpp``) as torch extensions.

Rules:
- ``load_extension(name)`` returns the compiled module, or None when it cannot be had (no C++ compiler,
  no ninja, a failed build, ``REDSERVE_NO_KERNELS=1`` or a comma list naming it, for A/B runs); a None
  logs exactly one warning line and the caller uses its pure-PyTorch path. A result (module or None)
  is kept for the life of the process.
- Builds are cached in ``cache_root()`` (default ``~/.cache/redserve/kernels``), one dir
  per (sources' and ``csrc/*.h`` headers' content, torch version, compiler flags, CPU flags): ``-march=native`` code is only ever
  loaded on the CPU it was built for, and an edit to a source or a torch upgrade builds afresh.
- A file lock per build dir makes concurrent processes (engines, TP workers) build once and wait for it;
  a build killed midway (timeout, Ctrl-C) leaves nothing that blocks the next one.
- The sources and headers are compiled from a copy inside the build dir, never from where they lie, so two
  checkouts (or an installed copy and a dev tree) with the same key share one build: torch's ninja file
  names its sources by path, and a different path would rebuild it, each checkout undoing the other's. For
  the same reason the key holds where torch and Python are installed (the ninja command names their include
  dirs): a second venv (a CI clone's) builds its own dir, where it had rebuilt the first venv's and left every
  kernel of the next `serve` there to build again (3 minutes to READY on 2 cores).
- ``cflags`` adds compiler flags after ``CFLAGS`` (part of the build key): tests build a kernel again with
  ``-mno-avx512vnni -mno-avxvnni`` or ``-mno-avx2`` to run the code paths of CPUs without those features.
- ``python -m worker.kernels`` builds every ``csrc/*.cpp`` (``make install`` runs it), so serving finds
  the build in the cache instead of compiling on its first request.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
_LAYOUT = "src/"  # where in a build dir the sources are compiled from (`_copy_sources`): part of the key


def cache_root() -> Path:
    """``$REDSERVE_KERNEL_CACHE_DIR``, else ``kernels/`` under ``$REDSERVE_CACHE_DIR`` (default ``~/.cache/redserve``)."""
    if os.environ.get("REDSERVE_KERNEL_CACHE_DIR"):
        return Path(os.environ["REDSERVE_KERNEL_CACHE_DIR"])
    root = os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve"
    return Path(root) / "kernels"


def available_extensions() -> list[str]:
    """Names of the extensions whose sources ship in ``csrc/``."""
    return sorted(path.stem for path in CSRC.glob("*.cpp"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def build_key(sources: list[Path], cflags: tuple[str, ...] = ()) -> str:
    """16 hex digits over everything that makes a build unfit for reuse."""
    digest = hashlib.sha256()
    for path in [*sources, *_headers(sources)]:  # the shared headers any source may include
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (torch.__version__, " ".join(CFLAGS + cflags + LDFLAGS), _cpu_flags(), _LAYOUT, _install_dirs()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _install_dirs() -> str:
    """Where torch and this Python live: the ninja command's include dirs."""
    return f"{Path(torch.__file__).resolve().parent} {sys.prefix} {sys.base_prefix}"


def _missing_tool() -> str | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) on PATH"
    try:
        import ninja
    except ImportError:
        return "the ninja package is not installed"
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"  # torch runs `ninja` by name
    return None


@functools.cache
def load_extension(name: str, sources: tuple[Path, ...] | None = None, cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """The module built from ``sources`` (default ``csrc/<name>.cpp``) with ``CFLAGS + cflags``, or None (one
    warning) if unbuildable."""
    disabled = os.environ.get("REDSERVE_NO_KERNELS", "")
    if disabled == "1" or name in disabled.split(","):
        logger.warning("C++ kernel %r disabled by REDSERVE_NO_KERNELS=%s; using the PyTorch fallback", name, disabled)
        return None
    reason = _missing_tool()
    if reason is not None:
        logger.warning("C++ kernel %r not built (%s); using the PyTorch fallback", name, reason)
        return None
    paths = [Path(s) for s in sources] if sources else [CSRC / f"{name}.cpp"]
    try:
        return _build(name, paths, tuple(cflags))
    except Exception as exc:  # a compiler error must never stop serving: the fallback is correct
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = next((line for line in lines if "error" in line.lower() and "building" not in line), lines[0])
        logger.warning("C++ kernel %r failed to build (%s); using the PyTorch fallback", name, first[:200])
        logger.debug("C++ kernel %r build error", name, exc_info=True)
        return None


def _build(name: str, sources: list[Path], cflags: tuple[str, ...] = ()) -> ModuleType:
    from filelock import FileLock
    from torch.utils import cpp_extension

    build_dir = cache_root() / f"{name}-{build_key(sources, cflags)}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(build_dir) + ".lock"):
        # torch's own baton file: a build killed midway leaves it behind and every later load would wait on
        # it forever. Under our lock (released by the OS when its holder dies) nobody else is building.
        (build_dir / "lock").unlink(missing_ok=True)
        copies = _copy_sources(build_dir / "src", sources)
        return cpp_extension.load(name=name, sources=[str(s) for s in copies], build_directory=str(build_dir),
                                  extra_cflags=[*CFLAGS, *cflags], extra_ldflags=list(LDFLAGS), verbose=False)


def _headers(sources: list[Path]) -> list[Path]:
    """The shared headers, each from the first source's folder where it has one (another revision's sources
    built beside these: benchmarks/bench_quant_kernel.py), else from ``csrc``."""
    own = Path(sources[0]).parent if sources else CSRC
    return [own / h.name if (own / h.name).is_file() else h for h in sorted(CSRC.glob("*.h"))]


def _copy_sources(into: Path, sources: list[Path]) -> list[Path]:
    """``sources`` and the shared headers copied into ``into`` (a file already there with the same bytes is
    left alone, so its timestamp does not make ninja rebuild); the copies of ``sources``."""
    into.mkdir(exist_ok=True)
    for path in [*sources, *_headers(sources)]:
        copy = into / path.name
        data = path.read_bytes()
        if not copy.is_file() or copy.read_bytes() != data:
            copy.write_bytes(data)
    return [into / path.name for path in sources]
