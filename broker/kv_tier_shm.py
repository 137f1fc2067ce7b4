"""The KV tier's store in shared memory: the engines of one host share a pool of block files in tmpfs.

Rules:
- ``shm:///NAME?maxmemory=4gb`` names a pool, the directory ``/dev/shm/NAME`` (NAME ``redserve-kv`` when left
  out; the temp dir, with a warning, where /dev/shm is missing). Every engine of the host that opens the same URL
  shares it, and a restarted engine finds it as it was. ``maxmemory`` reads as Valkey's (``512mb``, ``4gb``,
  bytes; default ``1gb``) and is cut to 90% of the file system's size, with a warning, where it holds less;
  each writer keeps the pool to its own figure, so the engines sharing a pool should give the same one.
  A pool belongs to one user: directories 0700, files 0600; a pool directory owned by another user, or open to
  others, is refused (its blocks could be anyone's).
- One file per block, ``NAME/{namespace}/{hash as 16 hex digits}``, holding the value as it is (``meta.json``
  beside them: the namespace's fields). A value is written to a temp name (``.tmp.*``) and renamed into place,
  and a file in place is never written again: a reader sees a whole value or none, whatever becomes of the
  writer. A read is one open and read to the end; the reader then touches the file. The LRU clock is the mtime,
  set from ``time.time_ns`` (the file system's own stamps are a tick coarse, atime is off on relatime mounts);
  putting a block the pool holds only touches it.
- Size: ``NAME/.state`` holds two counters, bytes used (sizes rounded up to pages) and blocks evicted. A put adds
  its bytes under a ``flock`` of that file, held for one 16-byte read and write. The writer whose put leaves more
  than maxmemory used runs an eviction pass under ``NAME/.evict.lock``, taken without waiting (a pass running
  elsewhere will do): it lists every namespace of the pool, deletes the least recently touched blocks down to
  ``LOW_WATER`` of maxmemory and temp files older than ``STALE_TEMP_SECONDS``, and resets the used counter to
  what it found plus what was put meanwhile. Between passes the counter is approximate (a killed writer's lost
  update, two writers of one block); the pool may pass maxmemory by what is put during a pass.
- A process killed at any moment does no harm: ``flock`` locks die with it, its half-written value is a temp file
  nobody reads (swept by a later pass), and a block deleted while read stays whole for its reader.
- A pool removed while in use (``rm -r``: the way to empty it) is made again by the next put.
- Why files and not one shared arena with an index: the kernel allocates, publishes (rename) and cleans up
  (unlink, lock release) atomically, where an arena needs its own allocator, per-slot seqlocks and a recovery of
  its index after a SIGKILL. The cost, a few system calls per block, is small beside copying the value.
- Failures are ``OSError``s (the engine's tier counts them as misses); a bad URL is a ``ValueError`` at open.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import logging
import mmap
import os
import re
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

SHM_ROOT = Path("/dev/shm")
DEFAULT_NAME = "redserve-kv"
DEFAULT_MAXMEMORY = "1gb"
LOW_WATER = 0.9  # an eviction pass leaves the pool at this share of maxmemory
FS_SHARE = 0.9  # the most of the file system a pool may take
STALE_TEMP_SECONDS = 60.0
TEMP_PREFIX = ".tmp."
_COUNTERS = struct.Struct("<QQ")  # bytes used, blocks evicted
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_BLOCK_FILE = re.compile(r"[0-9a-f]{16}")
_UNITS = {"": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def parse_size(text: str) -> int:
    """Bytes of a Valkey-style size: ``1048576``, ``100k`` (1000s), ``512mb`` (MiB), ``4gb`` (GiB)."""
    match = re.fullmatch(r"(\d+)([kmg]b?)?", text.strip().lower())
    if match is None or int(match[1]) == 0:
        raise ValueError(f"maxmemory must be a positive size such as 512mb, 4gb or 1048576, got {text!r}")
    return int(match[1]) * _UNITS[match[2] or ""]


def parse_shm_url(url: str) -> tuple[Path, int]:
    """The pool directory and maxmemory (bytes, before any cut to the file system) of a ``shm://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "shm" or parts.netloc:
        raise ValueError(f"a shared-memory KV tier is shm:///NAME?maxmemory=SIZE (this host only), got {url!r}")
    name = parts.path.strip("/") or DEFAULT_NAME
    if not _NAME.fullmatch(name):
        raise ValueError(f"the pool name in {url!r} must be letters, digits, '.', '_' or '-' (not leading '.')")
    query = parse_qs(parts.query, keep_blank_values=True)
    if set(query) - {"maxmemory"}:
        raise ValueError(f"unsupported option(s) {', '.join(sorted(set(query) - {'maxmemory'}))} in {url!r}")
    return _root() / name, parse_size(query.get("maxmemory", [DEFAULT_MAXMEMORY])[-1])


def _root() -> Path:
    if SHM_ROOT.is_dir():
        return SHM_ROOT
    logger.warning("%s is missing: the shared-memory KV tier keeps its pool in %s instead (it is shared memory "
                   "only where that is a tmpfs)", SHM_ROOT, tempfile.gettempdir())
    return Path(tempfile.gettempdir())


def _private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a directory of this user closed to others (mode "
                              f"{stat.filemode(st.st_mode)}, uid {st.st_uid}): remove it or name another pool")


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _stamp(target: int | Path) -> None:
    now = time.time_ns()
    os.utime(target, ns=(now, now))


class ShmKVTierStore:
    """``broker.kv_tier_store.KVTierStore``'s interface over a pool of files in shared memory (module rules)."""

    def __init__(self, url: str, namespace: str):
        if not _NAME.fullmatch(namespace):
            raise ValueError(f"not a KV namespace: {namespace!r}")
        self.url, self.namespace = url, namespace
        self.pool, self.max_bytes = parse_shm_url(url)
        self.dir = self.pool / namespace
        self._fds: list[int] = []
        self._open()
        self._lock = threading.Lock()  # flock holds per open file: this store's threads take turns themselves
        self._evicting = threading.Lock()
        self._temp_prefix = f"{TEMP_PREFIX}{os.getpid()}.{os.urandom(4).hex()}."  # pids repeat across containers
        self._temp_count = itertools.count()
        self._fit_file_system()

    def _open(self) -> None:
        self.close()
        _private_dir(self.pool)
        _private_dir(self.dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fds = [os.open(self.pool / ".state", flags, 0o600), os.open(self.pool / ".evict.lock", flags, 0o600)]

    def _fit_file_system(self) -> None:
        fs = os.statvfs(self.pool)
        room = int(fs.f_blocks * fs.f_frsize * FS_SHARE)
        if self.max_bytes > room:
            logger.warning("KV tier pool %s: maxmemory %d MiB is more than its file system holds; keeping to %d MiB "
                           "(a container's /dev/shm grows with --shm-size)", self.pool, self.max_bytes >> 20,
                           room >> 20)
            self.max_bytes = room

    def key(self, block_hash: int) -> str:
        return str(self.dir / f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}")

    def describe(self, fields: dict) -> None:
        """Store the namespace's fields beside its blocks (``meta.json``)."""
        self._write(self.dir / "meta.json", json.dumps(fields, sort_keys=True).encode())

    def get_run(self, hashes: Sequence[int]) -> list[bytes]:
        """The stored blocks of ``hashes``, in order, up to the first one the pool does not hold."""
        found: list[bytes] = []
        for block_hash in hashes:
            try:
                with open(self.key(block_hash), "rb", buffering=0) as f:
                    found.append(f.readall())
                    _stamp(f.fileno())
            except FileNotFoundError:
                break
        return found

    def put(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Store blocks, ``(hash, value)`` each; evict when that leaves the pool over maxmemory."""
        added = 0
        for block_hash, value in items:
            path = Path(self.key(block_hash))
            try:
                _stamp(path)
                continue
            except FileNotFoundError:
                pass
            try:
                self._write(path, value)
            except FileNotFoundError:  # the pool was removed under us: make it again
                with self._lock:
                    self._open()
                self._write(path, value)
            added += _pages(len(value))
        if added and self._update(lambda used, evicted: (used + added, evicted))[0] > self.max_bytes:
            self.evict()

    def _write(self, path: Path, value: bytes) -> None:
        temp = path.with_name(f"{self._temp_prefix}{next(self._temp_count)}")
        fd = os.open(temp, _NEW_FILE, 0o600)
        try:
            try:
                view = memoryview(value)
                while view:
                    view = view[os.write(fd, view):]
                _stamp(fd)
            finally:
                os.close(fd)
            os.rename(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def memory(self) -> dict:
        """Bytes used (approximately, see the rules), maxmemory and blocks evicted since the pool was made."""
        used, evicted = self._counters()
        return {"used_bytes": used, "max_bytes": self.max_bytes, "evicted_keys": evicted}

    def evict(self) -> int:
        """Run an eviction pass unless one is running (module rules); the number of blocks deleted."""
        if not self._evicting.acquire(blocking=False):
            return 0
        try:
            fcntl.flock(self._fds[1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._evicting.release()
            return 0
        try:
            return self._evict_pass()
        finally:
            fcntl.flock(self._fds[1], fcntl.LOCK_UN)
            self._evicting.release()

    def _evict_pass(self) -> int:
        counted_before = self._counters()[0]
        blocks, total = self._scan()
        blocks.sort()
        target, deleted = int(self.max_bytes * LOW_WATER), 0
        for _, size, path in blocks:
            if total <= target:
                break
            try:
                os.unlink(path)
                deleted += 1
            except FileNotFoundError:
                pass
            total -= size
        self._update(lambda used, evicted: (total + max(used - counted_before, 0), evicted + deleted))
        return deleted

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """Every block of the pool as (mtime, bytes, path), and the bytes of blocks and live temp files."""
        blocks, total, stale = [], 0, time.time_ns() - int(STALE_TEMP_SECONDS * 1e9)
        with os.scandir(self.pool) as spaces:
            for space in [s for s in spaces if s.is_dir(follow_symlinks=False)]:
                with os.scandir(space.path) as entries:
                    for entry in entries:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if _BLOCK_FILE.fullmatch(entry.name):
                            blocks.append((st.st_mtime_ns, _pages(st.st_size), entry.path))
                        elif entry.name.startswith(TEMP_PREFIX) and st.st_mtime_ns < stale:
                            Path(entry.path).unlink(missing_ok=True)  # left by a killed writer
                            continue
                        total += _pages(st.st_size)
        return blocks, total

    def _counters(self) -> tuple[int, int]:
        raw = os.pread(self._fds[0], _COUNTERS.size, 0)
        return _COUNTERS.unpack(raw) if len(raw) == _COUNTERS.size else (0, 0)

    def _update(self, change: Callable[[int, int], tuple[int, int]]) -> tuple[int, int]:
        with self._lock:
            fcntl.flock(self._fds[0], fcntl.LOCK_EX)
            try:
                counters = change(*self._counters())
                os.pwrite(self._fds[0], _COUNTERS.pack(*counters), 0)
            finally:
                fcntl.flock(self._fds[0], fcntl.LOCK_UN)
        return counters

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
