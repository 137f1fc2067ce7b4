"""Shared-memory message queue: an engine broadcasts to its TP workers; a worker replies.

One writer, ``n_readers`` readers; every reader receives every message, in order. Messages are
msgpack (``worker.serialization``; tensors travel as raw bytes) written into a ring of
``max_chunks`` slots of ``max_chunk_bytes`` each (``worker.shm_ring``). Rules:

- The hot path takes no locks and makes no system calls: a message is copied into free slots
  and published by flag stores; readers poll the flags (spin ~100 us yielding the CPU, then
  doubling naps up to 1 ms, so an idle reader costs a few % of a core: 2-7.5% on a 2-core VM).
- Defaults: 16 slots x 1 MiB. Only touched pages of /dev/shm are allocated, so small messages
  cost a page per slot; a ~1 MB message still fits in one slot, and 16 slots let a burst of small
  messages run ahead of the readers (8 x 4 MiB and 32 x 256 KiB measured no better).
- A message larger than a slot is split into chunks over consecutive slots (chunk_index 0, 1,
  ...). Readers consume chunks while the writer produces them, so a message may be larger than
  the whole ring; order is kept because chunks are just the next sequence numbers. No extra
  segment is created, so the overflow path has no system calls and nothing extra to clean up.
- Back-pressure: the writer waits while the next slot still has unread chunks, napping at most
  100 us since readers are expected to be making progress (measured +30% small-message rate).
- ``enqueue`` and ``dequeue`` take ``timeout`` (seconds, None = forever) and raise
  ``TimeoutError``. A writer timing out halfway through a multi-chunk message closes the queue
  (a half-written message cannot be withdrawn). A reader timing out halfway keeps its progress
  and resumes on its next call.
- Every reader must keep reading: the writer cannot reuse a slot until all readers read it.
- ``close()`` by the writer or the owner marks the queue closed: readers first drain what was
  already published, then raise ``QueueClosed``; a writer blocked on back-pressure raises it too.
- The creator owns the segment and unlinks it (see ``worker.shm_ring``). By default the creator
  is the writer; ``create(..., reader_rank=r)`` makes the creator reader r instead, so one
  process (the engine) can own every segment and a killed worker leaves nothing behind.
- Send a peer ``queue.handle()`` (a small dataclass; pickle it or send ``to_dict()``), never
  the queue object itself.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from worker.serialization import decode, encode_frames
from worker.shm_ring import (
    WRITER_MAX_SLEEP_SECONDS,
    QueueClosed,
    ShmRing,
    wait_until,
)

__all__ = [
    "DEFAULT_MAX_CHUNKS",
    "DEFAULT_MAX_CHUNK_BYTES",
    "MessageQueue",
    "QueueClosed",
    "QueueCorrupted",
    "QueueHandle",
]

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 16


class QueueCorrupted(RuntimeError):
    """A reader found a chunk other than the one it expected (second writer, reused segment)."""


@dataclass(frozen=True)
class QueueHandle:
    """Everything a peer needs to attach to a queue; picklable, and msgpack-able via to_dict()."""

    name: str
    n_readers: int
    max_chunks: int
    max_chunk_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QueueHandle:
        return cls(
            name=str(data["name"]),
            n_readers=int(data["n_readers"]),
            max_chunks=int(data["max_chunks"]),
            max_chunk_bytes=int(data["max_chunk_bytes"]),
        )


def _split(frames: Sequence[bytes | memoryview], size: int) -> Iterator[list[memoryview]]:
    """Yield the concatenation of ``frames`` as lists of views of at most ``size`` bytes."""
    parts: list[memoryview] = []
    room = size
    yielded = False
    for frame in frames:
        view = memoryview(frame).cast("B")
        while len(view):
            parts.append(view[:room])
            room -= len(parts[-1])
            view = view[len(parts[-1]) :]
            if room == 0:
                yield parts
                yielded = True
                parts, room = [], size
    if parts or not yielded:
        yield parts


class MessageQueue:
    """One end of a shared-memory queue; build it with ``create``, ``attach`` or ``attach_writer``."""

    def __init__(self, ring: ShmRing, reader_rank: int | None):
        self._ring = ring
        self.reader_rank = reader_rank
        self._seq = 0
        self._partial: bytearray | None = None
        self._partial_pos = 0
        self._partial_index = 0

    @classmethod
    def create(
        cls,
        n_readers: int = 1,
        *,
        tag: str,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        reader_rank: int | None = None,
    ) -> MessageQueue:
        """Create and own a queue named ``rs_mq_<tag>_<pid>_<random>``.

        The creator is the writer unless ``reader_rank`` is given, in which case it is that reader.
        """
        ring = ShmRing.create(tag, n_readers, max_chunks, max_chunk_bytes)
        if reader_rank is not None and not 0 <= reader_rank < n_readers:
            ring.close()
            raise ValueError(f"reader_rank must be in 0..{n_readers - 1}, got {reader_rank}")
        return cls(ring, reader_rank)

    @classmethod
    def attach(cls, handle: QueueHandle, reader_rank: int) -> MessageQueue:
        """Attach as reader ``reader_rank`` (0 <= rank < handle.n_readers); one process per rank."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank must be in 0..{handle.n_readers - 1}, got {reader_rank}")
        return cls(cls._attach_ring(handle), reader_rank)

    @classmethod
    def attach_writer(cls, handle: QueueHandle) -> MessageQueue:
        """Attach as the writer of a queue whose creator is a reader; only one writer, ever."""
        return cls(cls._attach_ring(handle), None)

    @staticmethod
    def _attach_ring(handle: QueueHandle) -> ShmRing:
        return ShmRing.attach(handle.name, handle.n_readers, handle.max_chunks, handle.max_chunk_bytes)

    def handle(self) -> QueueHandle:
        ring = self._ring
        return QueueHandle(ring.name, ring.n_readers, ring.n_slots, ring.slot_bytes)

    @property
    def name(self) -> str:
        return self._ring.name

    @property
    def is_writer(self) -> bool:
        return self.reader_rank is None

    @property
    def is_owner(self) -> bool:
        return self._ring.owner

    def __getstate__(self) -> None:
        raise TypeError("a MessageQueue cannot be pickled: send queue.handle() and attach to it")

    def __repr__(self) -> str:
        role = "writer" if self.is_writer else f"reader {self.reader_rank}"
        return f"MessageQueue({self.name!r}, {role}, owner={self.is_owner})"

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Serialize ``obj`` and publish it to every reader (see the module rules)."""
        self._write(encode_frames(obj), timeout)

    def enqueue_bytes(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish raw bytes; the readers must use ``dequeue_bytes``."""
        self._write([data], timeout)

    def dequeue(self, timeout: float | None = None) -> Any:
        """Return the next message, decoded; its tensors share one fresh buffer."""
        return decode(self.dequeue_bytes(timeout))

    def _write(self, frames: Sequence[bytes | memoryview], timeout: float | None) -> None:
        if not self.is_writer:
            raise RuntimeError(f"{self!r} is a reader; only the writer may enqueue")
        ring = self._ring
        total = sum(memoryview(f).nbytes for f in frames)
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, parts in enumerate(_split(frames, ring.slot_bytes)):
            slot = self._seq % ring.n_slots
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                wait_until(
                    partial(ring.writable, slot),
                    ring,
                    left,
                    partial(self._lag_message, slot, timeout),
                    WRITER_MAX_SLEEP_SECONDS,
                )
            except TimeoutError as exc:
                if index == 0:
                    raise
                ring.mark_closed()
                raise TimeoutError(f"{exc}; queue closed: a message was left half written") from None
            ring.write(slot, self._seq, total, index, parts)
            self._seq += 1

    def _lag_message(self, slot: int, timeout: float | None) -> str:
        lagging = self._ring.lagging_readers(slot)
        return (
            f"enqueue on queue {self.name} timed out after {timeout}s: reader(s) {lagging} have not "
            f"read slot {slot} (back-pressure: a reader is slow, stuck or dead)"
        )

    def dequeue_bytes(self, timeout: float | None = None) -> bytearray:
        """Return the next message's bytes (a fresh bytearray the caller owns)."""
        rank = self.reader_rank
        if rank is None:
            raise RuntimeError(f"{self!r} is the writer; only readers may dequeue")
        ring = self._ring
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            slot = self._seq % ring.n_slots
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            wait_until(
                partial(ring.readable, slot, rank),
                ring,
                left,
                lambda: f"no message on queue {self.name} within {timeout}s (reader {rank})",
            )
            seq, msg_len, chunk_len, index = ring.chunk_header(slot)
            self._check_chunk(seq, msg_len, chunk_len, index)
            if index == 0 and chunk_len == msg_len:
                data = ring.chunk_bytes(slot, chunk_len)
                ring.release(slot, rank)
                self._seq += 1
                return data
            buffer = bytearray(msg_len) if index == 0 else self._partial
            if index == 0:
                self._partial, self._partial_pos, self._partial_index = buffer, 0, 0
            ring.copy_out(slot, memoryview(buffer)[self._partial_pos :], chunk_len)
            ring.release(slot, rank)
            self._seq += 1
            self._partial_pos += chunk_len
            self._partial_index += 1
            if self._partial_pos == msg_len:
                self._partial = None
                return buffer

    def _check_chunk(self, seq: int, msg_len: int, chunk_len: int, index: int) -> None:
        pending = self._partial
        want_index = 0 if pending is None else self._partial_index
        pos = 0 if pending is None else self._partial_pos
        ok = (
            seq == self._seq
            and index == want_index
            and chunk_len <= self._ring.slot_bytes
            and (pending is None or msg_len == len(pending))
            and pos + chunk_len <= msg_len
        )
        if not ok:
            raise QueueCorrupted(
                f"queue {self.name} reader {self.reader_rank} expected chunk seq {self._seq} "
                f"(index {want_index}) but found seq {seq} (index {index}, {chunk_len}/{msg_len} bytes): "
                "a second writer, a reused segment, or memory corruption"
            )

    def close(self) -> None:
        """Detach. The writer and the owner also mark the queue closed; the owner unlinks it."""
        ring = self._ring
        if ring.is_open and (self.is_writer or ring.owner):
            ring.mark_closed()
        ring.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
