"""Where a ``--model`` path's Hugging Face directory is: a directory is used as is, a GGUF file is
converted once into an HF directory cached on disk. Torch-free, and a leaf like the rest of ``common/``:
the converter is the caller's to pass in.

Rules:
- The cache of a GGUF file is ``$REDSERVE_CACHE_DIR/gguf/<stem>-<sha256 of the file, 16 hex>/``
  (default root ``~/.cache/redserve``): config.json, model.safetensors (float32, the exact dequantized
  values; engines cast to ``--dtype`` at load), generation_config.json and the tokenizer files with the
  chat template. A changed file gets a new directory. To clear the cache, delete ``<root>/gguf/`` (or
  one subdirectory); the next start converts again.
- Two processes may convert at once (DP engines, API workers): each takes an exclusive ``flock`` on
  ``<cache dir>.lock``; the winner writes a temp directory next to the target and renames it into place
  (atomic), the others wait on the lock and then find the directory done. Temp directories left by a
  killed conversion are removed by the next one.
- `check_gguf` reads only the GGUF header (gguf-py, numpy): an architecture outside `GGUF_ARCHITECTURES`
  or a tensor type outside `GGUF_TENSOR_TYPES`, or missing shape metadata (`GGUF_REQUIRED_KEYS`), is a
  `ValueError` naming what was found and what is supported, before any conversion starts.
- The conversion needs torch. `resolve_model_dir` takes the `Converter` to run: a process that has torch
  (the engine's config, ``worker.config``) passes ``worker.gguf_model.convert_gguf`` and converts in
  itself; a torch-free one (the API, the launcher) passes `convert_in_child`, which runs
  ``python -m worker.gguf_model`` in a child Python: a command line, not an import, so neither this
  module nor its caller loads torch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

# GGUF ``general.architecture`` -> the HF architecture our engine runs (worker.model_loader.ARCHITECTURES).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Shape metadata every served file must carry (``{architecture}.{key}``).
GGUF_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                      "context_length")
# Tensor types that transformers dequantizes (through gguf-py) and that we have served.
GGUF_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
# The converter's command line (``python -m <this> GGUF OUT_DIR ARCHITECTURE``), for `convert_in_child`.
CHILD_CONVERTER = "worker.gguf_model"

Converter = Callable[[str, Path, str], None]
"""Writes the HF directory of a GGUF file: ``convert(gguf_path, out_dir, architecture)``."""


def is_gguf(model: str | os.PathLike) -> bool:
    return str(model).lower().endswith(".gguf")


def cache_root() -> Path:
    root = os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve"
    return Path(root).expanduser() / "gguf"


def file_digest(path: str | os.PathLike) -> str:
    """sha256 of the file, computed once per process for a given path, size and mtime."""
    stat = os.stat(path)
    return _digest(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_cache_dir(gguf_path: str | os.PathLike) -> Path:
    """The HF directory that `gguf_path` converts to (see the module rules)."""
    path = Path(gguf_path)
    return cache_root() / f"{path.stem}-{file_digest(path)[:16]}"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / "config.json").is_file() and (out_dir / "tokenizer.json").is_file()


def check_gguf(gguf_path: str | os.PathLike) -> str:
    """The HF architecture name of `gguf_path`; ValueError if we cannot serve it (see the module rules)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ValueError("serving a GGUF file needs the gguf package: pip install 'redserve[gguf]'") from e
    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read GGUF file {gguf_path}: {e}") from e
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {gguf_path}; "
                         f"supported: {sorted(GGUF_ARCHITECTURES)}")
    missing = [f"{arch}.{key}" for key in GGUF_REQUIRED_KEYS if f"{arch}.{key}" not in reader.fields]
    if missing:  # transformers would fill in a default (7B) shape and run out of memory converting it
        raise ValueError(f"GGUF file {gguf_path} lacks the model shape metadata {missing}; it cannot be served")
    types = {t.tensor_type.name for t in reader.tensors}
    if types - GGUF_TENSOR_TYPES:
        raise ValueError(f"unsupported GGUF tensor types {sorted(types - GGUF_TENSOR_TYPES)} in {gguf_path}; "
                         f"supported: {sorted(GGUF_TENSOR_TYPES)}")
    return GGUF_ARCHITECTURES[arch]


def resolve_model_dir(model: str, convert: Converter) -> str:
    """`model` itself unless it is a GGUF file, else its converted cache directory (converted by `convert`
    if missing)."""
    if not is_gguf(model):
        return model
    if not os.path.isfile(model):
        raise ValueError(f"GGUF file not found: {model}")
    out = gguf_cache_dir(model)
    if is_converted(out):
        return str(out)
    architecture = check_gguf(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out.with_name(out.name + ".lock")):
        if not is_converted(out):  # another process may have finished while we waited
            _remove_stale_temp_dirs(out)
            _convert(model, out, architecture, convert)
    return str(out)


def convert_in_child(model: str, out_dir: Path, architecture: str) -> None:
    """A `Converter` for a torch-free process: the conversion runs in a child Python; ValueError with its
    stderr if it fails."""
    done = subprocess.run([sys.executable, "-m", CHILD_CONVERTER, model, str(out_dir), architecture],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ValueError(f"converting {model} failed: {done.stderr.strip()[-2000:]}")


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_temp_dirs(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _convert(model: str, out: Path, architecture: str, convert: Converter) -> None:
    logger.info("converting GGUF %s into %s (once; cached)", model, out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        convert(model, tmp, architecture)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared $REDSERVE_CACHE_DIR from other users
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
