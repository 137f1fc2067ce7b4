"""The ``redserve`` command. Each subcommand imports only what it needs, so ``redserve api`` never
loads torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from redserve.model_arg import check_model_path, resolve_model

# Niceness `serve` gives the API processes (--api-nice). Each API worker wakes for every token it streams; at equal
# priority a wakeup can preempt one of a CPU engine's compute threads, and the other then waits for it at the end of
# the parallel region (in a served tiny-model c=64 run a third of the engine's main-thread samples sat in libgomp).
# Measured on a 2-core Xeon, bench_vs_vllm.py --variant, interleaved: niceness 10 sped up the tiny model (bf16 c=64
# 1,253.8 -> 1,409.5 tok/s, every round 1.07-1.18x) but slowed SmolLM2 Q4_1 c=64 (364.9 -> 328.7 tok/s, every round
# 0.82-0.93x, a slow hour): there the API, short of CPU, delivered the last tokens and admitted the next prompts
# late. No default fits both, so 0; a deployment can measure its own.
API_NICE = 0


def _add_engine_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    env = os.environ.get  # REDSERVE_<FLAG> environment defaults (docker-compose.yml sets them)
    g.add_argument("--model", default=env("REDSERVE_MODEL"),
                   help="Hugging Face model directory or GGUF file (converted once, cached under "
                        "$REDSERVE_CACHE_DIR/gguf; default: $REDSERVE_MODEL, else the tiny test model)")
    g.add_argument("--dtype", default=env("REDSERVE_DTYPE", "auto"),
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint's bf16/fp16 on a GPU; on a CPU bf16 only for a bf16/fp16 checkpoint "
                        "on a CPU with AMX/AVX512-BF16, else float32 (README 'dtype'; the choice is logged)")
    g.add_argument("--device", default=env("REDSERVE_DEVICE", "auto"), help="auto, cpu or cuda")
    g.add_argument("--quantization", default=env("REDSERVE_QUANTIZATION", "auto"), choices=["auto", "none", "gguf", "int8"],
                   help="auto: follow the file (a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors stay quantized on the CPU); "
                        "none: serve the dequantized conversion; gguf: quantized (CPU only); int8: a float "
                        "checkpoint's projections and LM head rounded to int8 blocks at load (CPU only)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=env("REDSERVE_MAX_MODEL_LEN") or None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes on CPU (default 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=env("REDSERVE_GPU_MEMORY_UTILIZATION", 0.85))
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=env("REDSERVE_TENSOR_PARALLEL_SIZE", 1))
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=env("REDSERVE_PIPELINE_PARALLEL_SIZE", 1),
                   help="pipeline stages, each a slice of the layers on its own TP group of workers")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enforce-eager", action="store_true",
                   default=os.environ.get("REDSERVE_ENFORCE_EAGER", "").strip().lower() in ("1", "true", "yes", "on"),
                   help="no CUDA graphs: decode steps run eagerly too (default: captured per batch bucket on CUDA)")
    g.add_argument("--kv-tier-url", default=env("REDSERVE_KV_TIER_URL") or None,
                   help="the KV tier (README 'KV tier'): a Valkey/Redis of its own (maxmemory, allkeys-lru), never "
                        "the control Redis, or shm:///NAME?maxmemory=4gb for a pool shared by the engines of this "
                        "host; engines store full prefix blocks there and load a missing prefix from it "
                        "(default: $REDSERVE_KV_TIER_URL; none)")
    g.add_argument("--async-scheduling", choices=["auto", "on", "off"],
                   default=os.environ.get("REDSERVE_ASYNC_SCHEDULING", "auto"),
                   help="schedule and launch the next step while the last one runs on the device (auto: on for a "
                        "CUDA engine with TP = PP = 1)")


def _add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDSERVE_REDIS_URL"),
                   help="Redis URL (default: $REDSERVE_REDIS_URL; `serve` starts an embedded Redis when unset)")
    p.add_argument("--key-prefix", default=os.environ.get("REDSERVE_KEY_PREFIX", "rs"))


def engine_config_from_args(args: argparse.Namespace):
    from worker.config import EngineConfig
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, remote_stages=getattr(args, "remote_stages", 0),
        seed=args.seed, enforce_eager=args.enforce_eager, quantization=args.quantization,
        kv_tier_url=getattr(args, "kv_tier_url", None),
        async_scheduling={"on": True, "off": False}.get(getattr(args, "async_scheduling", "auto")))


def cmd_engine(args: argparse.Namespace) -> int:
    from common.proctitle import set_title
    from engine.server import EngineServer
    if not args.redis_url:
        sys.exit("redserve engine: --redis-url (or REDSERVE_REDIS_URL) is required")
    resolve_model(args)
    try:
        config = engine_config_from_args(args)
    except ValueError as e:  # a model directory without config.json, a bad dtype...: one line, not a traceback
        sys.exit(f"redserve engine: {e}")
    set_title(f"redserve-engine-{args.dp_rank}")
    try:
        server = EngineServer(config, args.redis_url, dp_rank=args.dp_rank,
                              engine_id=args.engine_id, key_prefix=args.key_prefix,
                              drain_timeout=args.drain_timeout, heartbeat_ttl=args.heartbeat_ttl,
                              dp_lockstep=args.dp_lockstep, worker_address=args.worker_address,
                              worker_port=args.worker_port, worker_link_timeout=args.worker_link_timeout,
                              role=args.role)
    except ValueError as e:  # a role without a KV tier
        sys.exit(f"redserve engine: {e}")
    server.install_signal_handlers()
    return server.run()


def cmd_worker(args: argparse.Namespace) -> int:
    from common.proctitle import set_title
    from worker.worker_host import WorkerHost
    if not args.redis_url:
        sys.exit("redserve worker: --redis-url (or REDSERVE_REDIS_URL) is required")
    set_title(f"redserve-worker-host-{args.engine_id}")
    stages = [int(s) for s in args.stages.split(",")] if args.stages else None
    host = WorkerHost(args.redis_url, args.engine_id, key_prefix=args.key_prefix, stages=stages,
                      address=args.address, once=args.once)
    host.install_signal_handlers()
    return host.run()


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.process import run_from_args
    if not args.redis_url:
        sys.exit("redserve coordinator: --redis-url (or REDSERVE_REDIS_URL) is required")
    return run_from_args(args)


def cmd_status(args: argparse.Namespace) -> int:
    from common.stack_state import read_stack_state
    from redserve.status import run_from_args
    if not args.redis_url:
        stack = read_stack_state()  # the running `redserve serve` on this machine, if any
        if stack is None:
            sys.exit("redserve status: pass --redis-url (or set REDSERVE_REDIS_URL): no running `redserve serve` "
                     "found on this machine")
        args.redis_url = stack.redis_url
        if "REDSERVE_KEY_PREFIX" not in os.environ and args.key_prefix == "rs":
            args.key_prefix = stack.key_prefix
    return run_from_args(args)


def cmd_redis_cli(args: argparse.Namespace) -> int:
    from redserve.redis_cli import run_from_args
    return run_from_args(args)


def cmd_batch(args: argparse.Namespace) -> int:
    from api.batch.cli import run_batch
    return run_batch(args)


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from worker.models.tiny_model import run_from_args
    return run_from_args(args)


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """Cache-aware routing flags (`broker.load_balance`), passed to the API processes as REDSERVE_* variables."""
    env = os.environ.get
    p.add_argument("--routing", choices=["cache", "load"], default=env("REDSERVE_ROUTING", "cache"),
                   help="cache: prefer the engine whose prefix cache holds the prompt's leading blocks, traded "
                        "against its load; load: the least loaded engine only (default: $REDSERVE_ROUTING, else cache)")
    p.add_argument("--cache-routing-weight", type=float, default=float(env("REDSERVE_CACHE_ROUTING_WEIGHT", 16.0)),
                   help="load units (4 per waiting request, 1 per running one) a whole cached prompt is worth")
    p.add_argument("--cache-routing-spill", type=float, default=float(env("REDSERVE_CACHE_ROUTING_SPILL", 1.25)),
                   help="an engine loaded above this x the mean load (+ --cache-routing-slack) gets no cache bonus")
    p.add_argument("--cache-routing-slack", type=float, default=float(env("REDSERVE_CACHE_ROUTING_SLACK", 4.0)))
    p.add_argument("--cache-routing-probes", type=int, default=int(env("REDSERVE_CACHE_ROUTING_PROBES", 64)),
                   help="prompt blocks looked up per engine at most (evenly spaced over a longer prompt)")


def _export_routing(args: argparse.Namespace) -> None:
    from broker.load_balance import RoutingConfig
    try:
        config = RoutingConfig(args.routing, args.cache_routing_weight, args.cache_routing_spill,
                               args.cache_routing_slack, args.cache_routing_probes)
    except ValueError as e:
        sys.exit(f"redserve {args.command}: {e}")
    os.environ.update(config.env())  # read by every API worker (`RoutingConfig.from_env`)


def cmd_api(args: argparse.Namespace) -> int:
    from api.server import run_api
    _export_routing(args)
    return run_api(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from redserve.stack import run_stack
    check_model_path(args)  # before the stack starts anything
    os.environ["REDSERVE_GENERATION_CONFIG"] = args.generation_config  # the API (and batch) children read it
    _export_routing(args)
    return run_stack(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from redserve.bench_serve import run_bench
    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="redserve", description="OpenAI-compatible LLM serving over Redis")
    parser.add_argument("--log-level", default=os.environ.get("REDSERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    from api.options import add_tool_args, env_switch

    p = sub.add_parser("serve", help="run a whole single-node stack: Redis (embedded if needed), engines, API")
    _add_engine_config_args(p)
    _add_redis_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-workers", type=int, default=None,
                   help="API worker processes (default: a quarter of the cores, 2 to 8)")
    p.add_argument("--api-nice", type=int, default=int(os.environ.get("REDSERVE_API_NICE", str(API_NICE))),
                   help="niceness the API processes add (0-19), so that on the cores they share with a CPU engine "
                        "their wakeups preempt its compute threads less; it helped a tiny model and slowed SmolLM2 "
                        f"here: measure yours (default: $REDSERVE_API_NICE, else {API_NICE})")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--api-key", default=os.environ.get("REDSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every API route but /health, /readyz, /livez "
                        "(default: $REDSERVE_API_KEY)")
    p.add_argument("--public-metrics", action="store_true", default=env_switch("REDSERVE_PUBLIC_METRICS"),
                   help="serve /metrics without the API key (default: $REDSERVE_PUBLIC_METRICS=1)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   default=env_switch("REDSERVE_TRUST_REQUEST_CHAT_TEMPLATE"),
                   help="render chat templates sent with requests (the caller's Jinja runs in the API); "
                        "refused with 400 otherwise (default: $REDSERVE_TRUST_REQUEST_CHAT_TEMPLATE=1)")
    add_tool_args(p)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--generation-config", choices=["auto", "vllm"],
                   default=os.environ.get("REDSERVE_GENERATION_CONFIG", "auto"),
                   help="auto: the model's generation_config.json sampling values are the defaults of requests "
                        "that leave them unset (as vLLM); vllm: ignore the file")
    p.add_argument("--max-concurrent-streams", "--max-queued-requests", dest="max_queued_requests", type=int,
                   default=64, help="generation slots (prompt x n) per API worker before 429 (see redserve api)")
    p.add_argument("--max-migrations", type=int, default=2,
                   help="times a started request may be resumed on another engine when its engine dies "
                        "(0: fail it with engine_gone; see redserve api)")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="idle engines run dummy steps while any engine has work (set by the coordinator)")
    p.add_argument("--no-batch-worker", action="store_true", help="do not start a batch (Celery) worker")
    p.add_argument("--redis-replicas", type=int, default=int(os.environ.get("REDSERVE_REDIS_REPLICAS", 0)),
                   help="N >= 1: the embedded Redis runs as a primary, N replicas and three sentinels, and a "
                        "killed primary is replaced by a replica (README 'Redis replication'); 0: one server. "
                        "With --redis-cluster: R replicas for each primary, the cluster's own failover")
    p.add_argument("--redis-cluster", type=int, default=int(os.environ.get("REDSERVE_REDIS_CLUSTER", 0)),
                   help="N >= 1: the embedded Redis runs as a Redis Cluster of N primaries, keys and output "
                        "channels sharded over them (README 'Redis Cluster'); 0: one server")
    p.add_argument("--prefill-engines", type=int, default=0,
                   help="prefill/decode disaggregation (README): P engines that compute prompts and hand each request "
                        "to one of --decode-engines D engines through the KV tier (started with 1gb unless "
                        "--kv-tier-memory / --kv-tier-url say otherwise); instead of --data-parallel-size")
    p.add_argument("--decode-engines", type=int, default=0, help="see --prefill-engines")
    p.add_argument("--kv-tier-memory", default=os.environ.get("REDSERVE_KV_TIER_MEMORY") or None,
                   help="start an embedded Valkey of this size (e.g. 4gb; allkeys-lru) as the engines' KV tier "
                        "(README 'KV tier'); or point at one with --kv-tier-url")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a child restarted this many times within --restart-window seconds that dies again "
                        "stops the stack (crash loop)")
    p.add_argument("--restart-window", type=float, default=60.0, help="seconds; see --max-restarts")
    _add_routing_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("engine", help="run one engine (a DP rank); may run headless on another node")
    _add_engine_config_args(p)
    _add_redis_args(p)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--engine-id", default=None, help="id in Redis (default: the DP rank)")
    p.add_argument("--headless", action="store_true", help="no API on this node (engines never run one)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--heartbeat-ttl", type=float, default=5.0,
                   help="seconds without a heartbeat after which clients and the coordinator take this engine for dead")
    p.add_argument("--dp-lockstep", action="store_true",
                   help="run dummy steps while idle in a running DP wave (also on when the coordinator says so)")
    p.add_argument("--role", choices=["both", "prefill", "decode"], default=os.environ.get("REDSERVE_ENGINE_ROLE", "both"),
                   help="prefill/decode disaggregation (README): prefill engines compute prompts and hand each request "
                        "to a decode engine through the KV tier (needs --kv-tier-url); both: no split")
    g = p.add_argument_group("pipeline stages on other hosts (README 'Two hosts')")
    g.add_argument("--remote-stages", type=int, default=int(os.environ.get("REDSERVE_REMOTE_STAGES", 0)),
                   help="the last N pipeline stages run on worker hosts (`redserve worker`), not here")
    g.add_argument("--worker-address", default=None,
                   help="address the worker hosts connect to (default: this host's address towards Redis)")
    g.add_argument("--worker-port", type=int, default=0, help="port for the worker hosts (default: any free one)")
    g.add_argument("--worker-link-timeout", type=float, default=10.0,
                   help="seconds of silence after which a worker host (or the engine, seen from it) is gone")
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("worker", help="run the remote pipeline stages of an engine on this host; joins through "
                                      "Redis and rejoins each time the engine starts again")
    _add_redis_args(p)
    p.add_argument("--engine-id", default="0", help="the engine to join (its id in Redis)")
    p.add_argument("--stages", default=None,
                   help="comma-separated pipeline stages to take (default: all the engine's remote stages left)")
    p.add_argument("--address", default=None,
                   help="this host's address for the pipeline's gloo/NCCL traffic (default: the one towards "
                        "the engine)")
    p.add_argument("--once", action="store_true", help="exit after the engine this host joined stops")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("coordinator", help="run the DP coordinator (load snapshot, waves, engine liveness); "
                                           "run several: one is active, the others stand by")
    _add_redis_args(p)
    p.add_argument("--dp-lockstep", action="store_true",
                   help="tell engines to run dummy steps while idle in a running wave")
    p.add_argument("--lock-ttl", type=float, default=3.0,
                   help="seconds a standby waits after the active coordinator stops renewing its lock")
    p.add_argument("--coordinator-id", default=None, help="id in Redis (default: host-pid-random)")
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("status", help="show engines, load, waves, request streams and clients from Redis")
    _add_redis_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("redis-cli", help="redis-cli on the stack's Redis, authenticated (password never on argv)")
    from redserve.redis_cli import add_arguments as add_redis_cli_arguments
    add_redis_cli_arguments(p)
    p.set_defaults(func=cmd_redis_cli)

    p = sub.add_parser("api", help="run the OpenAI-compatible HTTP API (gunicorn + Flask)")
    from api.options import add_api_arguments
    add_api_arguments(p)
    _add_routing_args(p)
    p.set_defaults(func=cmd_api)

    p = sub.add_parser("batch", help="batch jobs (OpenAI batch files) run by Celery workers")
    from api.batch.cli import add_batch_arguments
    add_batch_arguments(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("make-tiny-model", help="write a small random-weight HF model directory")
    from worker.models.tiny_model import add_arguments
    add_arguments(p)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser("serve", help="serving benchmark against a running server")
    from redserve.bench_serve import add_bench_arguments
    add_bench_arguments(b)
    b.set_defaults(func=cmd_bench)
    b = bench_sub.add_parser("multiturn", help="multi-turn chat benchmark (prefix reuse across turns) against a "
                                               "running server")
    from redserve.bench_multiturn import add_multiturn_arguments, run_multiturn
    add_multiturn_arguments(b)
    b.set_defaults(func=run_multiturn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
