"""GGUF model resolution (common.model_source) without real weights: checks, cache naming, locking.

The real-weight path (SmolLM2 GGUF converted, served and compared with transformers) is tests/test_smollm2.py.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from common.model_source import convert_in_child, gguf_cache_dir, resolve_model_dir  # noqa: E402


def write_gguf(path: Path, arch: str, tensor_type: str = "F32", without: str | None = None) -> str:
    """A header-valid GGUF with one tensor; tiny hyperparameters (less the key `without`), no tokenizer
    (it cannot be served)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 4), ("attention.head_count_kv", 4), ("context_length", 64),
                       ("vocab_size", 4)):
        if key != without:
            writer.add_uint32(f"{arch}.{key}", value)
    if tensor_type == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        writer.add_tensor("token_embd.weight", np.zeros((1, block_bytes), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("REDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def fake_convert(calls: list, delay: float = 0.0):
    def convert(model: str, out_dir: Path, architecture: str) -> None:
        calls.append(architecture)
        time.sleep(delay)  # widen the race window; correctness never depends on it
        for name in ("config.json", "tokenizer.json"):
            (out_dir / name).write_text("{}")
    return convert


def never_convert(model: str, out_dir: Path, architecture: str) -> None:
    raise AssertionError(f"{model} was converted; the checks should have refused it first")


def test_a_directory_is_used_as_is(tmp_path) -> None:
    assert resolve_model_dir(str(tmp_path), never_convert) == str(tmp_path)


def test_a_missing_gguf_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "absent.gguf"), never_convert)


def test_unsupported_architecture_names_what_was_found_and_what_is_supported(tmp_path, cache_dir) -> None:
    path = write_gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*supported: \['llama'"):
        resolve_model_dir(path, never_convert)
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_unsupported_quantization_names_what_was_found_and_what_is_supported(tmp_path, cache_dir) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", "IQ2_XXS")
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor types \['IQ2_XXS'\].*supported: .*'Q4_1'"):
        resolve_model_dir(path, never_convert)


@pytest.mark.parametrize("key", ["block_count", "embedding_length", "attention.head_count"])
def test_missing_shape_metadata_is_refused_before_converting(tmp_path, cache_dir, key) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama", without=key)
    with pytest.raises(ValueError, match=rf"lacks the model shape metadata \['llama\.{key}'\]"):
        resolve_model_dir(path, never_convert)


def test_the_cache_directory_is_named_by_stem_and_content(tmp_path, cache_dir) -> None:
    a = write_gguf(tmp_path / "m.gguf", "llama")
    first = gguf_cache_dir(a)
    assert first.parent == cache_dir and first.name.startswith("m-")
    write_gguf(tmp_path / "m.gguf", "qwen2")  # same name, other content: another cache entry
    assert gguf_cache_dir(a) != first


def test_concurrent_resolves_convert_once_and_agree(tmp_path, cache_dir) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama")
    calls: list[str] = []
    convert = fake_convert(calls, delay=0.5)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(path, convert))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["LlamaForCausalLM"]
    assert len(set(results)) == 1 and (Path(results[0]) / "config.json").is_file()


def test_a_killed_conversion_leaves_no_target_and_is_cleaned_up(tmp_path, cache_dir) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama")

    target = gguf_cache_dir(path)

    def crash(model: str, out_dir: Path, architecture: str) -> None:
        (target.parent / f".{target.name}.tmp-crashed").mkdir()  # as a SIGKILL mid-conversion would leave it
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        resolve_model_dir(path, crash)
    assert not target.exists()
    calls: list[str] = []
    assert resolve_model_dir(path, fake_convert(calls)) == str(target)
    assert not list(cache_dir.glob(".*.tmp-*"))


def test_a_failed_subprocess_conversion_reports_its_error(tmp_path, cache_dir) -> None:
    path = write_gguf(tmp_path / "m.gguf", "llama")  # no tokenizer in it: the conversion fails
    with pytest.raises(ValueError, match="converting .* failed: .+"):
        resolve_model_dir(path, convert_in_child)
    assert not gguf_cache_dir(path).exists() and not list(cache_dir.glob(".*.tmp-*"))


def test_resolving_is_torch_free(tmp_path, cache_dir) -> None:
    import subprocess

    path = write_gguf(tmp_path / "m.gguf", "gpt2")
    code = ("import sys\nfrom common.model_source import convert_in_child, resolve_model_dir\n"
            f"try:\n    resolve_model_dir({path!r}, convert_in_child)\nexcept ValueError:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
