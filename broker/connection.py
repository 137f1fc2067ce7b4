"""Redis connections with the timeouts and retry policy every redserve process uses.

Rules:
- RESP2 (`protocol=2`) and bytes responses (`decode_responses=False`): payloads are msgpack bytes,
  and the reply shapes stay the same on every Redis version we support (>= 6.2).
- A command that fails with a connection error or timeout is retried with exponential backoff
  (base 50 ms, capped at `backoff_cap`) `retries` times, reconnecting each time, then raises
  `redis.ConnectionError` / `redis.TimeoutError`. With the defaults that is about 2.5 s of trying:
  long enough to ride out a Redis restart, short enough for an API request to fail fast (503).
- A retried write can be applied twice if the connection broke after Redis ran it but before the
  reply arrived. Receivers tolerate that: engines ignore a duplicate request id, clients drop
  EngineOutputs whose `seq` they have already seen.
- `socket_timeout` must exceed the longest blocking command (XREADGROUP BLOCK) a caller issues.
- URLs reach logs and error messages only through `mask_url`. `wait_for_redis` fails at once on an
  authentication error; TLS settings come from the URL (``rediss://...?ssl_ca_certs=PATH&ssl_cert_reqs=required``).
- One `redis.Redis` per process is enough and is thread-safe (it holds a connection pool);
  redis-py resets the pool in a forked child, but create clients after fork anyway.
- Sentinel mode: ``redis+sentinel://[USER:PASS@]HOST1:PORT1[,HOST2:PORT2...]/MASTER[/DB]`` names the
  sentinels and the master's name; `connect` returns redis-py's `Sentinel.master_for` client, which asks
  the sentinels for the primary on every (re)connect and drops a connection to a primary that was demoted.
  The URL's user and password authenticate to the data nodes and, unless ``?sentinel_username=U&
  sentinel_password=P`` say otherwise (``sentinel_password=`` empty: sentinels without auth), to the
  sentinels too. By default a command is retried for `FAILOVER_WINDOW` seconds (not a number of times):
  long enough for the sentinels to notice a dead primary and promote a replica, so callers see a pause,
  not an error. An explicit `retries` (0 for the pub/sub listener) keeps its meaning in both modes.
- Cluster mode: ``redis+cluster://[USER:PASS@]HOST1:PORT1[,HOST2:PORT2...][/]`` names some nodes of a Redis
  Cluster (any node will do: the client reads the slot map from the first that answers); `connect` returns
  redis-py's `RedisCluster`, which sends each command to the primary owning its key's slot and follows MOVED /
  ASK redirections. There is one database (0). Every key redserve forms is hash-tagged (`broker.keys`), so its
  transactions and scripts touch one slot; channels are sharded (`broker.channels`). TLS:
  ``rediss+cluster://...[?ssl_ca_certs=PATH&ssl_cert_reqs=required...]``, the options of ``rediss://``, for
  every node (the addresses the cluster announces are reached over TLS).
  List replicas too: a startup node that died is skipped. By default a command is retried (slot map refreshed
  between tries) for about `FAILOVER_WINDOW` seconds (`CLUSTER_FAILOVER_RETRIES` tries), as behind sentinels:
  the cluster fails a dead primary over to its replica in ~3 s (``cluster-node-timeout`` 2 s + the election),
  and a cluster without replicas is down (CLUSTERDOWN) until the node is back.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from broker.errors import BrokerUnavailable

logger = logging.getLogger(__name__)

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, socket.timeout)
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
CLUSTER_TLS_SCHEME = "rediss+cluster"
DEFAULT_RETRIES = 5
FAILOVER_WINDOW = 20.0
"""Seconds a sentinel-mode client keeps retrying a command: a failover of the embedded setup takes ~2-3 s
(``down-after-milliseconds`` 1000), an existing deployment's ``down-after-milliseconds`` adds to it."""
_FAILOVER_BACKOFF_CAP = 0.2
CLUSTER_FAILOVER_RETRIES = int(FAILOVER_WINDOW / _FAILOVER_BACKOFF_CAP)
"""Retries of a cluster-mode command: redis-py's cluster client counts them (no time bound), each after a backoff
of at most `_FAILOVER_BACKOFF_CAP` s, so about `FAILOVER_WINDOW` seconds of trying (plus the attempts' own time)."""
_SENTINEL_QUERY_TIMEOUT = 0.5


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL (see the module rules)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a ``redis+sentinel://`` URL; ValueError saying what is wrong with a bad one."""
    parts, username, password, sentinels = _split_multi_host_url(url, SENTINEL_SCHEME, "sentinel")
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2:
        raise ValueError(f"a sentinel URL is {SENTINEL_SCHEME}://[USER:PASS@]HOST:PORT[,HOST:PORT...]/MASTER[/DB], "
                         f"got {mask_url(url)}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = set(query) - {"sentinel_username", "sentinel_password"}
    if unknown:
        raise ValueError(f"unsupported option(s) {', '.join(sorted(unknown))} in {mask_url(url)}")
    username, password = unquote(username) or None, unquote(password) or None
    if "sentinel_password" in query:
        s_user, s_pass = query.get("sentinel_username") or None, query["sentinel_password"] or None
    else:
        s_user, s_pass = query.get("sentinel_username") or username, password
    db = path[1] if len(path) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"the database in {mask_url(url)} must be a number, got {db!r}")
    return SentinelUrl(sentinels, unquote(path[0]), int(db), username, password, s_user, s_pass)


def _split_multi_host_url(url: str, scheme: str, kind: str):
    """(the split URL, the raw username and password, the (host, port) list) of a ``SCHEME://[USER:PASS@]H:P,...``
    URL; a lone userinfo is the password, as redis-py reads ``redis://SECRET@host``."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ValueError(f"not a {scheme}:// URL: {mask_url(url)}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if ":" in userinfo else ("", "", userinfo)
    return parts, username, password, tuple(_host_port(h, kind) for h in hosts.split(",") if h)


def _host_port(text: str, kind: str = "sentinel") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"a {kind} address must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ClusterUrl:
    """A parsed ``redis+cluster://`` or ``rediss+cluster://`` URL (see the module rules)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: tuple[tuple[str, str], ...] | None = None  # rediss+cluster: its ssl_* options as the URL spells them

    def node_url(self, host: str, port: int) -> str:
        """The single-server URL of one node (``redis://`` or, with TLS, ``rediss://`` with the same options)."""
        auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@" if self.password is not None else ""
        if self.tls is None:
            return f"redis://{auth}{host}:{port}/0"
        return f"rediss://{auth}{host}:{port}/0" + (f"?{urlencode(self.tls)}" if self.tls else "")

    def client_kwargs(self) -> dict:
        """redis-py's TLS arguments of this URL ({} without TLS)."""
        if self.tls is None:
            return {}
        options: dict = {"ssl": True, **dict(self.tls)}
        if "ssl_check_hostname" in options:
            options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() not in ("false", "0", "no")
        return options


_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def is_cluster_url(url: str) -> bool:
    return url.startswith((f"{CLUSTER_SCHEME}://", f"{CLUSTER_TLS_SCHEME}://"))


def parse_cluster_url(url: str) -> ClusterUrl:
    """The parts of a ``redis+cluster://`` (``rediss+cluster://``: TLS) URL; ValueError saying what is wrong."""
    tls = url.startswith(f"{CLUSTER_TLS_SCHEME}://")
    scheme = CLUSTER_TLS_SCHEME if tls else CLUSTER_SCHEME
    parts, username, password, nodes = _split_multi_host_url(url, scheme, "cluster node")
    query = parse_qsl(parts.query, keep_blank_values=True)
    unknown = sorted({key for key, _ in query} - set(_TLS_OPTIONS if tls else ()))
    if not nodes or parts.path.strip("/") not in ("", "0") or unknown:
        raise ValueError(f"a cluster URL is {CLUSTER_SCHEME}://[USER:PASS@]HOST:PORT[,HOST:PORT...]/ (one database, "
                         f"no options) or {CLUSTER_TLS_SCHEME}://...[?ssl_ca_certs=PATH&ssl_cert_reqs=required...] "
                         f"(TLS; options {', '.join(_TLS_OPTIONS)}), got {mask_url(url)}")
    cert_reqs = dict(query).get("ssl_cert_reqs", "required")
    if tls and cert_reqs not in ("none", "optional", "required"):
        raise ValueError(f"ssl_cert_reqs={cert_reqs!r} in {mask_url(url)}: use none, optional or required")
    return ClusterUrl(nodes, unquote(username) or None, unquote(password) or None, tuple(query) if tls else None)


def cluster_url(nodes: list[tuple[str, int]], username: str | None = None, password: str | None = None,
                tls: dict[str, str] | None = None) -> str:
    """The ``redis+cluster://`` URL of these nodes, ``rediss+cluster://`` with `tls` (the ssl_* options; {} for
    none): the inverse of `parse_cluster_url`."""
    auth = ""
    if password is not None:
        auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    scheme = CLUSTER_SCHEME if tls is None else CLUSTER_TLS_SCHEME
    query = f"?{urlencode(tls)}" if tls else ""
    return f"{scheme}://{auth}{','.join(f'{h}:{p}' for h, p in nodes)}/{query}"


def sentinel_url(sentinels: list[tuple[str, int]], master: str, username: str | None = None,
                 password: str | None = None, db: int = 0) -> str:
    """The ``redis+sentinel://`` URL of these sentinels' `master` (the inverse of `parse_sentinel_url`)."""
    auth = ""
    if password is not None:
        auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    hosts = ",".join(f"{h}:{p}" for h, p in sentinels)
    return f"{SENTINEL_SCHEME}://{auth}{hosts}/{quote(master, safe='')}/{db}"


class FailoverRetry(Retry):
    """redis-py's Retry bounded by time, not by count: each call retries for up to `window` seconds."""

    def __init__(self, window: float, backoff_cap: float = _FAILOVER_BACKOFF_CAP) -> None:
        super().__init__(ExponentialBackoff(cap=backoff_cap, base=0.05), -1, supported_errors=_RETRYABLE)
        self.window = window

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # noqa: ANN001, ANN201
        deadline = time.monotonic() + self.window

        def in_window(error: Exception) -> bool:
            return time.monotonic() < deadline and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, in_window, with_failure_count)


class _FailoverConnection(SentinelManagedConnection):
    """redis-py's sentinel-managed connection, which also asks the sentinels again when a retried command
    reconnects: redis-py's own reconnects such a connection to the address it had, the dead primary."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock:
            return
        if retry_socket_connect:  # a command reconnecting (not `connect_to`, which passes False)
            self.connect()
            return
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


def connect(
    url: str,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 2.0,
    retries: int | None = None,
    backoff_cap: float = 1.0,
    health_check_interval: int = 15,
    client_name: str | None = None,
) -> redis.Redis:
    """A client for `url` (redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://) with the module's
    retry policy.

    `retries=0` gives a client that raises on the first connection error (used for the pub/sub
    listener, which must notice every disconnect to know that messages may have been lost).
    `retries=None`: `DEFAULT_RETRIES`, or in sentinel mode retries for `FAILOVER_WINDOW` seconds, in cluster mode
    `CLUSTER_FAILOVER_RETRIES` times (about as long).
    """
    logger.debug("Redis client for %s (client name %s)", mask_url(url), client_name)
    sentinel_mode = is_sentinel_url(url)
    if retries is None and sentinel_mode:
        retry: Retry = FailoverRetry(FAILOVER_WINDOW)
    elif retries is None and is_cluster_url(url):
        retry = Retry(ExponentialBackoff(cap=_FAILOVER_BACKOFF_CAP, base=0.05), CLUSTER_FAILOVER_RETRIES,
                      supported_errors=_RETRYABLE)
    else:
        retries = DEFAULT_RETRIES if retries is None else retries
        retry = Retry(ExponentialBackoff(cap=backoff_cap, base=0.05), retries, supported_errors=_RETRYABLE)
    tcp_only = {} if url.startswith("unix:") else {"socket_keepalive": True}
    kwargs = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout, retry=retry,
                  retry_on_error=[redis.BusyLoadingError], health_check_interval=health_check_interval,
                  client_name=client_name, protocol=2, decode_responses=False, **tcp_only)
    if sentinel_mode:
        return _sentinel_client(parse_sentinel_url(url), connect_timeout, kwargs)
    if is_cluster_url(url):
        return _cluster_client(parse_cluster_url(url), kwargs)
    return redis.Redis.from_url(url, **kwargs)


def _cluster_client(c: ClusterUrl, kwargs: dict) -> RedisCluster:
    """A `RedisCluster` with the module's retry policy at the cluster level: redis-py retries a failed command
    there (refreshing its slot map between tries, so a moved slot or a replaced node is found); the connections
    to the nodes do not retry on their own."""
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in c.nodes], username=c.username,
                        password=c.password, require_full_coverage=True, **c.client_kwargs(), **kwargs)


def _sentinel_client(s: SentinelUrl, connect_timeout: float, kwargs: dict) -> redis.Redis:
    timeout = min(connect_timeout, _SENTINEL_QUERY_TIMEOUT)  # a dead sentinel must not stall discovery
    sentinel_kwargs = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "protocol": 2,
                       "username": s.sentinel_username, "password": s.sentinel_password}
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(s.master, db=s.db, username=s.username, password=s.password,
                               connection_class=_FailoverConnection, **kwargs)


def redis_address(url: str) -> tuple[str, int]:
    """(host, port) a process reaches Redis at first: the URL's server, or a sentinel URL's first sentinel
    (to pick the local interface towards Redis)."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).sentinels[0]
    if is_cluster_url(url):
        return parse_cluster_url(url).nodes[0]
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 6379


def replication_topology(client: redis.Redis) -> dict | None:
    """For a client from a sentinel URL: {"master_name", "primary": "HOST:PORT", "replicas": [...]} as the
    sentinels see them now (healthy replicas only); None for a client of one server."""
    pool = getattr(client, "connection_pool", None)  # a RedisCluster has one pool per node
    manager = getattr(pool, "sentinel_manager", None)
    if manager is None:
        return None
    host, port = manager.discover_master(pool.service_name)
    replicas = [f"{h}:{p}" for h, p in manager.discover_slaves(pool.service_name)]
    return {"master_name": pool.service_name, "primary": f"{host}:{port}", "replicas": replicas}


def cluster_node_for_key(url: str, key: str) -> tuple[str, int]:
    """(host, port) of the primary that owns `key`'s slot now, as the nodes of the cluster URL `url` say (the first
    that answers); redis.RedisError when none does."""
    client = connect(url, retries=0)
    try:
        node = client.get_node_from_key(key)
    finally:
        client.close()
    return node.host, node.port


def cluster_topology(client: redis.Redis | RedisCluster) -> list[str] | None:
    """For a cluster client: its primaries as "HOST:PORT", sorted, as its slot map has them; None otherwise."""
    if not isinstance(client, RedisCluster):
        return None
    return sorted(f"{node.host}:{node.port}" for node in client.get_primaries())


def cluster_replicas(client: redis.Redis | RedisCluster) -> dict[str, list[str]] | None:
    """For a cluster client: each primary ("HOST:PORT") -> its replicas that are not failed, sorted, as its slot
    map (CLUSTER SLOTS) has them; None otherwise."""
    if not isinstance(client, RedisCluster):
        return None
    out: dict[str, set[str]] = {}
    for nodes in client.nodes_manager.slots_cache.values():
        if nodes:
            out.setdefault(nodes[0].name, set()).update(node.name for node in nodes[1:])
    return {primary: sorted(replicas) for primary, replicas in sorted(out.items())}


def primary_url(url: str) -> str:
    """`url` itself, or for a sentinel URL the redis:// URL of the primary the sentinels name now (for tools
    such as redis-cli that speak to one server); raises redis.ConnectionError when no sentinel answers.
    For a cluster URL, the redis:// URL of its first node (redis-cli then needs ``-c`` to follow redirects)."""
    if is_cluster_url(url):
        c = parse_cluster_url(url)
        return c.node_url(*c.nodes[0])
    if not is_sentinel_url(url):
        return url
    s = parse_sentinel_url(url)
    client = connect(url, retries=0)
    try:
        host, port = client.connection_pool.get_master_address()
    finally:
        client.close()
    auth = f"{quote(s.username or '', safe='')}:{quote(s.password, safe='')}@" if s.password is not None else ""
    return f"redis://{auth}{host}:{port}/{s.db}"


def wait_for_redis(url: str, timeout: float = 10.0) -> None:
    """Return once Redis at `url` answers PING; raise BrokerUnavailable after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    client = connect(url, socket_timeout=1.0, connect_timeout=1.0, retries=0)
    last_error: Exception | None = None
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.AuthenticationError as e:  # a wrong password does not get better by waiting
                raise BrokerUnavailable(f"Redis at {mask_url(url)} refused the credentials: {e}") from e
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as e:
                last_error = e
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"Redis at {mask_url(url)} did not answer within {timeout}s: {last_error}")
            time.sleep(0.05)
    finally:
        client.close()


def mask_url(url: str) -> str:
    """`url` with its password (and any query secrets such as ``password=``) replaced by ``***``: the only
    form of a Redis URL that may reach a log line, a status report or stdout."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"***@{host}" if not user else f"{user}@{host}"
        if ":" not in userinfo:  # redis://SECRET@host: a lone userinfo is the password in redis-py
            netloc = f"***@{host}"
    query = re.sub(r"(?i)(password|passwd|pass)=[^&]*", r"\1=***", parts.query)
    if not netloc:  # unix:///path: urlunsplit would drop the empty authority
        return f"{parts.scheme}://{parts.path}" + (f"?{query}" if query else "")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
