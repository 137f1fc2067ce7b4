"""``redserve status``: what a running deployment looks like in Redis, in one screen.

Reads only (never writes): the coordinator (lock holder, lock TTL, `{rs}:coordinator`), the wave,
every registered engine (state, host/pid, load, KV usage, heartbeat age and TTL left, wave, request
stream length and pending count, its `{rs}:lb` entry, its prefix-cache hit rate, the size of its prefix
index and how often the API routed to it for its cache or for its load; with a KV tier, its tier counters), engines recently declared dead (their hashes are
kept a while), and the clients (API processes, Celery workers) with their heartbeats. Behind sentinels
(a ``redis+sentinel://`` URL) it also names the primary and the healthy replicas the sentinels see; on a
cluster (``redis+cluster://``), its primaries and each one's replicas (as CLUSTER SLOTS lists them).
`--json` prints the same as one JSON object. Imports no torch.

Garbage in Redis (a malformed id in a set, a key of the wrong type, a field that is not a number) is
skipped with a warning on stderr (`broker.control_state`); the good entries are still shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import redis

from broker.control_state import decode_fields, is_wrong_type, parse_int, read_members, utf8, warn_bad
from broker.keys import RedisKeys, check_id
from broker.load_balance import engine_role, read_lb_snapshot
from broker.prefix_index import read_routing_counts
from broker.registry import EngineRegistry
from protocol.engine_load import EngineLoad


def collect_status(r: redis.Redis, keys: RedisKeys) -> dict[str, Any]:
    """Everything `redserve status` shows, as plain data."""
    now = time.time()
    p = r.pipeline(transaction=False)
    p.get(keys.coordinator_lock())
    p.pttl(keys.coordinator_lock())
    p.hgetall(keys.coordinator())
    p.get(keys.wave())
    replies = p.execute(raise_on_error=False)
    lock_holder, lock_pttl, coordinator = (
        _checked(reply, key)
        for reply, key in zip(replies[:3], [keys.coordinator_lock()] * 2 + [keys.coordinator()], strict=True))
    holder = None if lock_holder is None else utf8(lock_holder) or repr(lock_holder)
    engines = EngineRegistry(r, keys).all_engines()
    lb = read_lb_snapshot(r, keys)
    _add_engine_details(r, keys, engines, lb, now)
    return {
        "prefix": keys.prefix,
        "coordinator": {
            **decode_fields(coordinator or {}, keys.coordinator()),
            "holder": holder,
            "lock_ttl_s": round(lock_pttl / 1000, 2) if holder and isinstance(lock_pttl, int) and lock_pttl > 0
            else None,
        },
        "wave": _wave(replies[3], keys.wave()),
        "engines": engines,
        "dead_engines": _dead_engines(r, keys, {e["engine_id"] for e in engines}),
        "clients": _clients(r, keys),
    }


def _checked(reply: Any, key: str) -> Any:
    """A pipeline reply; None for a key of the wrong type (logged). Other errors raise."""
    if isinstance(reply, Exception):
        if not is_wrong_type(reply):
            raise reply
        warn_bad(f"{key}:wrongtype", "ignoring %s: %s", key, reply)
        return None
    return reply


def _wave(reply: Any, key: str) -> int | None:
    """The wave counter (0 before a coordinator ever ran); None if it holds something else."""
    if reply is None:
        return 0
    raw = _checked(reply, key)
    return None if raw is None else parse_int(utf8(raw) or "")


def _add_engine_details(r: redis.Redis, keys: RedisKeys, engines: list[dict], lb: dict, now: float) -> None:
    p = r.pipeline(transaction=False)
    for e in engines:
        p.pttl(keys.engine_alive(e["engine_id"]))
        p.xlen(keys.request_stream(e["engine_id"]))
        p.xpending(keys.request_stream(e["engine_id"]), keys.consumer_group)
        p.scard(keys.engine_blocks(e["engine_id"]))
        p.hmget(keys.engine_workers(e["engine_id"]), "address", "port", "stages", "hosts")
    replies = p.execute(raise_on_error=False)
    routing = read_routing_counts(r, keys)
    for i, e in enumerate(engines):
        pttl, length, pending, indexed, workers = replies[5 * i: 5 * i + 5]
        e["worker_hosts"] = _worker_hosts(workers, keys.engine_workers(e["engine_id"]))
        e["prefix_index_blocks"] = indexed if isinstance(indexed, int) else None
        e["routed"] = {"cache": 0, "load": 0, **routing.get(e["engine_id"], {})}
        ttl = e.get("heartbeat_ttl")
        left = pttl / 1000 if isinstance(pttl, int) and pttl > 0 else None
        e["heartbeat_ttl_left_s"] = None if left is None else round(left, 2)
        e["heartbeat_age_s"] = None if left is None or not isinstance(ttl, (int, float)) else round(ttl - left, 2)
        e["stream_len"] = length if isinstance(length, int) else 0
        e["pending"] = int(pending["pending"]) if isinstance(pending, dict) else 0
        load = lb.get(e["engine_id"])
        e["lb"] = None if load is None else {"waiting": load.waiting, "running": load.running,
                                             "kv_usage": load.kv_usage, "age_s": round(now - load.ts, 2)}


def _mb(value: Any) -> str:
    return f"{value / 2**20:.1f}" if isinstance(value, (int, float)) else "-"


def _worker_hosts(reply: Any, key: str) -> dict[str, Any] | None:
    """An engine's remote pipeline stages (never the link key), or None if it has none."""
    if not isinstance(reply, list) or reply[0] is None:
        return None
    address, port, stages, hosts = (utf8(v) if isinstance(v, bytes) else None for v in reply)
    try:
        joined = json.loads(hosts) if hosts else []
        joined = [{k: h.get(k) for k in ("host", "stages", "state")} for h in joined if isinstance(h, dict)]
    except ValueError:
        warn_bad(key, "ignoring field hosts of %s: not JSON", key)
        joined = []
    return {"listen": f"{address}:{port}", "stages": stages, "hosts": joined}


def _dead_engines(r: redis.Redis, keys: RedisKeys, registered: set[str]) -> list[dict[str, Any]]:
    pattern = keys.engine("*")
    head, tail = pattern.split("*")
    found = []
    for raw in r.scan_iter(match=pattern, _type="HASH", count=500):
        key = utf8(raw) or ""
        try:
            engine_id = check_id("engine", key[len(head):len(key) - len(tail)])
        except ValueError as e:
            warn_bad(f"{raw!r}:engine-key", "ignoring %r: %s", raw, e)
            continue
        if engine_id in registered:
            continue
        try:
            info = decode_fields(r.hgetall(raw), key)
        except redis.ResponseError as e:  # it changed type since the SCAN
            _checked(e, key)
            continue
        if info:
            found.append({"engine_id": engine_id, "state": info.get("state"), "host": info.get("host"),
                          "pid": info.get("pid"), "dead_at": info.get("dead_at")})
    return sorted(found, key=lambda d: d["engine_id"])


def _clients(r: redis.Redis, keys: RedisKeys) -> list[dict[str, Any]]:
    ids = read_members(r, keys.clients(), "client")
    p = r.pipeline(transaction=False)
    for client_id in ids:
        p.get(keys.client_alive(client_id))
        p.pttl(keys.client_alive(client_id))
    replies = p.execute(raise_on_error=False) if ids else []
    clients = []
    for c, value, pttl in zip(ids, replies[0::2], replies[1::2], strict=True):
        value = _checked(value, keys.client_alive(c))
        clients.append({"client_id": c, "alive": value is not None,
                        "info": None if value is None else value.decode("utf-8", "replace"),
                        "heartbeat_ttl_left_s": round(pttl / 1000, 2) if isinstance(pttl, int) and pttl > 0 else None})
    return clients


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]


def format_status(s: dict[str, Any]) -> str:
    """The human-readable screen."""
    c = s["coordinator"]
    if c["holder"]:
        coord = (f"{c['holder']} (pid {c.get('pid', '?')} on {c.get('host', '?')}), lock TTL {c['lock_ttl_s']}s, "
                 f"lockstep {'on' if c.get('lockstep') == 1 else 'off'}")
        if isinstance(c.get("lb_written_at"), (int, float)):
            coord += f", {{rs}}:lb written {time.time() - c['lb_written_at']:.1f}s ago"
    else:
        coord = "none active (no lock holder): {rs}:lb and {rs}:wave are not being updated"
    wave = "? (not a wave number)" if s["wave"] is None else s["wave"]
    lines = [f"prefix {s['prefix']!r}   wave {wave}", f"coordinator: {coord}", "",
             f"engines ({len(s['engines'])}):"]
    rows = []
    for e in s["engines"]:
        hb = "expired" if e["heartbeat_ttl_left_s"] is None else (
            f"{e['heartbeat_age_s']}s/{e.get('heartbeat_ttl')}s" if e["heartbeat_age_s"] is not None
            else f"{e['heartbeat_ttl_left_s']}s left")
        wave = f"{e.get('wave', '-')}{'*' if e.get('wave_running') == 1 else ''}"
        load = EngineLoad.from_stats(e)
        rows.append([e["engine_id"], engine_role(e), e.get("state"), "yes" if e["alive"] else "NO",
                     f"{e.get('host')}/{e.get('pid')}",
                     load.waiting, load.running, load.kv_usage, load.step,
                     e.get("generated_tokens", 0), hb, wave, e["stream_len"], e["pending"],
                     "-" if e["lb"] is None else f"{e['lb']['waiting']}/{e['lb']['running']} ({e['lb']['age_s']}s)",
                     e.get("prefix_cache_hit_rate"), e.get("prefix_index_blocks"),
                     f"{e['routed']['cache']}/{e['routed']['load']}"])
    lines += _table(["id", "role", "state", "alive", "host/pid", "waiting", "running", "kv", "steps", "gen_tokens",
                     "heartbeat age/ttl", "wave", "stream", "pending", "lb w/r (age)", "prefix hit", "index",
                     "routed c/l"], rows)
    lines.append("  (wave*: the engine is in a running wave; stream = XLEN, pending = XPENDING: requests in flight;")
    lines.append("   prefix hit = prompt tokens found in its prefix cache / looked up; index = block hashes it")
    lines.append("   publishes for cache-aware routing; routed c/l = requests sent to it for its cache / its load)")
    remote = [e for e in s["engines"] if e.get("worker_hosts")]
    if remote:
        lines += ["", "remote pipeline stages (redserve worker):"]
        lines += _table(["engine", "stages", "listens", "worker hosts (stages, state)"],
                        [[e["engine_id"], e["worker_hosts"]["stages"], e["worker_hosts"]["listen"],
                          ", ".join(f"{h['host']} ({h['stages']}, {h['state']})" for h in e["worker_hosts"]["hosts"])
                          or "none yet"] for e in remote])
    tiered = [e for e in s["engines"] if "kv_tier_lookups" in e]
    if tiered:
        lines += ["", "KV tier (README 'KV tier'):"]
        lines += _table(["engine", "lookups", "hit blocks", "miss blocks", "corrupt", "stored", "MB in", "MB out",
                         "load s", "errors", "dropped", "store used/max MB"],
                        [[e["engine_id"], e.get("kv_tier_lookups"), e.get("kv_tier_hit_blocks"),
                          e.get("kv_tier_miss_blocks"), e.get("kv_tier_corrupt_blocks"), e.get("kv_tier_stored_blocks"),
                          _mb(e.get("kv_tier_bytes_in")), _mb(e.get("kv_tier_bytes_out")), e.get("kv_tier_load_seconds"),
                          e.get("kv_tier_errors"), e.get("kv_tier_dropped_blocks"),
                          f"{_mb(e.get('kv_tier_store_used_bytes'))}/{_mb(e.get('kv_tier_store_max_bytes'))}"]
                         for e in tiered])
    if s["dead_engines"]:
        lines += ["", f"other engine records: dead, or not valid registrations ({len(s['dead_engines'])}):"]
        lines += _table(["id", "state", "host/pid", "dead_at"],
                        [[d["engine_id"], d["state"], f"{d['host']}/{d['pid']}", d["dead_at"]] for d in s["dead_engines"]])
    lines += ["", f"clients ({sum(c['alive'] for c in s['clients'])} alive of {len(s['clients'])}):"]
    lines += _table(["id", "alive", "host pid", "heartbeat ttl left"],
                    [[c["client_id"], "yes" if c["alive"] else "NO", c["info"], c["heartbeat_ttl_left_s"]]
                     for c in s["clients"]])
    return "\n".join(lines)


def _topology(redis_url: str) -> dict | list[str] | None:
    from broker.connection import cluster_replicas, cluster_topology, connect, replication_topology

    client = connect(redis_url, retries=1)
    try:
        primaries = cluster_topology(client)
        if primaries is not None:
            replicas = cluster_replicas(client) or {}
            return [{"primary": p, "replicas": replicas.get(p, [])} for p in primaries]
        return replication_topology(client)
    except redis.RedisError as e:
        return {"error": str(e), "master_name": "?", "primary": "?", "replicas": []}
    finally:
        client.close()


def run_from_args(args: argparse.Namespace) -> int:
    from broker.connection import connect, mask_url
    url = mask_url(args.redis_url)
    client = connect(args.redis_url, retries=1)
    try:
        status = collect_status(client, RedisKeys(args.key_prefix))
    except redis.RedisError as e:
        print(f"redserve status: cannot read Redis at {url}: {e}")
        return 1
    finally:
        client.close()
    status["redis_url"] = url
    header = f"redis {url}   "
    topology = _topology(args.redis_url)
    if isinstance(topology, list):
        status["redis_cluster"] = [shard["primary"] for shard in topology]
        status["redis_cluster_replicas"] = {shard["primary"]: shard["replicas"] for shard in topology}
        shards = [shard["primary"] + (f" (replicas {', '.join(shard['replicas'])})" if shard["replicas"] else "")
                  for shard in topology]
        header += f"(cluster of {len(topology)} primaries: {', '.join(shards)})   "
    elif topology is not None:
        status["redis_replication"] = topology
        header += (f"(sentinel master {topology['master_name']}: primary {topology['primary']}, replicas "
                   f"{', '.join(topology['replicas']) or 'none'})   ")
    with contextlib.suppress(BrokenPipeError):  # `redserve status | head`
        print(json.dumps(status, default=str) if args.json else header + format_status(status))
    return 0
