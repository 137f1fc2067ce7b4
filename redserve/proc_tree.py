"""Processes on this machine, read from /proc (Linux): a process tree, liveness, titles, socket owners.

Used by the fault-matrix benchmark and the supervision tests to find and break the parts of a running
``redserve serve``. Every function answers for the moment it reads /proc and never raises for a process
that vanished meanwhile (it is simply not listed, or not alive).
"""

from __future__ import annotations

import contextlib
import os


def children(pid: int) -> list[int]:
    """The direct children of `pid` (of all its threads)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...)."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def title(pid: int) -> str:
    """The command line as `ps` shows it (a process title set with setproctitle included); "" if gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def socket_owner(pids: list[int], server_port: int, client_port: int) -> int | None:
    """Which of `pids` holds the server end of the loopback TCP connection from `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                ports = (int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16))
                if ports == (server_port, client_port):
                    inodes.add(f"socket:[{cols[9]}]")
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return pid
    return None
