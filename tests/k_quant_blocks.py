"""A small numpy quantizer for GGUF Q4_K and Q6_K blocks, for tests (the gguf package only dequantizes these:
its ``quants.quantize`` raises NotImplementedError for them).

Simple, not llama.cpp's search for the best scales: per sub-block min/max scales, then the 6-bit (Q4_K) or
int8 (Q6_K) scale of each sub-block rounded against one fp16 block scale, then each weight rounded to the
nearest level of its rounded scale. Any bytes laid out this way are valid blocks: ``gguf.quants.dequantize``
decodes them, and that decoding is the reference the tests compare with (never the float weights put in).

Layouts (worker/kernels/csrc/quant_gemm_k.cpp spells them out):
- Q4_K, 144 bytes a 256 weights: fp16 d, fp16 dmin, 12 bytes packing sc[8] and m[8] (6 bits each), 128 bytes
  of nibbles (sub-block 2k in the low halves of bytes 32k..32k+31, 2k+1 in the high); w = d sc q - dmin m.
- Q6_K, 210 bytes: ql[128], qh[64], int8 sc[16], fp16 d; w = d sc (q - 32), q 6 bits.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

QK = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> uint8 blocks [rows, K / 256 * 144]."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-block, weight]
    low = np.minimum(sub.min(-1), 0)  # the offset is -dmin m <= 0: a sub-block's minimum, or 0
    scale, offset = (sub.max(-1) - low) / 15, -low
    d, dmin = _f16(scale.max(-1) / 63), _f16(offset.max(-1) / 63)  # [blocks]
    sc = _ratio(scale, d[:, None], 63).astype(np.uint8)
    m = _ratio(offset, dmin[:, None], 63).astype(np.uint8)
    ds = d.astype(np.float32)[:, None] * sc  # the decoded sub-block scales and offsets
    dm = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + dm[..., None], ds[..., None])), 0, 15).astype(np.uint8)
    packed = np.empty((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    nibbles = q[:, 0::2, :] | (q[:, 1::2, :] << 4)  # [blocks, 4, 32]
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed,
                             nibbles.reshape(-1, 128)], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, K] (K a multiple of 256) -> uint8 blocks [rows, K / 256 * 210]."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # q - 32 in [-31, 31]
    d = _f16(scale.max(-1) / 127)
    sc = _ratio(scale, d[:, None], 127).astype(np.int8)
    ds = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(_safe_div(sub, ds[..., None])), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [blocks, half, run g, weight]
    ql = (q[:, :, 0:2, :] & 15) | ((q[:, :, 2:4, :] & 15) << 4)  # runs 0, 1 low nibbles; 2, 3 high
    qh = sum(((q[:, :, g, :] >> 4) << (2 * g)).astype(np.uint8) for g in range(4))
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)


def _ratio(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    return np.clip(np.rint(_safe_div(values, unit.astype(np.float32))), 0, top)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0)


QUANTIZERS = {GGMLQuantizationType.Q4_K: quantize_q4_k, GGMLQuantizationType.Q6_K: quantize_q6_k}


def quantize(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The k-quants by the quantizers here, any other type by the gguf package's own (Q8_0)."""
    return QUANTIZERS[qtype](w) if qtype in QUANTIZERS else quants.quantize(w, qtype)


def dequantize(blocks: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The gguf package's decoding (the reference), float32."""
    return quants.dequantize(blocks, qtype)


def random_blocks(rows: int, k: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random bytes as blocks (every scale, min and quant bit pattern), the fp16 scales made finite."""
    rng = np.random.default_rng(seed)
    size = 144 if qtype == GGMLQuantizationType.Q4_K else 210
    blocks = rng.integers(0, 256, (rows * k // QK, size), dtype=np.uint8)
    halves = _f16(rng.uniform(-2, 2, (blocks.shape[0], 2))).view(np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:
        blocks[:, 0:4] = halves
    else:
        blocks[:, 208:210] = halves[:, 0:2]
    return blocks.reshape(rows, -1)


def requantize_gguf(src: str, dst: str, target: Callable[[str], GGMLQuantizationType | None]) -> dict[str, str]:
    """Copy the GGUF ``src`` to ``dst`` with each tensor that ``target(name)`` names a type for decoded (by
    gguf) and quantized again to it (a k-quant's row length must be a multiple of 256); metadata and every other
    tensor copied as they are. Returns {tensor name: its type in ``dst``}."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    types = {}
    for tensor in reader.tensors:
        data, qtype = np.asarray(tensor.data), tensor.tensor_type
        new = target(tensor.name)
        if new is not None:
            data, qtype = quantize(quants.dequantize(data, qtype), new), new
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        types[tensor.name] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
