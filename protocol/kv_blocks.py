"""The KV tier's block format: what an engine writes for one full prefix block, and the namespace it writes under.

Rules:
- A stored block is one value: a fixed header (magic ``RSKV``, format version, token count, piece count,
  CRC-32 of everything after the header), the length of each piece, the block's token ids (int32), then the
  pieces. A piece is one model rank's share of the block's KV (every layer's K and V of its KV heads, as the
  rank's cache holds them); an engine with TP = 1 writes one piece.
- ``decode_block`` refuses (``CorruptBlock``) a value whose magic, version, lengths or checksum are wrong, or
  whose tokens are not the block's: a reader never loads KV it cannot vouch for, it recomputes instead.
- The namespace (``kv_namespace``) is a digest of everything that decides the bytes of a block: the format
  version, the model (its name and its ``config.json``), the weights' quantization, the dtype, layer count,
  KV heads, head size, block size and tensor-parallel size. Engines that differ in any of them never share a
  key, so a mismatched engine never reads foreign blocks; ``kv_namespace_fields`` is the readable form an
  engine also stores beside its blocks (for ``redis-cli`` users).
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from array import array
from collections.abc import Sequence

FORMAT_VERSION = 1
MAGIC = b"RSKV"
_HEADER = struct.Struct("<4sHHHHI")  # magic, version, num_tokens, num_pieces, reserved, crc32 of the body

__all__ = ["CorruptBlock", "FORMAT_VERSION", "decode_block", "encode_block", "kv_namespace", "kv_namespace_fields"]


class CorruptBlock(ValueError):
    """A stored block that cannot be loaded: damaged, truncated, of another format or of other tokens."""


def encode_block(token_ids: Sequence[int], pieces: Sequence[bytes | memoryview]) -> bytes:
    """One stored value: header, piece lengths, tokens, pieces (see the module rules)."""
    parts = [struct.pack(f"<{len(pieces)}I", *(len(p) for p in pieces)), array("i", token_ids).tobytes(), *pieces]
    crc = 0
    for part in parts:  # the checksum part by part, and one copy of the whole: a block is up to a few MB
        crc = zlib.crc32(part, crc)
    return b"".join([_HEADER.pack(MAGIC, FORMAT_VERSION, len(token_ids), len(pieces), 0, crc), *parts])


def decode_block(value: bytes, token_ids: Sequence[int]) -> list[memoryview]:
    """The pieces of a stored block of ``token_ids``; ``CorruptBlock`` when it is not exactly that."""
    if len(value) < _HEADER.size:
        raise CorruptBlock(f"{len(value)} bytes is shorter than the header")
    magic, version, num_tokens, num_pieces, _, crc = _HEADER.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptBlock(f"format {magic!r} v{version}, expected {MAGIC!r} v{FORMAT_VERSION}")
    body = memoryview(value)[_HEADER.size:]
    if zlib.crc32(body) != crc:
        raise CorruptBlock("checksum mismatch")
    lengths_end = 4 * num_pieces
    tokens_end = lengths_end + 4 * num_tokens
    if len(body) < tokens_end:
        raise CorruptBlock("truncated before the tokens end")
    lengths = struct.unpack_from(f"<{num_pieces}I", body)
    if tokens_end + sum(lengths) != len(body):
        raise CorruptBlock(f"{len(body)} body bytes, the header describes {tokens_end + sum(lengths)}")
    stored_tokens = array("i")
    stored_tokens.frombytes(body[lengths_end:tokens_end])
    if list(stored_tokens) != list(token_ids):
        raise CorruptBlock("the block holds other tokens (a hash collision)")
    pieces, start = [], tokens_end
    for length in lengths:
        pieces.append(body[start:start + length])
        start += length
    return pieces


def kv_namespace_fields(model: str, model_config: bytes, quantization: str, dtype: str, num_layers: int,
                        num_kv_heads: int, head_size: int, block_size: int, tensor_parallel_size: int) -> dict:
    """What decides a block's bytes, as stored beside the blocks (``model_config``: the config.json bytes)."""
    return {"format": FORMAT_VERSION, "model": model, "config_sha256": hashlib.sha256(model_config).hexdigest()[:16],
            "quantization": quantization, "dtype": dtype, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
            "head_size": head_size, "block_size": block_size, "tensor_parallel_size": tensor_parallel_size}


def kv_namespace(fields: dict) -> str:
    """A short digest of ``kv_namespace_fields``: the namespace part of every key."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=6).hexdigest()
