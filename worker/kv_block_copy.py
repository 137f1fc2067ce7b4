"""Copies of whole KV-cache blocks between a rank's paged cache and host bytes (the KV tier's pieces).

Rules:
- A rank's cache is one tensor per layer, ``(2, num_blocks * block_size, kv_heads, head_size)`` (K then V).
  A block's piece is its slots of every layer, laid out ``(layer, K/V, slot, kv_head, dim)`` and contiguous:
  ``num_layers * 2 * block_size * kv_heads * head_size`` elements of the cache's dtype, as raw bytes.
- ``start_read`` gathers the blocks (on a CPU straight into the host tensor, block by block and layer by layer:
  one copy) on the device and starts their copy to the host without waiting for it
  (``worker.transfer.HostCopy``): under async scheduling the engine reads a step's blocks while the next step
  runs, and the read queues behind it on the same stream. ``ReadBlocks.pieces`` waits, then returns one
  memoryview per block over that host copy (no further copy).
- ``write`` scatters pieces into blocks, on the device's current stream, so a later step reads them in order:
  on a CPU block by block straight from the pieces' bytes (one copy), on a GPU as one upload and one
  ``index_copy_`` per layer. A piece of the wrong size raises ``ValueError`` and writes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from worker.transfer import HostCopy, to_device


def _slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    return to_device((ids[:, None] * block_size + torch.arange(block_size)).flatten(), None, device)


def piece_bytes(kv_caches: Sequence[torch.Tensor], block_size: int) -> int:
    _, _, heads, dim = kv_caches[0].shape
    return len(kv_caches) * 2 * block_size * heads * dim * kv_caches[0].element_size()


class ReadBlocks:
    """Blocks on their way to the host; ``pieces()`` waits for them."""

    def __init__(self, copy: HostCopy, num_blocks: int):
        self._copy = copy
        self._num_blocks = num_blocks

    def pieces(self) -> list[memoryview]:
        (host,) = self._copy.wait()
        flat = host.view(torch.uint8).reshape(self._num_blocks, -1).numpy()
        return [memoryview(row) for row in flat]


def start_read(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], block_size: int) -> ReadBlocks:
    """Gather ``block_ids`` of every layer into one tensor and start its copy to the host."""
    num_blocks = len(block_ids)
    _, _, heads, dim = kv_caches[0].shape
    if kv_caches[0].device.type == "cpu":  # one copy: each block's slice of each layer into its place
        out = torch.empty((num_blocks, len(kv_caches), 2, block_size, heads, dim), dtype=kv_caches[0].dtype)
        for i, block_id in enumerate(block_ids):
            start = block_id * block_size
            for layer, kv in enumerate(kv_caches):
                out[i, layer].copy_(kv[:, start:start + block_size])
        return ReadBlocks(HostCopy([out]), num_blocks)
    slots = _slots(block_ids, block_size, kv_caches[0].device)
    stacked = torch.stack([kv.index_select(1, slots) for kv in kv_caches])  # (L, 2, blocks * bs, H, D)
    blocks = stacked.view(len(kv_caches), 2, num_blocks, block_size, heads, dim).permute(2, 0, 1, 3, 4, 5)
    return ReadBlocks(HostCopy([blocks.contiguous()]), num_blocks)


def write(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], block_size: int,
          pieces: Sequence[bytes | memoryview]) -> None:
    """Put one piece per block into ``block_ids`` of every layer."""
    size = piece_bytes(kv_caches, block_size)
    if len(pieces) != len(block_ids) or any(len(p) != size for p in pieces):
        raise ValueError(f"expected {len(block_ids)} pieces of {size} bytes, got sizes {[len(p) for p in pieces]}")
    if not block_ids:
        return
    num_layers, (_, _, heads, dim) = len(kv_caches), kv_caches[0].shape
    shape = (num_layers, 2, block_size, heads, dim)
    if kv_caches[0].device.type == "cpu":  # one copy: each block's slice of each layer straight from its bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: only ever read from here
            for block_id, piece in zip(block_ids, pieces, strict=True):
                data = torch.frombuffer(piece, dtype=torch.uint8).view(kv_caches[0].dtype).view(shape)
                start = block_id * block_size
                for layer, kv in enumerate(kv_caches):
                    kv[:, start:start + block_size].copy_(data[layer])
        return
    host = np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in pieces])  # one writable copy, sent up at once
    data = torch.from_numpy(host).view(kv_caches[0].dtype).view(len(block_ids), *shape)
    data = to_device(data, None, kv_caches[0].device)
    slots = _slots(block_ids, block_size, kv_caches[0].device)
    for layer, kv in enumerate(kv_caches):
        kv.index_copy_(1, slots, data[:, layer].transpose(0, 1).reshape(2, len(block_ids) * block_size, heads, dim))
