"""Celery's broker and result-backend settings for a redserve Redis URL.

Rules:
- Every redserve process takes a redis-py URL (``redis://``, ``rediss://``, ``unix://``); Celery (kombu for
  the broker, its own Redis backend for results) spells two of them differently, so
  `celery_redis_settings` translates, credentials and database kept:
  - ``redis://[USER:PASS@]HOST:PORT/DB``: unchanged.
  - ``unix://[USER:PASS@]/PATH?db=N`` -> ``redis+socket://[USER:PASS@]/PATH?virtual_host=N``.
  - ``rediss://...?ssl_ca_certs=..&ssl_certfile=..&ssl_keyfile=..&ssl_cert_reqs=..&ssl_check_hostname=..``:
    the URL without its query, the ``ssl_*`` options in ``broker_use_ssl`` and ``redis_backend_use_ssl``.
    ``ssl_cert_reqs`` defaults to ``required``, as in redis-py (kombu alone would not verify at all).
- ``db`` and ``password`` query options move into the URL; any other option is a ValueError naming it,
  never silently dropped.
  - ``redis+sentinel://[USER:PASS@]H1:P1,H2:P2/MASTER/DB`` -> Celery's sentinel transport and result
    backend: ``sentinel://[USER:PASS@]H1:P1/DB;sentinel://[USER:PASS@]H2:P2/DB``, and
    `celery_transport_options` gives the ``master_name`` and the sentinels' credentials (``sentinel_kwargs``),
    to merge into ``broker_transport_options`` and ``result_backend_transport_options``.
  - ``redis+cluster://...`` (``rediss+cluster://...``: with TLS, translated as ``rediss://``): Celery has no Redis
    Cluster transport. Every Celery key starts with
    ``RedisKeys.celery()``, which carries the control hash tag (``{rs}:celery:``), so all of them live in one
    slot, `route_key`'s: the broker is `api.batch.celery_cluster.ClusterTransport` and the result backend
    `ClusterResultBackend`, whose connections go to the primary owning that slot now, looked up again on every
    connect (a failover or a resharding of the slot is followed, see that module).
    `celery_transport_options(url, route_key)` gives the options they need (``cluster_url``,
    ``cluster_route_key``). Without `route_key` a cluster URL is only checked ({} returned).
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from broker.connection import (
    is_cluster_url,
    is_sentinel_url,
    parse_cluster_url,
    parse_sentinel_url,
)

_CLUSTER_MODULE = "api.batch.celery_cluster"
# Celery settings for any URL: a lost connection (a Redis restart, a failover, a moved cluster slot) is retried for
# about 20 s when a task is sent (Celery's default policy gives up after ~0.6 s) and by the result backend (which
# by default does not retry at all).
RETRY_SETTINGS: dict[str, Any] = {
    "task_publish_retry_policy": {"max_retries": 40, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5},
    "result_backend_always_retry": True, "result_backend_max_retries": 40,
}
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_SSL_PATHS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def celery_redis_settings(url: str, route_key: str | None = None) -> dict[str, Any]:
    """``broker_url``, ``result_backend``, ``broker_use_ssl`` and ``redis_backend_use_ssl`` for `url` (for a
    cluster URL with `route_key`: also ``broker_transport``, the slot-following transport and backend, see the
    module rules)."""
    if is_cluster_url(url):
        c = parse_cluster_url(url)
        if route_key is None:
            return {}
        # the first node's URL for the credentials and TLS options only: the connections look the address up
        node = celery_redis_settings(c.node_url(*c.nodes[0]))
        return {**node, "broker_transport": f"{_CLUSTER_MODULE}:ClusterTransport",
                "result_backend": f"{_CLUSTER_MODULE}:ClusterResultBackend+{node['result_backend']}"}
    if is_sentinel_url(url):
        s = parse_sentinel_url(url)
        auth = "" if s.password is None else f"{quote(s.username or '', safe='')}:{quote(s.password, safe='')}@"
        celery_url = ";".join(f"sentinel://{auth}{host}:{port}/{s.db}" for host, port in s.sentinels)
        return {"broker_url": celery_url, "result_backend": celery_url,
                "broker_use_ssl": None, "redis_backend_use_ssl": None}
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"unsupported Redis URL scheme {parts.scheme!r}: use redis://, rediss:// or unix://")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    netloc = _with_query_password(parts.netloc, query.pop("password", None))
    path_db = "" if parts.scheme == "unix" else parts.path.strip("/")
    db = query.pop("db", None) or path_db or "0"
    tls = _ssl_options(query) if parts.scheme == "rediss" else None
    if query:
        raise ValueError(f"Redis URL option(s) {', '.join(sorted(query))} cannot be passed to Celery")
    if parts.scheme == "unix":
        celery_url = f"redis+socket://{netloc}{parts.path}?virtual_host={db}"
    else:
        celery_url = urlunsplit((parts.scheme, netloc, f"/{db}", "", ""))
    return {"broker_url": celery_url, "result_backend": celery_url,
            "broker_use_ssl": tls, "redis_backend_use_ssl": tls}


def celery_transport_options(url: str, route_key: str | None = None) -> dict[str, Any]:
    """The transport options a sentinel URL, or a cluster URL with the Celery keys' `route_key`, needs (both broker
    and result backend); {} for any other URL."""
    if is_cluster_url(url) and route_key is not None:
        return {"cluster_url": url, "cluster_route_key": route_key}
    if not is_sentinel_url(url):
        return {}
    s = parse_sentinel_url(url)
    credentials = {"username": s.sentinel_username, "password": s.sentinel_password}
    return {"master_name": s.master, "sentinel_kwargs": {k: v for k, v in credentials.items() if v is not None}}


def _with_query_password(netloc: str, password: str | None) -> str:
    if password is None:
        return netloc
    userinfo, _, host = netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    return f"{user}:{quote(password, safe='')}@{host}"


def _ssl_options(query: dict[str, str]) -> dict[str, Any]:
    reqs = query.pop("ssl_cert_reqs", "required").lower().removeprefix("cert_")
    if reqs not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs={reqs!r}: use none, optional or required")
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[reqs]}
    options.update({key: query.pop(key) for key in _SSL_PATHS if key in query})
    if "ssl_check_hostname" in query:
        options["ssl_check_hostname"] = query.pop("ssl_check_hostname").lower() not in ("false", "0", "no")
    return options
