"""The network link between an engine and a worker host (``redserve worker``): one TCP connection per host.

The engine's step broadcast reaches its local workers over the shared-memory queue and every remote host over
this link; the remote host's ``worker.worker_host`` relays each message, byte for byte, into its own shm queue,
and relays its workers' replies back. Hidden states between pipeline stages do not travel here (gloo / NCCL).

Rules:
- Frames: ``u32 length | kind (1 byte) | payload``. Kinds: ``STEP`` (engine -> host: one message of the
  broadcast, as ``worker.serialization`` encodes it), ``REPLY`` (host -> engine: ``u16 rank`` + one reply),
  ``CONTROL`` (msgpack map: hello, setup, ready, failed), ``HEARTBEAT`` (empty), ``AUTH`` (handshake).
- Both ends prove they hold the engine's link key before anything else is read: the engine sends a nonce,
  the host answers HMAC-SHA256(key, "worker" + nonce) and a nonce of its own, the engine answers
  HMAC-SHA256(key, "engine" + that nonce). A wrong answer closes the connection. The key is drawn per
  engine start and published in Redis with the address (``rs:engine:{id}:workers``): reading Redis is what
  lets a host join. The link is authenticated, not encrypted: run it on a private network (README).
- Liveness: each end sends a heartbeat every ``timeout / 4`` s and takes the other for gone when nothing
  arrived for ``timeout`` s (a cut link shows no EOF), or on EOF. A send that blocks for ``timeout`` s
  fails the same way.
- Nothing received is unpickled: payloads are msgpack or raw bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
from collections.abc import Callable

import msgpack

STEP, REPLY, CONTROL, HEARTBEAT, AUTH = b"S", b"R", b"C", b"H", b"A"
_HEADER = struct.Struct(">I")
_RANK = struct.Struct(">H")
MAX_FRAME = 1 << 30
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT = 10.0


class LinkClosed(ConnectionError):
    """The other end is gone: EOF, a reset, silence past the timeout, or a failed handshake."""


def new_key() -> str:
    """A fresh link key (hex), drawn per engine start."""
    return os.urandom(32).hex()


def _mac(key: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(bytes.fromhex(key), role + nonce, hashlib.sha256).digest()


class Link:
    """One authenticated connection; any thread may send, one thread receives."""

    def __init__(self, sock: socket.socket, timeout: float):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self.sock = sock
        self.timeout = timeout
        host, port = sock.getpeername()[:2]
        self.peer = f"{host}:{port}"
        self._send_lock = threading.Lock()
        self.closed = False

    # --- handshake -------------------------------------------------------------------------------------------

    @classmethod
    def accept(cls, sock: socket.socket, key: str, timeout: float) -> Link:
        """The engine's side of the handshake on an accepted socket; raises LinkClosed if the peer fails it."""
        link = cls(sock, HANDSHAKE_TIMEOUT)
        try:
            nonce = os.urandom(NONCE_BYTES)
            link.send(AUTH, nonce)
            answer = link._expect(AUTH)
            if len(answer) != 32 + NONCE_BYTES or not hmac.compare_digest(answer[:32], _mac(key, b"worker", nonce)):
                raise LinkClosed(f"{link.peer} failed the link handshake (wrong key)")
            link.send(AUTH, _mac(key, b"engine", answer[32:]))
        except BaseException:
            link.close()
            raise
        link.set_timeout(timeout)
        return link

    @classmethod
    def connect(cls, address: tuple[str, int], key: str, timeout: float) -> Link:
        """The worker host's side: connect and prove the key both ways; raises LinkClosed / OSError."""
        sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
        link = cls(sock, HANDSHAKE_TIMEOUT)
        try:
            nonce = link._expect(AUTH)
            mine = os.urandom(NONCE_BYTES)
            link.send(AUTH, _mac(key, b"worker", nonce) + mine)
            if not hmac.compare_digest(link._expect(AUTH), _mac(key, b"engine", mine)):
                raise LinkClosed(f"{link.peer} is not the engine that published this key")
        except BaseException:
            link.close()
            raise
        link.set_timeout(timeout)
        return link

    def _expect(self, kind: bytes) -> bytes:
        got, payload = self.recv()
        if got != kind:
            raise LinkClosed(f"expected a {kind!r} frame from {self.peer}, got {got!r}")
        return payload

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        self.sock.settimeout(timeout)

    # --- frames ----------------------------------------------------------------------------------------------

    def send(self, kind: bytes, payload: bytes | bytearray | memoryview = b"", prefix: bytes = b"") -> None:
        """One frame: ``kind``, then ``prefix`` and ``payload`` as its body (the payload is not copied)."""
        data = memoryview(payload)
        with self._send_lock:
            try:
                self.sock.sendall(_HEADER.pack(len(prefix) + data.nbytes + 1) + kind + prefix)
                if data.nbytes:
                    self.sock.sendall(data)
            except OSError as exc:  # socket.timeout included: the peer stopped reading
                self.close()
                raise LinkClosed(f"sending to {self.peer} failed: {exc}") from None

    def send_control(self, message: dict) -> None:
        self.send(CONTROL, msgpack.packb(message))

    def send_reply(self, rank: int, payload: bytes | bytearray | memoryview) -> None:
        self.send(REPLY, payload, prefix=_RANK.pack(rank))

    def recv(self) -> tuple[bytes, bytearray]:
        """The next frame (kind, payload); raises LinkClosed on EOF, error or ``timeout`` s of silence."""
        (length,) = _HEADER.unpack(self._read(_HEADER.size))
        if not 1 <= length <= MAX_FRAME:
            self.close()
            raise LinkClosed(f"bad frame length {length} from {self.peer}")
        frame = self._read(length)
        return bytes(frame[:1]), frame[1:]

    def _read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                self.close()
                raise LinkClosed(f"nothing from {self.peer} for {self.timeout:g}s") from None
            except OSError as exc:
                self.close()
                raise LinkClosed(f"link to {self.peer} failed: {exc}") from None
            if k == 0:
                self.close()
                raise LinkClosed(f"{self.peer} closed the link")
            got += k
        return buf

    def start_heartbeat(self, stopped: Callable[[], bool]) -> threading.Thread:
        """Send a heartbeat every timeout / 4 s until `stopped()` or the link closes."""
        def beat() -> None:
            event = threading.Event()
            while not self.closed and not stopped():
                try:
                    self.send(HEARTBEAT)
                except LinkClosed:
                    return
                event.wait(self.timeout / 4)
        thread = threading.Thread(target=beat, name=f"link-heartbeat-{self.peer}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def split_reply(payload: bytearray) -> tuple[int, bytearray]:
    """A REPLY frame's (rank, reply bytes)."""
    (rank,) = _RANK.unpack_from(payload)
    return rank, payload[_RANK.size:]


def decode_control(payload: bytes | bytearray) -> dict:
    message = msgpack.unpackb(payload, raw=False)
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise LinkClosed("malformed control frame")
    return message


def local_address_towards(host: str, port: int) -> str:
    """The address of this host's interface that routes to ``host`` (nothing is sent: a UDP connect only
    picks the route). Used as the address a worker host advertises when none is given."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port or 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the local interface holding IPv4 ``address`` (gloo / NCCL bind their sockets to it)."""
    import fcntl
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None
