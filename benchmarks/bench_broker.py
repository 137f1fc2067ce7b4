"""Broker throughput: fake engines publish token outputs to fake clients through an embedded cluster of 1 and 3 shards.

No model: each fake engine is a process running the engine's own `broker.engine_link.OutputPublisher` in a closed
loop, one pipeline per "step" carrying one `EngineOutputs` per client (SPUBLISH to ``rs:out:{client}``), each with
``--requests-per-client`` running requests of one new token (a decode step). Each fake client is a process holding
the API's subscription (`broker.channels.Subscriber`, SSUBSCRIBE) and decoding every message, as the listener does.
Clients subscribe first; then the engines publish for ``--seconds``. Reported per (shards, engines, clients):
messages/s and tokens/s received (and sent), the CPU the servers used meanwhile and the messages delivered per
server CPU-second, and the 3-shard / 1-shard ratio of tokens received. The last lines project a ceiling from the
best messages per server CPU-second (each shard one single-threaded server on a core of its own).

The target of issue 29: >= 2.5x from 1 to 3 shards, and headroom for 64 engines at 50k tok/s each (3.2M tok/s).
Scaling needs cores: every shard is one single-threaded server, and the fake engines and clients are Python
processes; on a machine with fewer cores than shards + engines + clients the shards compete with the load
generators for the same cores and the ratio says more about the machine than the broker. The script prints the
core count with the results.

    python benchmarks/bench_broker.py [--seconds 3] [--shape 2x2 --shape 4x4 ...] [--requests-per-client 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another tree there wins

from broker.channels import Subscriber  # noqa: E402
from broker.connection import connect  # noqa: E402
from broker.engine_link import OutputPublisher  # noqa: E402
from broker.keys import RedisKeys  # noqa: E402
from protocol.messages import EngineOutputs, RequestOutput, decode  # noqa: E402
from redserve.redis_cluster import ClusterRedis  # noqa: E402

KEYS = RedisKeys("bench")


def fake_engine(url: str, engine_id: str, clients: list[str], per_client: int, start_at: float, stop_at: float,
                results: mp.Queue) -> None:
    publisher = OutputPublisher(connect(url), KEYS, engine_id)
    outputs = {c: EngineOutputs(engine_id, [RequestOutput(f"{engine_id}-{c}-{i}", 0, [1000 + i])
                                            for i in range(per_client)], 0.0) for c in clients}
    while time.time() < start_at:
        time.sleep(0.001)
    steps = 0
    while time.time() < stop_at:
        publisher.publish(outputs)
        steps += 1
    results.put(("engine", steps * len(clients), steps * len(clients) * per_client))


def fake_client(url: str, client_id: str, ready: mp.Event, stop_at: mp.Value, results: mp.Queue) -> None:
    channel = KEYS.output_channel(client_id)
    sub = Subscriber(url, channel, f"bench-{client_id}")
    sub.subscribe(channel)
    messages = tokens = 0
    while True:
        msg = sub.get_message(timeout=0.05)
        if msg is None:
            if stop_at.value and time.time() > stop_at.value + 0.5:
                break
            continue
        if msg["type"] == "subscribe":
            ready.set()
        elif msg["type"] == "message":
            outs = decode(msg["data"], expect=EngineOutputs)
            messages += 1
            tokens += sum(len(o.new_token_ids) for o in outs.outputs)
    sub.close()
    results.put(("client", messages, tokens))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time these processes have used (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def run_shape(url: str, server_pids: list[int], engines: int, clients: int, per_client: int, seconds: float) -> dict:
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    stop_at = ctx.Value("d", 0.0)
    client_ids = [f"c{i}" for i in range(clients)]
    readies = [ctx.Event() for _ in client_ids]
    subs = [ctx.Process(target=fake_client, args=(url, c, ev, stop_at, results)) for c, ev in zip(client_ids, readies,
                                                                                                 strict=True)]
    for p in subs:
        p.start()
    for ev in readies:
        if not ev.wait(30):
            raise RuntimeError("a fake client did not subscribe within 30 s")
    start = time.time() + 0.5
    stop_at.value = start + seconds
    pubs = [ctx.Process(target=fake_engine, args=(url, f"e{i}", client_ids, per_client, start, stop_at.value, results))
            for i in range(engines)]
    for p in pubs:
        p.start()
    cpu_before = cpu_seconds(server_pids)
    totals = {"engine": [0, 0], "client": [0, 0]}
    for _ in range(engines + clients):
        kind, messages, tokens = results.get(timeout=seconds + 60)
        totals[kind][0] += messages
        totals[kind][1] += tokens
    server_cpu = cpu_seconds(server_pids) - cpu_before
    for p in [*pubs, *subs]:
        p.join()
    return {"sent_msgs_s": totals["engine"][0] / seconds, "recv_msgs_s": totals["client"][0] / seconds,
            "recv_tok_s": totals["client"][1] / seconds, "lost": totals["engine"][0] - totals["client"][0],
            "msgs_per_server_cpu_s": totals["client"][0] / max(server_cpu, 1e-9), "server_cpu_share": server_cpu / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--shape", action="append", help="ENGINESxCLIENTS (repeatable; default 1x1 2x2 4x4 8x8)")
    parser.add_argument("--requests-per-client", type=int, default=16, help="running requests per client per engine")
    parser.add_argument("--shards", default="1,3", help="comma-separated cluster sizes")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in (args.shape or ["1x1", "2x2", "4x4", "8x8"])]
    shard_counts = [int(s) for s in args.shards.split(",")]
    print(f"{os.cpu_count()} cores; {args.requests_per_client} tokens per message; {args.seconds:.0f} s per run")
    table: dict[tuple[int, int, int], dict] = {}
    for shards in shard_counts:
        cluster = ClusterRedis(shards, maxmemory="256mb").start()
        try:
            for engines, clients in shapes:
                pids = [node.pid for node in cluster.nodes.values()]
                table[shards, engines, clients] = r = run_shape(cluster.url, pids, engines, clients,
                                                                args.requests_per_client, args.seconds)
                print(f"shards {shards}  engines {engines:3d} x clients {clients:3d}: "
                      f"sent {r['sent_msgs_s']:9,.0f} msg/s  received {r['recv_msgs_s']:9,.0f} msg/s "
                      f"{r['recv_tok_s']:11,.0f} tok/s  (lost {r['lost']}); servers used "
                      f"{r['server_cpu_share']:.2f} cores, {r['msgs_per_server_cpu_s']:,.0f} msg per server CPU-s",
                      flush=True)
        finally:
            cluster.stop()
    if len(shard_counts) == 2:
        low, high = shard_counts
        for engines, clients in shapes:
            a, b = table[low, engines, clients]["recv_tok_s"], table[high, engines, clients]["recv_tok_s"]
            print(f"{engines}x{clients}: {high} shards / {low} shard = {b / a:.2f}x tokens/s received")
    best = max(r["recv_tok_s"] for r in table.values())
    print(f"best: {best:,.0f} tok/s received = {best / 3.2e6:.2f} x the 3.2M tok/s of 64 engines at 50k tok/s each")
    per_core = max(r["msgs_per_server_cpu_s"] for r in table.values())
    for shards in shard_counts:
        capacity = per_core * shards * args.requests_per_client
        print(f"projected ceiling with {shards} shard(s), one core each, at {per_core:,.0f} msg per server CPU-s: "
              f"{capacity:,.0f} tok/s at {args.requests_per_client} tokens per message ({capacity / 3.2e6:.2f} x 3.2M)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
