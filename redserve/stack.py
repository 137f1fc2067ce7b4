"""``redserve serve``: a whole single-node stack from one command, kept running.

Starts an embedded Redis when no ``--redis-url`` is given, then the DP coordinator, the engines (one
process per DP rank), the API (gunicorn) and a batch worker (Celery; not with ``--no-batch-worker``), each
as a child process supervised by `redserve.supervisor`.

Rules:
- A child that dies on its own is restarted with backoff (engines rejoin as a new incarnation and get
  traffic again); only a crash loop (``--max-restarts`` restarts of one child within ``--restart-window``
  seconds) stops the stack, with exit code 1. Restarts are counted in the Redis hash
  ``{prefix}:stack:restarts`` (child name -> count; cleared at start), which the API exports in /metrics
  as ``redserve_child_restarts_total{child}``.
- The embedded Redis is watched too (`RedisWatch`): when it dies it is started again on the same port with
  the same passwords, under the same backoff and crash-loop rule, and counted as child ``redis``. Its data
  is gone (no persistence): engines re-register on their next heartbeat, clients resubscribe, and the
  launcher writes every restart count back, so the counters in /metrics never go down.
- ``--redis-replicas N`` (N >= 1, embedded only) runs a primary, N replicas and three sentinels instead
  (`redserve.redis_replicas`); every child gets a ``redis+sentinel://`` URL. Each node has its own
  `RedisWatch` (children ``redis-0`` .. ``redis-N``, ``sentinel-0`` .. ``sentinel-2``): a dead data node
  comes back as a replica of the current primary once the sentinels have replaced it, a dead sentinel
  watching the current primary. The stack file lists the nodes (``redis_nodes``).
- ``--redis-cluster N`` (N >= 1, embedded only) runs a Redis Cluster of N primaries instead
  (`redserve.redis_cluster`); every child gets a ``redis+cluster://`` URL. Each node has its own `RedisWatch`
  (children ``redis-0`` .. ``redis-{N-1}``): a dead node comes back on its ports with its nodes file, so with
  its slots (empty). The stack file lists the nodes.
- ``--redis-cluster N --redis-replicas R`` (N >= 3) gives each primary R replicas (children ``redis-{i}-r1`` ..
  ``redis-{i}-r{R}``); the cluster fails a dead primary over to a replica by itself. A dead primary is started
  again only once the failover has happened (`ClusterRedis.prepare_restart`), and rejoins as a replica of the
  node that holds its slots now; the stack file follows the roles (looked at every `ROLES_REFRESH` s).
- Ctrl-C / SIGTERM stops the API and the batch worker first, then the engines (they drain), then the
  coordinator, then Redis, each child within a deadline (`STOP_TIMEOUTS`; engines: drain timeout + 10 s)
  after which it is named in the log and SIGKILLed with its process group. A second Ctrl-C / SIGTERM
  kills everything left at once. No child outlives the launcher (PR_SET_PDEATHSIG).
- Secrets never go on a child's command line (``ps`` shows it): the Redis URL reaches the children as
  ``REDSERVE_REDIS_URL`` and the API key as ``REDSERVE_API_KEY`` (the API only), the env defaults of those
  flags. Redis URLs reach logs and stdout only through `broker.connection.mask_url`.
- While it runs, `common.stack_state` records its Redis URL so ``redserve batch`` commands find it.
- DP engines on this one node share its cores: each gets ``OMP_NUM_THREADS`` = cores / DP size (unless
  the variable is set already), so N engines do not run N x cores torch threads on the same cores.
  Keeping a core back for the API and Redis (as vLLM's CPU backend does) was measured and lost: on 2
  cores, 1 thread gave 87 tok/s at c=1 and 1,221 at c=64, 2 threads 134 and 1,584 (tiny model, bf16).
- On CUDA, engine r gets its own GPUs r*TP .. r*TP+TP-1 through ``CUDA_VISIBLE_DEVICES`` (picked from the
  user's list when set; `redserve.devices`); too few GPUs for DP x TP is an error before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable

import redis

from broker.connection import connect, mask_url
from broker.keys import RedisKeys
from common.proctitle import set_title
from common.stack_state import StackState, remove_stack_state, write_stack_state
from redserve.devices import engine_device_env
from redserve.model_arg import resolve_model
from redserve.redis_cluster import ClusterRedis
from redserve.redis_replicas import ReplicatedRedis
from redserve.redis_server import EmbeddedRedis
from redserve.supervisor import Child, ChildSpec, CrashLoop, RestartPolicy, Supervisor, describe_exit

logger = logging.getLogger("redserve.stack")

_ENGINE_FLAGS = ["dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "kv_cache_memory", "gpu_memory_utilization", "tensor_parallel_size",
                 "pipeline_parallel_size", "seed", "async_scheduling", "quantization"]
_ENGINE_SWITCHES = ["no_prefix_caching", "no_chunked_prefill", "enforce_eager"]
STOP_TIMEOUTS = {"api": 20.0, "batch": 20.0, "coordinator": 5.0}
DEFAULT_DISAGG_TIER_MEMORY = "1gb"  # the KV tier `--prefill-engines` starts when none is given
ENGINE_DRAIN_TIMEOUT = 30.0  # `redserve engine --drain-timeout` default
_TICK = 0.1
ROLES_REFRESH = 2.0  # s between two looks at an embedded cluster's roles (`Stack._refresh_cluster_roles`)


def _flags(args: argparse.Namespace, names: list[str], switches: list[str]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    out += [f"--{name.replace('_', '-')}" for name in switches if getattr(args, name)]
    return out


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "redserve.cli", *argv]


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(max_restarts=args.max_restarts, restart_window=args.restart_window)


class RedisWatch:
    """Restarts the embedded Redis when it dies, under the supervisor's backoff and crash-loop rule.

    Rules:
    - `check` (main thread: PR_SET_PDEATHSIG) notices the death, logs it and plans the restart with
      `Supervisor.plan_restart` (which raises `CrashLoop`); once the backoff is over it starts the server
      again with `EmbeddedRedis.restart` (same port, same passwords) and calls `on_restart("redis")`.
    - A restart that fails (the port was taken meanwhile) counts as another death.
    - `ready_to_restart()` (default: always) may put a due restart off to a later `check` (a replicated
      node waits for the sentinels to have replaced it, `ReplicatedRedis.prepare_restart`).
    """

    NAME = "redis"

    def __init__(self, server: EmbeddedRedis, supervisor: Supervisor, on_restart: Callable[[str], None],
                 name: str = NAME, ready_to_restart: Callable[[], bool] | None = None) -> None:
        self.server = server
        self.supervisor = supervisor
        self.on_restart = on_restart
        self.name = name
        self.ready_to_restart = ready_to_restart or (lambda: True)
        self.record = Child(ChildSpec(name, [], {}, 0.0), started_at=time.monotonic())

    @property
    def _label(self) -> str:
        return "" if self.name == self.NAME else f" {self.name}"

    def check(self) -> None:
        now, record = time.monotonic(), self.record
        if record.restart_at is None:
            if not self.server.running:
                code = self.server.returncode or 0
                logger.error("the embedded Redis%s (pid %s) %s", self._label, self.server.pid, describe_exit(code))
                self.supervisor.plan_restart(record, code, now)
        elif now >= record.restart_at and self.ready_to_restart():
            record.restarts.append(now)
            record.restart_at = None
            record.started_at = now
            try:
                self.server.restart()
            except RuntimeError as e:
                logger.error("could not restart the embedded Redis%s: %s", self._label, e)
                self.supervisor.plan_restart(record, 1, time.monotonic())
                return
            logger.warning("restarted the embedded Redis%s (pid %d, same port and passwords; restart %d within "
                           "%.0f s)", self._label, self.server.pid, len(record.restarts),
                           self.supervisor.policy.restart_window)
            self.on_restart(self.name)


def api_workers(cores: int) -> int:
    """API worker processes by default: a quarter of the node's cores, at least 2 and at most 8. Each streams
    with one GIL; measured on a 2-core EPYC, the API spent ~134 us of CPU per streamed token (detokenize,
    JSON, one SSE write, queue hand-offs), so 2 workers cap a fast GPU engine near 15k tokens/s."""
    return max(2, min(8, cores // 4))


def engine_threads(cores: int, dp_size: int) -> int:
    """Torch threads per DP engine: the node's cores split over its engines."""
    return max(1, cores // dp_size)


class Stack:
    """The processes of one ``redserve serve``; see the module rules."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.roles = engine_roles(args)  # first: it sets the DP size of --prefill-engines / --decode-engines
        self.engine_devices = _engine_device_envs(args)
        self.keys = RedisKeys(args.key_prefix)
        self.redis: EmbeddedRedis | None = None
        self.replicated: ReplicatedRedis | None = None
        self.cluster: ClusterRedis | None = None
        self.kv_tier: EmbeddedRedis | None = None
        self._kv_tier_watch: RedisWatch | None = None
        self.supervisor = Supervisor(restart_policy(args), on_restart=self._count_restart)
        self.stopping = False
        self.ready = False
        self.restart_counts: dict[str, int] = {}
        self._counter: redis.Redis | None = None
        self._redis_watch: RedisWatch | None = None
        self._node_watches: list[RedisWatch] = []
        self._nodes_written: list[dict] = []
        self._nodes_checked = 0.0
        if getattr(args, "redis_replicas", 0) < 0:
            raise ValueError(f"--redis-replicas must be >= 0, got {args.redis_replicas}")
        if getattr(args, "redis_replicas", 0) and args.redis_url:
            raise ValueError("--redis-replicas starts an embedded replicated Redis; with --redis-url point at your "
                             "own Sentinel deployment instead (a redis+sentinel:// URL)")
        if not 0 <= getattr(args, "api_nice", 0) <= 19:
            raise ValueError(f"--api-nice must be 0 to 19, got {args.api_nice}")
        if getattr(args, "redis_cluster", 0) < 0:
            raise ValueError(f"--redis-cluster must be >= 0, got {args.redis_cluster}")
        if getattr(args, "redis_cluster", 0) and getattr(args, "redis_replicas", 0) and args.redis_cluster < 3:
            raise ValueError("--redis-cluster N --redis-replicas R needs N >= 3: a majority of the primaries votes "
                             "a replica in, so with fewer no failover could happen")
        if getattr(args, "redis_cluster", 0) and args.redis_url:
            raise ValueError("--redis-cluster starts an embedded cluster: it does not go with --redis-url (point at "
                             "your own cluster with a redis+cluster:// URL instead)")
        if getattr(args, "kv_tier_memory", None) and getattr(args, "kv_tier_url", None):
            raise ValueError("--kv-tier-memory starts an embedded KV tier; --kv-tier-url points at your own: give one")
        if getattr(args, "kv_tier_memory", None) and getattr(args, "no_prefix_caching", False):
            raise ValueError("the KV tier stores and finds prefix blocks: it needs prefix caching on")

    def start(self) -> None:
        args = self.args
        resolve_model(args)
        if not args.redis_url and getattr(args, "redis_cluster", 0):
            self._start_cluster(args.redis_cluster, getattr(args, "redis_replicas", 0))
        elif not args.redis_url and getattr(args, "redis_replicas", 0):
            self._start_replicated(args.redis_replicas)
        elif not args.redis_url:
            self.redis = EmbeddedRedis().start()
            args.redis_url = self.redis.url
            self._redis_watch = RedisWatch(self.redis, self.supervisor, self._count_restart)
            logger.info("started embedded Redis at %s (inspect it with `redserve redis-cli`)", mask_url(args.redis_url))
        if getattr(args, "kv_tier_memory", None):
            self._start_kv_tier(args.kv_tier_memory)
        self._counter = connect(args.redis_url, retries=1, socket_timeout=2.0, client_name="redserve-serve")
        self._reset_restart_counts()
        log = ["--log-level", args.log_level]
        prefix = ["--key-prefix", args.key_prefix]
        self._start("coordinator", _cli(*log, "coordinator", *prefix, *(["--dp-lockstep"] if args.dp_lockstep else [])))
        for rank in range(args.data_parallel_size):
            self._start(f"engine-{rank}", _cli(*log, "engine", "--model", args.model, "--dp-rank", str(rank), *prefix,
                                              *_flags(args, _ENGINE_FLAGS, _ENGINE_SWITCHES), "--role", self.roles[rank]),
                        self._engine_env(rank), stop_timeout=ENGINE_DRAIN_TIMEOUT + 10)
        api = ["api", "--model", args.model, "--host", args.host, "--port", str(args.port),
               "--workers", str(args.api_workers or api_workers(os.cpu_count() or 1)), "--max-queued-requests", str(args.max_queued_requests),
               "--nice", str(getattr(args, "api_nice", 0))]
        if args.served_model_name:
            api += ["--served-model-name", args.served_model_name]
        api += _flags(args, ["tool_call_parser", "max_migrations"], ["public_metrics", "trust_request_chat_template",
                                                   "enable_auto_tool_choice"])
        self._start("api", _cli(*log, *api, *prefix), {"REDSERVE_API_KEY": args.api_key} if args.api_key else {})
        names = [args.served_model_name] if args.served_model_name else []
        if not args.no_batch_worker:
            self._start("batch", _cli(*log, "batch", "worker", "--model", args.model, *prefix,
                                      *(["--served-model-name", *names] if names else [])))
        self._write_state()

    def _start_kv_tier(self, memory: str) -> None:
        """The engines' KV tier: a Valkey of its own, a cache (allkeys-lru), restarted empty if it dies."""
        self.kv_tier = EmbeddedRedis(maxmemory=memory, maxmemory_policy="allkeys-lru", title="redserve-kv-tier").start()
        self.args.kv_tier_url = self.kv_tier.url
        self._kv_tier_watch = RedisWatch(self.kv_tier, self.supervisor, self._count_restart, "kv-tier")
        logger.info("started the KV tier (%s, allkeys-lru) at %s", memory, mask_url(self.kv_tier.url))

    def _start_replicated(self, replicas: int) -> None:
        self.replicated = rr = ReplicatedRedis(replicas).start()
        self.args.redis_url = rr.url
        self._node_watches = [RedisWatch(node, self.supervisor, self._count_restart, name,
                                         ready_to_restart=lambda name=name: rr.prepare_restart(name))
                              for name, node in rr.nodes.items()]
        logger.info("started embedded Redis with %d replica(s) and %d sentinels at %s (inspect it with "
                    "`redserve redis-cli`)", replicas, len(rr.sentinels), mask_url(rr.url))

    def _start_cluster(self, primaries: int, replicas: int) -> None:
        self.cluster = rc = ClusterRedis(primaries, replicas).start()
        self.args.redis_url = rc.url
        self._node_watches = [RedisWatch(node, self.supervisor, self._count_restart, name,
                                         ready_to_restart=lambda name=name: rc.prepare_restart(name))
                              for name, node in rc.nodes.items()]
        logger.info("started an embedded Redis Cluster of %d primaries with %d replica(s) each at %s (inspect it "
                    "with `redserve redis-cli`)", primaries, replicas, mask_url(rc.url))

    def _write_state(self) -> None:
        args = self.args
        names = [args.served_model_name] if args.served_model_name else []
        embedded = self.replicated or self.cluster or self.redis
        admin_url = embedded.admin_url if embedded is not None else None
        nodes = embedded.describe() if embedded is not None and embedded is not self.redis else []
        self._nodes_written, self._nodes_checked = nodes, time.monotonic()
        write_stack_state(StackState(args.redis_url, args.key_prefix, args.model, names, admin_redis_url=admin_url,
                                     redis_nodes=nodes))

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
               stop_timeout: float | None = None) -> None:
        full_env = {**os.environ, "REDSERVE_REDIS_URL": self.args.redis_url, **(env or {})}
        timeout = stop_timeout if stop_timeout is not None else STOP_TIMEOUTS[name]
        self.supervisor.start(ChildSpec(name, argv, full_env, timeout))

    def _engine_env(self, rank: int) -> dict[str, str]:
        threads = str(engine_threads(os.cpu_count() or 1, self.args.data_parallel_size))
        tier = {"REDSERVE_KV_TIER_URL": self.args.kv_tier_url} if getattr(self.args, "kv_tier_url", None) else {}
        return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads), **tier, **self.engine_devices[rank]}

    def _reset_restart_counts(self) -> None:
        try:
            self._counter.delete(self.keys.stack_restarts())
        except redis.RedisError as e:
            logger.warning("could not clear %s: %s", self.keys.stack_restarts(), e)

    def _count_restart(self, name: str) -> None:
        """Count it; write every count (a restarted Redis has lost them all)."""
        self.restart_counts[name] = self.restart_counts.get(name, 0) + 1
        try:
            self._counter.hset(self.keys.stack_restarts(), mapping=self.restart_counts)
        except redis.RedisError as e:
            logger.warning("could not count the restart of %s in Redis: %s", name, e)

    def supervise(self) -> int:
        """Keep the children running until a stop is requested (0) or a child crash-loops (1)."""
        while not self.stopping:
            try:
                for watch in self._watches():
                    restarts = len(watch.record.restarts)
                    watch.check()
                    if len(watch.record.restarts) != restarts and self.redis is None:
                        self._write_state()  # new pids
                self._refresh_cluster_roles()
                self.supervisor.check()
            except CrashLoop as e:
                logger.error("%s", e)
                return 1
            if not self.ready and self._healthy():
                self.ready = True
                args = self.args
                print(f"redserve is serving {args.model} at http://{args.host}:{args.port}/v1 "
                      f"(Redis {mask_url(args.redis_url)}); Ctrl-C stops it", flush=True)
            time.sleep(_TICK if self.ready else 0.5)
        return 0

    def _refresh_cluster_roles(self) -> None:
        """A cluster with replicas fails over by itself: every `ROLES_REFRESH` s, write the stack file again when
        a node's role (or pid) changed."""
        if self.cluster is None or not self.cluster.replicas or \
                time.monotonic() - self._nodes_checked < ROLES_REFRESH:
            return
        self._nodes_checked = time.monotonic()
        if self.cluster.describe() != self._nodes_written:
            self._write_state()

    def _watches(self) -> list[RedisWatch]:
        watches = [self._redis_watch] if self._redis_watch is not None else list(self._node_watches)
        return watches + ([self._kv_tier_watch] if self._kv_tier_watch is not None else [])

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.args.host}:{self.args.port}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def request_stop(self) -> None:
        """Signal handler: the first call stops gracefully, a second one forces the stop."""
        if self.stopping:
            logger.warning("second stop request: killing every child now")
            self.supervisor.force()
        self.stopping = True

    def stop(self) -> None:
        self.stopping = True
        engines = [c.name for c in self.supervisor.children if c.name.startswith("engine-")]
        self.supervisor.stop([["api", "batch"], engines, ["coordinator"]])
        remove_stack_state()
        if self._counter is not None:
            self._counter.close()
        if self.redis is not None:
            self.redis.stop()
        if self.replicated is not None:
            self.replicated.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.kv_tier is not None:
            self.kv_tier.stop()
        logger.info("stack stopped")


def engine_roles(args: argparse.Namespace) -> list[str]:
    """Each engine's role. ``--prefill-engines P --decode-engines D`` makes P + D engines (the DP size), the first
    P prefill, the rest decode, and a KV tier for them (1gb unless one is given); else every engine is ``both``."""
    prefill, decode = getattr(args, "prefill_engines", 0), getattr(args, "decode_engines", 0)
    if not prefill and not decode:
        return ["both"] * args.data_parallel_size
    if prefill < 1 or decode < 1:
        raise ValueError("--prefill-engines and --decode-engines go together, each >= 1")
    if args.data_parallel_size not in (1, prefill + decode):
        raise ValueError("--prefill-engines P --decode-engines D start P + D engines: leave out --data-parallel-size")
    if getattr(args, "no_prefix_caching", False):
        raise ValueError("prefill/decode disaggregation hands requests over through the KV tier: it needs prefix caching")
    args.data_parallel_size = prefill + decode
    if not getattr(args, "kv_tier_url", None) and not getattr(args, "kv_tier_memory", None):
        args.kv_tier_memory = DEFAULT_DISAGG_TIER_MEMORY
    return ["prefill"] * prefill + ["decode"] * decode


def _engine_device_envs(args: argparse.Namespace) -> list[dict[str, str]]:
    """Each DP engine's GPUs (`redserve.devices`); none when the engines run on the CPU."""
    if getattr(args, "device", "auto") == "cpu":
        return [{} for _ in range(args.data_parallel_size)]
    per_engine = args.tensor_parallel_size * args.pipeline_parallel_size
    return [engine_device_env(rank, per_engine) for rank in range(args.data_parallel_size)]


def run_stack(args: argparse.Namespace) -> int:
    set_title("redserve-serve")
    try:
        stack = Stack(args)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    signal.signal(signal.SIGINT, lambda *_: stack.request_stop())
    signal.signal(signal.SIGTERM, lambda *_: stack.request_stop())
    code = 1
    try:
        stack.start()
        code = stack.supervise()
    finally:
        stack.stop()
    return code
