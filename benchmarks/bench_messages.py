"""Encode + decode time per message on the wire paths that run every request or every step.

Three cases, each timed as one full round trip (objects -> bytes -> objects):
- ``engine_outputs_x64``: an ``EngineOutputs`` with 64 running ``RequestOutput`` s, through
  ``protocol.messages.encode`` / ``decode`` (one per client per engine step);
- ``add_request``: an ``AddRequest`` with a 256-token prompt and a typical params dict (one per request);
- ``scheduler_output_x64``: a ``SchedulerOutput`` of 64 cached (decoding) requests, through
  ``protocol.step_types`` and the shm queue codec ``worker.serialization`` (one per TP step), plus
  the 64-token ``ModelRunnerOutput`` reply.

Prints microseconds per round trip: the best of ``--repeat`` runs of ``--number`` round trips each
(the best run is the one least disturbed by other processes on the machine).

    python benchmarks/bench_messages.py [--number 2000] [--repeat 7]

To compare with another tree, run the same script with that tree first on ``sys.path``:
``PYTHONPATH=/path/to/other/tree python benchmarks/bench_messages.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another tree there wins

from protocol import step_types  # noqa: E402
from protocol.messages import AddRequest, EngineOutputs, RequestOutput, decode, encode  # noqa: E402
from protocol.sampling_params import SamplingParams  # noqa: E402
from protocol.step_types import CachedRequestData, ModelRunnerOutput, SampledToken, SchedulerOutput  # noqa: E402
from worker import serialization  # noqa: E402


def engine_outputs_case() -> Callable[[], object]:
    outs = EngineOutputs("engine-0", [RequestOutput(f"req-{i:06d}", 0, [1000 + i], None, None, 512, 128)
                                      for i in range(64)], time.time(), seq=1)
    return lambda: decode(encode(outs))


def add_request_case() -> Callable[[], object]:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, seed=1)
    add = AddRequest("req-000001", "client-0", list(range(1000, 1256)), params, time.time(), time.time() + 60)
    return lambda: decode(encode(add))


def scheduler_output_case() -> Callable[[], object]:
    ids = [f"req-{i:06d}" for i in range(64)]
    sched = SchedulerOutput(cached_requests=[CachedRequestData(r, [] if i % 16 else [700 + i], 300 + i)
                                             for i, r in enumerate(ids)],
                            num_scheduled_tokens=dict.fromkeys(ids, 1))
    runner = ModelRunnerOutput({r: SampledToken(2000 + i) for i, r in enumerate(ids)})

    def round_trip() -> object:
        wire = serialization.encode(["execute_model", [step_types.scheduler_output_to_wire(sched)], 0])
        got = step_types.scheduler_output_from_wire(serialization.decode(wire)[1][0])
        reply = serialization.decode(serialization.encode(step_types.runner_output_to_wire(runner)))
        return got, step_types.runner_output_from_wire(reply)

    return round_trip


CASES = {"engine_outputs_x64": engine_outputs_case, "add_request": add_request_case,
         "scheduler_output_x64": scheduler_output_case}


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    fn()
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    return min(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--number", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    for name, make in CASES.items():
        print(f"{name:22s} {best_us(make(), args.number, args.repeat):8.1f} us per encode+decode")


if __name__ == "__main__":
    main()
