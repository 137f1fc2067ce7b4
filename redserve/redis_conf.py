"""The config file of the embedded Redis: its ACL users, its limits, no persistence.

Rules:
- Everything, the users' passwords included, goes into one file that the server reads at start
  (`redis-server PATH`), written 0600 in a 0700 directory: no secret is on its command line, where
  `ps` or /proc/PID/cmdline would show it.
- Users: `default` is off, so a connection that has not authenticated can run nothing (NOAUTH).
  `APP_USER` may run every command redserve and Celery use (streams, pub/sub, hashes, lists, sets,
  strings, EVAL/EVALSHA/SCRIPT LOAD, SELECT, CLIENT SETNAME/ID/INFO, INFO, PING, ...) on every key and
  channel, but no command in the server's ``@dangerous`` category except INFO (CONFIG, MODULE, DEBUG,
  FLUSHALL, FLUSHDB, SHUTDOWN, ACL, REPLICAOF/SLAVEOF, MIGRATE, SAVE/BGSAVE, KEYS, SORT, MONITOR,
  CLIENT KILL/LIST/PAUSE, RESTORE, ...), nor SCRIPT KILL/FLUSH, FUNCTION or any ACL subcommand: it can
  neither reconfigure nor wipe the server. `ADMIN_USER` may run everything (operators, and
  `EmbeddedRedis`'s own SHUTDOWN) except DEBUG and MODULE, which the server's defaults
  (``enable-debug-command no``, ``enable-module-command no``) keep off for every user.
- Needs Redis >= 7.0 or Valkey (subcommand rules such as ``-script|flush``).
- Limits: ``maxmemory`` (default 1gb) with ``maxmemory-policy noeviction``: a full Redis refuses writes
  with an OOM error instead of silently evicting streams, heartbeats or batch items.
  ``client-output-buffer-limit pubsub 256mb 64mb 60``: an output subscriber (an API process) may fall
  256 MB behind the engines' output, or 64 MB for a minute, before Redis disconnects it (its listener
  then notices the loss and fails its requests); the stock limit (32mb 8mb 60) is too tight at full
  token rate with many clients.
- No persistence (``save ""``, ``appendonly no``); 127.0.0.1 only, ``protected-mode yes``; with a unix
  socket the TCP port is 0 and the socket is 0700.
- Replication (``redserve serve --redis-replicas N``): every data node may become a replica (it is one when
  `ServerConfig.replica_of` is set) and authenticates to its primary as `ADMIN_USER`; full syncs go over the
  socket at once (``repl-diskless-sync`` with no delay), since there is no disk copy to send anyway.
- Cluster nodes (``redserve serve --redis-cluster N``, `ServerConfig.cluster_port` set): ``cluster-enabled yes``
  with the bus on `cluster_port` and the nodes file at `cluster_config_file` (kept by the launcher across a
  restart, so a node comes back with its id and slots); a node is failing after ``cluster-node-timeout``
  (`CLUSTER_NODE_TIMEOUT_MS`); with a slot uncovered the cluster refuses commands, sharded pub/sub included.
  A replica (``--redis-cluster N --redis-replicas R``, made one by CLUSTER REPLICATE, never by ``replicaof``)
  takes over a failed primary however long its link was down (``cluster-replica-validity-factor 0``): its
  data, however old, beats the empty primary a restart would bring back.
  `APP_USER` may read the topology (CLUSTER SLOTS / SHARDS / NODES / INFO / KEYSLOT / MYID) but changes none.
- Sentinels (`render_sentinel`): same ACL users and passwords as the data nodes, but `APP_USER` may only ask
  where the primary and replicas are (`SENTINEL_APP_RULES`: no SENTINEL FAILOVER/SET/REMOVE/RESET/CONFIG);
  sentinels talk to each other and to the data nodes as `ADMIN_USER`. A primary is down after
  ``down-after-milliseconds`` (`SentinelConfig.down_after_ms`, 1000) without an answer, with a quorum of 2
  of the 3 sentinels; one replica resyncs at a time after a failover (``parallel-syncs 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

APP_USER = "redserve"
ADMIN_USER = "admin"
DEFAULT_MAXMEMORY = "1gb"
PUBSUB_OUTPUT_BUFFER_LIMIT = "256mb 64mb 60"
CLUSTER_NODE_TIMEOUT_MS = 2000

APP_USER_RULES = "~* &* +@all -@dangerous +info -script|kill -script|flush -function -acl"
"""The application user's command and key rules (ACL SETUSER syntax, after its password)."""
SENTINEL_APP_RULES = ("-@all +ping +auth +hello +client|setname +sentinel|get-master-addr-by-name +sentinel|masters "
                      "+sentinel|master +sentinel|sentinels +sentinel|replicas +sentinel|slaves")
"""What `APP_USER` may run on a sentinel: discovery only (what redis-py's and kombu's Sentinel clients send)."""
MASTER_NAME = "redserve"
"""The name the embedded sentinels monitor the primary under (the MASTER of a ``redis+sentinel://`` URL)."""


@dataclass(frozen=True)
class ServerConfig:
    """What `render` writes; `port` 0 with `unix_socket` set listens only on that socket."""

    port: int
    directory: str
    logfile: str
    app_password: str
    admin_password: str
    unix_socket: str | None = None
    maxmemory: str = DEFAULT_MAXMEMORY
    maxmemory_policy: str = "noeviction"  # allkeys-lru for the KV tier's store (a cache, never the control Redis)
    proc_title: str | None = "redserve-redis {listen-addr}"
    replica_of: tuple[str, int] | None = None
    cluster_port: int | None = None
    cluster_config_file: str | None = None

    def __post_init__(self) -> None:
        if (self.cluster_port is None) != (self.cluster_config_file is None):
            raise ValueError("a cluster node needs both its bus port and its nodes file")
        for password in (self.app_password, self.admin_password):
            if not password or any(c.isspace() or c in "\"'\\" for c in password):
                raise ValueError("Redis passwords must be non-empty, without spaces, quotes or backslashes")


def render(config: ServerConfig) -> str:
    """The text of the server's config file."""
    lines = [
        f"port {config.port}",
        "bind 127.0.0.1",
        "protected-mode yes",
        "daemonize no",
        'save ""',
        "appendonly no",
        f'dir "{config.directory}"',
        f'logfile "{config.logfile}"',
        f"maxmemory {config.maxmemory}",
        f"maxmemory-policy {config.maxmemory_policy}",
        f"client-output-buffer-limit pubsub {PUBSUB_OUTPUT_BUFFER_LIMIT}",
        "user default off resetpass resetkeys resetchannels -@all",
        f"user {APP_USER} on >{config.app_password} {APP_USER_RULES}",
        f"user {ADMIN_USER} on >{config.admin_password} ~* &* +@all",
    ]
    if config.unix_socket:
        lines += [f'unixsocket "{config.unix_socket}"', "unixsocketperm 700"]
    if config.proc_title:
        lines.append(f'proc-title-template "{config.proc_title}"')
    lines += [f"masteruser {ADMIN_USER}", f"masterauth {config.admin_password}", "repl-diskless-sync yes",
              "repl-diskless-sync-delay 0"]
    if config.replica_of is not None:
        lines.append(f"replicaof {config.replica_of[0]} {config.replica_of[1]}")
    if config.cluster_port is not None:
        lines += ["cluster-enabled yes", f"cluster-port {config.cluster_port}",
                  f'cluster-config-file "{config.cluster_config_file}"', f"cluster-node-timeout {CLUSTER_NODE_TIMEOUT_MS}",
                  "cluster-require-full-coverage yes", "cluster-allow-pubsubshard-when-down no",
                  "cluster-replica-validity-factor 0"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SentinelConfig:
    """What `render_sentinel` writes: a sentinel on `port` watching the primary at `primary`."""

    port: int
    directory: str
    logfile: str
    app_password: str
    admin_password: str
    primary: tuple[str, int]
    master_name: str = MASTER_NAME
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 10_000
    proc_title: str | None = "redserve-sentinel {listen-addr}"

    def __post_init__(self) -> None:
        ServerConfig(self.port, self.directory, self.logfile, self.app_password, self.admin_password)  # passwords
        if self.down_after_ms < 100 or self.failover_timeout_ms < self.down_after_ms:
            raise ValueError("down_after_ms must be >= 100 and failover_timeout_ms >= down_after_ms")


def render_sentinel(config: SentinelConfig) -> str:
    """The text of a sentinel's config file (the sentinel rewrites it with what it learns)."""
    name = config.master_name
    lines = [
        f"port {config.port}",
        "bind 127.0.0.1",
        "protected-mode yes",
        "daemonize no",
        f'dir "{config.directory}"',
        f'logfile "{config.logfile}"',
        "sentinel resolve-hostnames no",
        "user default off resetpass resetkeys resetchannels -@all",
        f"user {APP_USER} on >{config.app_password} {SENTINEL_APP_RULES}",
        f"user {ADMIN_USER} on >{config.admin_password} ~* &* +@all",
        f"sentinel sentinel-user {ADMIN_USER}",
        f"sentinel sentinel-pass {config.admin_password}",
        f"sentinel monitor {name} {config.primary[0]} {config.primary[1]} {config.quorum}",
        f"sentinel auth-user {name} {ADMIN_USER}",
        f"sentinel auth-pass {name} {config.admin_password}",
        f"sentinel down-after-milliseconds {name} {config.down_after_ms}",
        f"sentinel failover-timeout {name} {config.failover_timeout_ms}",
        f"sentinel parallel-syncs {name} 1",
    ]
    if config.proc_title:
        lines.append(f'proc-title-template "{config.proc_title}"')
    return "\n".join(lines) + "\n"
