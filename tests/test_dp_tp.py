"""DP x TP on one host: each engine gets its own GPUs (`redserve.devices`, wired into `redserve serve`),
and two TP engines on one Redis keep their workers apart (real processes, DP=2 x TP=2 on the CPU)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest
from engine_helpers import requires_devices
from stack_procs import Procs, engine_ready, process_tree, quiet_cli, title, wait_for

import redserve.devices
from broker.client import BrokerClient
from broker.keys import RedisKeys
from protocol.messages import AddRequest
from protocol.sampling_params import SamplingParams
from redserve.cli import build_parser
from redserve.devices import engine_cuda_devices, engine_device_env
from redserve.stack import Stack
from redserve.supervisor import ChildSpec

# --- the device rule ------------------------------------------------------------------------------------------


def test_engine_r_gets_devices_r_times_tp_onwards() -> None:
    devices = [str(i) for i in range(8)]
    assert [engine_cuda_devices(r, 2, devices) for r in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert [engine_cuda_devices(r, 1, devices[:3]) for r in range(3)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="engine 2 needs devices 4..5"):
        engine_cuda_devices(2, 2, devices[:5])


def test_a_user_device_list_is_picked_from_and_no_cuda_sets_nothing() -> None:
    user = {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}
    assert engine_device_env(1, 2, user, cuda_device_count=4) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert engine_device_env(1, 2, {}, cuda_device_count=4) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert engine_device_env(0, 2, {}, cuda_device_count=0) == {}
    assert engine_device_env(0, 1, {"CUDA_VISIBLE_DEVICES": ""}, cuda_device_count=0) == {}


def test_gpus_are_counted_from_the_driver_without_torch(tmp_path, monkeypatch) -> None:
    for pci in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / pci).mkdir()
    monkeypatch.setattr(redserve.devices, "NVIDIA_PROC_GPUS", str(tmp_path))
    assert redserve.devices._cuda_device_count() == 2
    monkeypatch.setattr(redserve.devices, "NVIDIA_PROC_GPUS", str(tmp_path / "absent"))
    monkeypatch.setattr(redserve.devices.shutil, "which", lambda _: None)
    assert redserve.devices._cuda_device_count() == 0
    code = "import sys, redserve.stack, redserve.devices as d; d._cuda_device_count(); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "the serve launcher imported torch"


def _serve_args(tmp_path, *flags: str):
    return build_parser().parse_args(["serve", "--redis-url", "redis://127.0.0.1:1/0", "--model", str(tmp_path),
                                      "--no-batch-worker", *flags])


def test_serve_gives_each_engine_its_gpus(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(redserve.devices, "_cuda_device_count", lambda: 4)
    stack = Stack(_serve_args(tmp_path, "--data-parallel-size", "2", "--tensor-parallel-size", "2"))
    specs: list[ChildSpec] = []
    stack.supervisor.start = specs.append
    stack.start()
    engines = {s.name: s.env.get("CUDA_VISIBLE_DEVICES") for s in specs if s.name.startswith("engine-")}
    assert engines == {"engine-0": "0,1", "engine-1": "2,3"}
    assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in specs if not s.name.startswith("engine-"))


def test_serve_refuses_more_engines_than_gpus_and_sets_nothing_on_cpu(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(redserve.devices, "_cuda_device_count", lambda: 3)
    with pytest.raises(ValueError, match="engine 1 needs devices 2..3"):
        Stack(_serve_args(tmp_path, "--data-parallel-size", "2", "--tensor-parallel-size", "2"))
    cpu = Stack(_serve_args(tmp_path, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--device", "cpu"))
    assert cpu.engine_devices == [{}, {}]


# --- two TP engines on one host ---------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _worker_titles(engine_pid: int) -> list[str]:
    names = []
    for pid in process_tree(engine_pid)[1:]:
        try:
            names.append(title(pid))
        except OSError:
            continue
    return sorted(n for n in names if n.startswith("redserve-worker"))


def _generate(client: BrokerClient, engine_id: str, prompt: list[int]) -> list[int]:
    add = AddRequest(f"q{engine_id}", "", prompt, GREEDY, time.time(), time.time() + 120)
    tokens = []
    with client.submit(add, engine_id=engine_id) as handle:
        for out in handle:
            assert out.error_code is None, out.error_text()
            tokens += out.new_token_ids
    return tokens


@requires_devices(4)
def test_two_tp2_engines_on_one_host_keep_their_workers_apart(tiny_llama_dir, redis_url, tmp_path) -> None:
    keys = RedisKeys(f"dptp{uuid.uuid4().hex[:8]}")
    procs = Procs(tmp_path)
    client = BrokerClient(redis_url, keys=keys)
    try:
        engines = {}
        for rank in range(2):
            engines[str(rank)] = procs.start(f"engine-{rank}", quiet_cli(
                "engine", "--model", tiny_llama_dir, "--redis-url", redis_url, "--key-prefix", keys.prefix,
                "--dp-rank", str(rank), "--tensor-parallel-size", "2", "--dtype", "float32",
                "--kv-cache-memory", str(8 << 20), "--max-num-seqs", "2"),
                env={"OMP_NUM_THREADS": "1", **engine_device_env(rank, 2)})
        wait_for(lambda: all(engine_ready(redis_url, keys, e) for e in engines), 120, "both TP=2 engines",
                 watch=tuple(engines.values()))
        titles = {e: _worker_titles(p.pid) for e, p in engines.items()}
        assert titles == {"0": ["redserve-worker-0-0", "redserve-worker-0-1"],
                          "1": ["redserve-worker-1-0", "redserve-worker-1-1"]}, procs.log("engine-1")
        client.start()
        wait_for(lambda: {i["engine_id"] for i in client.ready_engines()} >= {"0", "1"}, 30, "the client's view")
        prompt = [5, 17, 99, 4, 250]
        assert _generate(client, "0", prompt) == _generate(client, "1", prompt)
    finally:
        client.stop()
        procs.close()
