"""TP setup is not reachable from the network and unpickles nothing a peer sends.

TP=2 on CPU (gloo + the shared-memory collectives), as in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from stack_procs import wait_for

from engine import LLM
from worker.parallel_state import destroy_tensor_parallel, init_tensor_parallel, tp_all_reduce

_LISTENER = re.compile(r"^LISTEN\s+\d+\s+\d+\s+(?P<local>\S+):(?P<port>\d+)\s+\S+\s+users:\((?P<users>.*)\)$")
_LOOPBACK = ("127.", "[::1]", "[::ffff:127.")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


def tcp_listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every listening TCP socket (v4 and v6) that one of `pids` holds."""
    out = subprocess.run(["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        m = _LISTENER.match(line.strip())
        if m is None:
            continue
        for pid in map(int, re.findall(r"pid=(\d+)", m["users"])):
            if pid in pids:
                found.append((m["local"], int(m["port"]), pid))
    return found


def test_tp_setup_listens_on_loopback_only_and_keeps_its_rendezvous_private(tiny_llama_dir) -> None:
    llm = LLM(tiny_llama_dir, dtype="float32", tensor_parallel_size=2)
    executor = llm.engine.executor
    try:
        pids = {os.getpid(), *(p.pid for p in executor.procs)}
        listeners = tcp_listeners(pids)
        assert any(pid != os.getpid() for _, _, pid in listeners), f"no listener of the workers seen: {listeners}"
        exposed = [entry for entry in listeners if not entry[0].startswith(_LOOPBACK)]
        assert exposed == [], f"TP setup listens beyond loopback: {exposed}"

        rendezvous = executor.rendezvous_dir
        info = os.stat(rendezvous)
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
        assert os.path.dirname(rendezvous) == tempfile.gettempdir()

        for conn in executor._death_writers:  # what the workers see when the engine dies
            conn.close()
        wait_for(lambda: not os.path.exists(rendezvous), 30, "the workers to remove the rendezvous dir")
    finally:
        llm.shutdown()
    assert not os.path.exists(executor.rendezvous_dir)


def _forbidden(*args, **kwargs):
    raise AssertionError("an object (pickle) collective was used")


def _tp_rank(rank: int, world: int, store_path: str) -> None:
    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, _forbidden)
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world, store_path, torch.device("cpu"))
    try:
        x = torch.full((4, 8), float(rank + 1))
        assert torch.equal(tp_all_reduce(x), torch.full((4, 8), float(sum(range(1, world + 1)))))
        from worker.shm_allreduce import _broadcast_name
        with pytest.raises(ValueError, match="invalid shared-memory segment name"):
            _broadcast_name("../../dev/evil" if rank == 0 else None)
    finally:
        destroy_tensor_parallel()


def test_tp_setup_unpickles_nothing(tmp_path) -> None:
    mp.start_processes(_tp_rank, args=(2, str(tmp_path / "store")), nprocs=2, start_method="spawn")
