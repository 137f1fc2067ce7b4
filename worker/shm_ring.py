"""A ring of fixed-size slots in one shared-memory segment: one writer, N readers, no locks.

Segment layout (integers little-endian, every block starts on a 64-byte boundary)::

    header      magic "RSMQ" | u16 version | u16 n_readers | u32 n_slots | u64 slot_bytes
                u8 closed (offset 32)
    control[i]  u64 seq | u64 msg_len | u32 chunk_len | u32 chunk_index | u8 written | u8 read[n_readers]
    data[i]     slot_bytes of payload

Slot protocol (slots are used in order, slot = seq % n_slots):

- The writer may fill slot i when it was never written (written == 0) or every reader has read
  it (all read flags == 1). It stores the payload and the control fields, then clears the read
  flags and sets written = 1: those flag stores publish the slot.
- Reader r may read slot i when written == 1 and read[r] == 0. It copies the payload out, then
  sets read[r] = 1, which hands the slot back to the writer once every reader has done so.
- Each slot carries the global sequence number of the chunk in it; readers check it.
- ``closed`` is set once by the writer or the owner; waiting peers then raise ``QueueClosed``.

Memory ordering: both directions are the message-passing pattern. The writer orders payload
stores before flag stores; a reader orders its flag loads before payload loads, and its payload
loads before its read-flag store; the writer orders its read-flag loads before overwriting the
payload. On x86-64 (TSO) the hardware keeps store->store, load->load and load->store order, and
CPython cannot reorder them because each memoryview access is a separate opaque C call. On
weakly ordered CPUs ``memory_fence()`` (an uncontended lock acquire + release, which executes
barrier instructions) sits between the two halves of each pair.

Ownership: the creator owns the segment and unlinks it on ``close()``, on garbage collection and
at interpreter exit (a forked child inheriting the object never unlinks). SIGTERM skips atexit
unless the process turns it into SystemExit. Non-owners only unmap it and never register it with
multiprocessing's resource tracker (which would otherwise unlink it, or warn, when they exit).
A SIGKILLed owner cannot clean up: the resource tracker it registered with unlinks the segment
once every process sharing that tracker has exited.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

NAME_PREFIX = "rs_mq"
SPIN_SECONDS = 100e-6
FIRST_SLEEP_SECONDS = 20e-6
MAX_SLEEP_SECONDS = 1e-3
WRITER_MAX_SLEEP_SECONDS = 100e-6

_MAGIC = b"RSMQ"
_VERSION = 1
_HEADER = struct.Struct("<4sHHIQ")
_CLOSED_AT = 32
_HEADER_BYTES = 64
_CHUNK = struct.Struct("<QQII")
_WRITTEN_AT = _CHUNK.size
_READ_AT = _WRITTEN_AT + 1
_TAG_RE = re.compile(r"[A-Za-z0-9.-]{1,64}")
_fence_lock = threading.Lock()
_tracker_lock = threading.Lock()


class QueueClosed(Exception):
    """The queue was closed by its writer or owner; no more messages will arrive."""


def memory_fence() -> None:
    """Full memory barrier, as far as CPython lets us get one (see the module docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def segment_name(tag: str) -> str:
    """A fresh segment name ``rs_mq_<tag>_<pid>_<random>``; the tag is [A-Za-z0-9.-]{1,64}."""
    if not _TAG_RE.fullmatch(tag):
        raise ValueError(f"queue tag {tag!r} must match [A-Za-z0-9.-]{{1,64}} (e.g. an engine id)")
    return f"{NAME_PREFIX}_{tag}_{os.getpid()}_{secrets.token_hex(4)}"


def attach_untracked(name: str) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    # Before 3.13 every SharedMemory registers with the resource tracker, which then unlinks the
    # segment (or warns) when this non-owner exits; skip that registration for this one call.
    with _tracker_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _release_segment(shm: SharedMemory, owner_pid: int | None) -> None:
    with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
        shm.close()
    if owner_pid == os.getpid():
        try:
            shm.unlink()
        except FileNotFoundError:
            # Someone else unlinked it; still drop our tracker registration, or the tracker
            # warns about a leak and retries the unlink when it exits.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


class ShmRing:
    """The slot ring over one segment; ``MessageQueue`` drives it. Not thread-safe per side."""

    def __init__(self, shm: SharedMemory, n_readers: int, n_slots: int, slot_bytes: int, owner: bool):
        self.name = shm.name.lstrip("/")
        self.n_readers = n_readers
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        self._shm = shm
        self._buf: memoryview | None = shm.buf
        self._ctrl_stride = _align(_READ_AT + n_readers)
        self._data_start = _HEADER_BYTES + n_slots * self._ctrl_stride
        self._data_stride = _align(slot_bytes)
        self._all_read = b"\x01" * n_readers
        self._none_read = bytes(n_readers)
        self._finalizer = weakref.finalize(self, _release_segment, shm, os.getpid() if owner else None)

    @staticmethod
    def segment_bytes(n_readers: int, n_slots: int, slot_bytes: int) -> int:
        return _HEADER_BYTES + n_slots * (_align(_READ_AT + n_readers) + _align(slot_bytes))

    @classmethod
    def create(cls, tag: str, n_readers: int, n_slots: int, slot_bytes: int) -> ShmRing:
        if not 1 <= n_readers <= 1024:
            raise ValueError(f"n_readers must be in 1..1024, got {n_readers}")
        if n_slots < 1 or slot_bytes < 64:
            raise ValueError(f"need at least 1 slot of at least 64 bytes, got {n_slots} x {slot_bytes}")
        size = cls.segment_bytes(n_readers, n_slots, slot_bytes)
        shm = SharedMemory(name=segment_name(tag), create=True, size=size)
        _HEADER.pack_into(shm.buf, 0, _MAGIC, _VERSION, n_readers, n_slots, slot_bytes)
        return cls(shm, n_readers, n_slots, slot_bytes, owner=True)

    @classmethod
    def attach(cls, name: str, n_readers: int, n_slots: int, slot_bytes: int) -> ShmRing:
        try:
            shm = attach_untracked(name)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory queue {name!r} does not exist: its owner closed it or died"
            ) from None
        found = _HEADER.unpack_from(shm.buf, 0)
        if found != (_MAGIC, _VERSION, n_readers, n_slots, slot_bytes):
            shm.close()
            raise ValueError(f"segment {name!r} holds {found}, not the queue its handle describes")
        return cls(shm, n_readers, n_slots, slot_bytes, owner=False)

    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            raise QueueClosed(f"queue {self.name} was closed by this process")
        return self._buf

    @property
    def is_open(self) -> bool:
        """False once this process called ``close()`` (not the shared closed flag)."""
        return self._buf is not None

    @property
    def closed(self) -> bool:
        return self.buf[_CLOSED_AT] == 1

    def mark_closed(self) -> None:
        memory_fence()  # everything published so far must be visible before the close
        self.buf[_CLOSED_AT] = 1

    def _ctrl(self, slot: int) -> int:
        return _HEADER_BYTES + slot * self._ctrl_stride

    def writable(self, slot: int) -> bool:
        ctrl = self._ctrl(slot) + _WRITTEN_AT
        buf = self.buf
        return buf[ctrl] == 0 or buf[ctrl + 1 : ctrl + 1 + self.n_readers] == self._all_read

    def lagging_readers(self, slot: int) -> list[int]:
        flags = self.buf[self._ctrl(slot) + _READ_AT :][: self.n_readers]
        return [rank for rank, flag in enumerate(flags) if flag == 0]

    def write(self, slot: int, seq: int, msg_len: int, chunk_index: int, parts: Sequence[memoryview]) -> None:
        """Fill a writable slot with ``parts`` (at most slot_bytes in total) and publish it."""
        buf = self.buf
        memory_fence()  # the read-flag loads in ``writable`` come before we overwrite the payload
        pos = self._data_start + slot * self._data_stride
        for part in parts:
            buf[pos : pos + len(part)] = part
            pos += len(part)
        chunk_len = pos - (self._data_start + slot * self._data_stride)
        ctrl = self._ctrl(slot)
        _CHUNK.pack_into(buf, ctrl, seq, msg_len, chunk_len, chunk_index)
        memory_fence()
        buf[ctrl + _READ_AT : ctrl + _READ_AT + self.n_readers] = self._none_read
        buf[ctrl + _WRITTEN_AT] = 1

    def readable(self, slot: int, rank: int) -> bool:
        ctrl = self._ctrl(slot) + _WRITTEN_AT
        buf = self.buf
        return buf[ctrl] == 1 and buf[ctrl + 1 + rank] == 0

    def chunk_header(self, slot: int) -> tuple[int, int, int, int]:
        """(seq, msg_len, chunk_len, chunk_index) of a readable slot; call after ``readable``."""
        memory_fence()
        return _CHUNK.unpack_from(self.buf, self._ctrl(slot))

    def copy_out(self, slot: int, dst: memoryview, chunk_len: int) -> None:
        start = self._data_start + slot * self._data_stride
        dst[:chunk_len] = self.buf[start : start + chunk_len]

    def chunk_bytes(self, slot: int, chunk_len: int) -> bytearray:
        start = self._data_start + slot * self._data_stride
        return bytearray(self.buf[start : start + chunk_len])

    def release(self, slot: int, rank: int) -> None:
        """Reader ``rank`` is done with ``slot``: hand it back to the writer."""
        memory_fence()
        self.buf[self._ctrl(slot) + _READ_AT + rank] = 1

    def close(self) -> None:
        """Unmap the segment; the owner also unlinks it. Idempotent."""
        self._buf = None
        self._finalizer()


def wait_until(
    ready: Callable[[], bool],
    ring: ShmRing,
    timeout: float | None,
    describe: Callable[[], str],
    max_sleep: float = MAX_SLEEP_SECONDS,
) -> None:
    """Return once ``ready()``; raise ``QueueClosed`` once the ring is closed and still not ready,
    and ``TimeoutError(describe())`` after ``timeout`` seconds (None waits forever).

    Already ready: one flag check, no system call. Otherwise spin for SPIN_SECONDS, yielding the
    CPU between checks, then sleep with naps doubling from FIRST_SLEEP_SECONDS to
    ``max_sleep`` (MAX_SLEEP_SECONDS), so an idle waiter wakes about 1000 times a second (~2% of
    a core measured).
    """
    if ready():
        return
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    spin_until = now + SPIN_SECONDS
    nap = FIRST_SLEEP_SECONDS
    while True:
        if ready():
            return
        if ring.closed:
            if ready():  # published just before the close
                return
            raise QueueClosed(f"queue {ring.name} was closed")
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError(describe())
        if now < spin_until:
            os.sched_yield()  # lets a peer sharing this core run; measured 2-4x throughput on 2 CPUs
        else:
            time.sleep(nap if deadline is None else min(nap, max(deadline - now, 0.0)))
            nap = min(nap * 2, max_sleep)
