"""msgpack wire format for messages between an engine and its TP workers; never pickle.

Supported values: dict, list, tuple, int, float, str, bytes, bytearray, None, bool and
``torch.Tensor`` (any dtype, any shape, strided layout). Rules:

- Tuples are packed as msgpack arrays and come back as lists.
- Dict keys may be any supported scalar (ints included), not only str.
- Tensors are detached, moved to CPU and made contiguous; their bytes travel raw, out of band:
  the msgpack body holds an ext record (type ``TENSOR_EXT``: dtype name, shape, offset, nbytes)
  and the bytes follow the body, each aligned to ``ALIGN`` bytes, so no tensor is copied into
  the msgpack buffer.
- Anything else (dataclasses, numpy arrays, sets) raises ``TypeError``: callers convert to dicts.

Message layout::

    u32 body_len | msgpack body | pad to ALIGN | tensor 0 bytes | pad | tensor 1 bytes | ...

``decode`` of a writable buffer (bytearray) returns tensors that share its memory; a read-only
buffer (bytes) is copied per tensor, so returned tensors are always writable.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

import msgpack

TENSOR_EXT = 1
ALIGN = 64
_BODY_LEN = struct.Struct("<I")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensor_view(t: Any) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor; the view keeps the tensor alive."""
    raw = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    raw._owner = t  # ctypes does not own the memory; pin the tensor for the view's lifetime
    return memoryview(raw).cast("B")


def encode_frames(obj: Any) -> list[bytes | memoryview]:
    """Encode ``obj`` as a list of byte buffers whose concatenation is the message.

    Lets a transport copy tensor bytes straight from the tensor into its own buffer
    (one copy instead of two). The buffers stay valid as long as the list is alive.
    """
    torch = sys.modules.get("torch")  # no tensor can exist unless torch is imported
    tensors: list[tuple[int, Any]] = []
    data_len = 0

    def default(value: Any) -> msgpack.ExtType:
        nonlocal data_len
        if torch is None or not isinstance(value, torch.Tensor):
            raise TypeError(
                f"cannot serialize {type(value).__qualname__}: only dict, list, tuple, scalars, "
                "str, bytes and torch.Tensor travel; convert dataclasses and other objects to dicts"
            )
        if value.layout != torch.strided:
            raise TypeError(f"cannot serialize a {value.layout} tensor; convert it to a dense tensor")
        t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
        offset = _align(data_len)
        data_len = offset + t.nbytes
        tensors.append((offset, t))
        meta = msgpack.packb([str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.nbytes])
        return msgpack.ExtType(TENSOR_EXT, meta)

    body = msgpack.packb(obj, default=default, use_bin_type=True)
    head = _BODY_LEN.pack(len(body)) + body
    frames: list[bytes | memoryview] = [head]
    pos = len(head)
    start = _align(pos)
    for offset, t in tensors:
        if t.nbytes == 0:
            continue
        if start + offset > pos:
            frames.append(bytes(start + offset - pos))
        frames.append(_tensor_view(t))
        pos = start + offset + t.nbytes
    return frames


def encode(obj: Any) -> bytes:
    """Encode ``obj`` into one bytes object (see the module docstring for what is supported)."""
    frames = encode_frames(obj)
    return frames[0] if len(frames) == 1 else b"".join(frames)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Decode a message made by ``encode``; tuples come back as lists."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    if len(view) < _BODY_LEN.size:
        raise ValueError(f"message too short to decode: {len(view)} bytes")
    (body_len,) = _BODY_LEN.unpack_from(view)
    body_end = _BODY_LEN.size + body_len
    if body_end > len(view):
        raise ValueError(f"truncated message: body needs {body_end} bytes, got {len(view)}")
    data_start = _align(body_end)

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != TENSOR_EXT:
            raise ValueError(f"unknown msgpack ext type {code}")
        return _decode_tensor(view, data_start, payload)

    return msgpack.unpackb(
        view[_BODY_LEN.size : body_end], ext_hook=ext_hook, raw=False, strict_map_key=False
    )


def _decode_tensor(view: memoryview, data_start: int, payload: bytes) -> Any:
    import torch

    dtype_name, shape, offset, nbytes = msgpack.unpackb(payload)
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype_name!r} in message")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    start = data_start + offset
    if start + nbytes > len(view):
        raise ValueError(f"truncated message: tensor bytes end at {start + nbytes}, got {len(view)}")
    if view.readonly:
        buf: Any = bytearray(view[start : start + nbytes])
        start = 0
    else:
        buf = view
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
    return flat.view(dtype).reshape(shape)
