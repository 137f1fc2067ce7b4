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
"""

from __future__ import annotations

import logging
import re
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from broker.errors import BrokerUnavailable

logger = logging.getLogger(__name__)

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, socket.timeout)


def connect(
    url: str,
    *,
    socket_timeout: float = 5.0,
    connect_timeout: float = 2.0,
    retries: int = 5,
    backoff_cap: float = 1.0,
    health_check_interval: int = 15,
    client_name: str | None = None,
) -> redis.Redis:
    """A client for `url` (redis://, rediss:// or unix://) with the module's retry policy.

    `retries=0` gives a client that raises on the first connection error (used for the pub/sub
    listener, which must notice every disconnect to know that messages may have been lost).
    """
    logger.debug("Redis client for %s (client name %s)", mask_url(url), client_name)
    retry = Retry(ExponentialBackoff(cap=backoff_cap, base=0.05), retries, supported_errors=_RETRYABLE)
    tcp_only = {} if url.startswith("unix:") else {"socket_keepalive": True}
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=retry,
        retry_on_error=[redis.BusyLoadingError],
        health_check_interval=health_check_interval,
        client_name=client_name,
        protocol=2,
        decode_responses=False,
        **tcp_only,
    )


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
