"""Real hosts on one machine for tests: Linux network namespaces on a private switch.

Rules:
- `Network()` makes a switch namespace holding a bridge; `add_host(name)` makes a namespace for one host
  with a veth pair: ``eth0`` inside the host, addressed 198.18.0.N/24 (the benchmarking range, RFC 2544),
  its peer in the switch, on the bridge. Loopback is up everywhere. No host has a default route, and the
  namespaces have no link to the machine's own network: nothing can leave 198.18.0.0/24.
- Namespace names carry the test process's pid (``rs<pid>-<host>``), so parallel runs never collide.
  `close()` deletes every namespace the network made (that deletes their veth ends too) and is
  idempotent; use `network()`, which closes it even when the test (or the setup) fails.
- `unavailable()` says why namespaces cannot be made here (not root, no ``ip``, `ip netns add` refused), or
  None: tests skip with that reason.
- `Host.popen(argv)` runs a process inside the host (``ip netns exec``), in its own session, killed with
  the test process (PR_SET_PDEATHSIG). `Host.entered()` moves the calling thread into the host and back
  (setns): sockets made inside stay in the host, so a client made there must be used there.
- `cut(host)` makes the host's link silently drop every packet, both ways (nftables rules in the host:
  neither side sees a link go down, as with a partition further along the path); `restore(host)` lifts
  it. `link_down(host)` / `link_up(host)` take ``eth0`` down and up instead (the host sees no carrier).
- Link shaping: the kernels these tests run on may lack ``sch_netem`` (`tc qdisc ... netem` then fails);
  `DelayRelay` adds a fixed one-way delay to each direction of a TCP path in user space instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from redserve.redis_server import pdeathsig_preexec

SUBNET = "198.18.0"
_CLONE_NEWNET = 0x40000000
_CUT_TABLE = "redserve_cut"


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=10)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs these tests as root)"
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2 / nftables)"
    probe = f"rs{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return f"`ip netns add` failed here: {detail.decode(errors='replace').strip() or e}"
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    """One namespace on the switch; `address` is its eth0 address."""

    name: str
    namespace: str
    address: str
    switch_port: str

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """`argv` inside this host, in its own session, dying with the test process."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], start_new_session=True,
                                preexec_fn=pdeathsig_preexec(), **kwargs)

    def run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *argv], check=True, capture_output=True,
                              timeout=10)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body with the calling thread inside this host's network namespace."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, open(f"/var/run/netns/{self.namespace}") as target:
            if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace} failed")
            try:
                yield
            finally:
                if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to the test's namespace failed")


@dataclass
class Network:
    """A switch and the hosts on it; see the module rules."""

    prefix: str = field(default_factory=lambda: f"rs{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def start(self) -> Network:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add_host(self, name: str) -> Host:
        """A new host on the switch, addressed 198.18.0.<n>/24 in the order hosts are added (1, 2, ...)."""
        namespace = f"{self.prefix}-{name}"
        address = f"{SUBNET}.{len(self.hosts) + 1}"
        port = f"p{len(self.hosts) + 1}"
        self._add_namespace(namespace)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        host = self.hosts[name] = Host(name, namespace, address, port)
        return host

    def cut(self, host: Host) -> None:
        """Drop every packet into and out of `host`, silently (see the module rules)."""
        rules = (f"table inet {_CUT_TABLE} {{\n"
                 f"  chain in {{ type filter hook input priority -300; policy accept; iifname \"eth0\" drop; }}\n"
                 f"  chain out {{ type filter hook output priority -300; policy accept; oifname \"eth0\" drop; }}\n"
                 f"}}\n")
        subprocess.run(["ip", "netns", "exec", host.namespace, "nft", "-f", "-"], input=rules.encode(), check=True,
                       capture_output=True, timeout=10)

    def restore(self, host: Host) -> None:
        host.run("nft", "delete", "table", "inet", _CUT_TABLE)

    def link_down(self, host: Host) -> None:
        _ip("-n", host.namespace, "link", "set", "eth0", "down")

    def link_up(self, host: Host) -> None:
        _ip("-n", host.namespace, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Delete every namespace made (idempotent; errors are ignored so that all of them get a try)."""
        while self._namespaces:
            namespace = self._namespaces.pop()
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                _ip("netns", "del", namespace)
        self.hosts.clear()

    def _add_namespace(self, namespace: str) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _ip("netns", "del", namespace)  # a leftover of a killed run with the same pid
        _ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")


@contextlib.contextmanager
def network(*host_names: str) -> Iterator[Network]:
    """A started `Network` with `host_names` added in order; always closed, even if the body fails."""
    net = Network()
    try:
        net.start()
        for name in host_names:
            net.add_host(name)
        yield net
    finally:
        net.close()


class DelayRelay:
    """A TCP relay inside `host` on `listen` -> `target`, holding every chunk `delay` seconds each way.

    Rules: order is kept and chunks pipeline (a chunk waits `delay` after it was read, not after the one
    before it was written), so it models a link's latency, not a bandwidth limit. `close()` stops it.
    """

    def __init__(self, host: Host, listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
        self.host, self.listen, self.target, self.delay = host, listen, target, delay
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-relay", daemon=True)

    def start(self) -> DelayRelay:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay relay did not start")
        return self

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        with self.host.entered():
            asyncio.set_event_loop(self._loop)
            server = self._loop.run_until_complete(asyncio.start_server(self._serve, *self.listen))
            self._ready.set()
            try:
                self._loop.run_forever()
            finally:
                server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.target)
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunks: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await chunks.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                chunks.put_nowait((time.monotonic() + self.delay, data))
        finally:
            chunks.put_nowait(None)
            await sender
