"""Convert a GGUF file into a Hugging Face directory our loader reads (see ``common.model_source``).

Rules:
- transformers reads the GGUF (``from_pretrained(dir, gguf_file=name)``) and dequantizes every tensor
  to float32; we write those exact values as ``model.safetensors`` (tied embeddings once, as
  ``save_pretrained`` would), config.json without the GGUF quantization marker and with
  ``architectures`` and ``dtype`` set, generation_config.json, and the tokenizer files with the chat
  template from the file.
- ``python -m worker.gguf_model GGUF OUT_DIR ARCHITECTURE`` does the same in a child process (the
  torch-free API converts this way, ``common.model_source.convert_in_child``); errors go to stderr
  with exit code 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def convert_gguf(gguf_path: str, out_dir: str | os.PathLike, architecture: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    out = Path(out_dir)
    save_file(_unique_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = [architecture]
    config.dtype = "float32"
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _unique_tensors(model) -> dict:
    """The state dict with each shared tensor once (the tied lm_head is dropped, the loader re-ties it)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    return tensors


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m worker.gguf_model GGUF OUT_DIR ARCHITECTURE", file=sys.stderr)
        return 2
    try:
        convert_gguf(*argv)
    except Exception as e:  # noqa: BLE001 (reported to the parent through stderr)
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
