"""External Redis over TLS (rediss://, and a cluster's rediss+cluster://) and a unix socket, for every kind of
redserve process.

The embedded server has no TLS, so a TLS-terminating proxy (asyncio, in a thread) listens on 127.0.0.1 with
a server certificate from a CA made by `openssl` in the test, and forwards the bytes to the session's
embedded Redis. The URLs carry the CA as redis-py spells it: ``?ssl_ca_certs=PATH&ssl_cert_reqs=required``.
The cluster has a proxy in front of each node, and each node announces its proxy's port (CLUSTER SLOTS), as a
managed cluster with in-transit encryption does: a client following the slot map only ever speaks TLS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import redis
from broker_fakes import FakeEngine, add, collect
from celery import Celery
from stack_procs import Procs, cli, wait_for

from api.batch.celery_redis import celery_redis_settings, celery_transport_options
from broker.client import BrokerClient
from broker.connection import cluster_url, connect, mask_url, parse_cluster_url, wait_for_redis
from broker.engine_link import EngineRegistry
from broker.errors import BrokerUnavailable
from broker.keys import RedisKeys
from redserve.redis_cluster import ClusterRedis
from redserve.redis_server import EmbeddedRedis


def _password(url: str) -> str:
    return redis.connection.parse_url(url)["password"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> Path:
    """A self-signed CA (name.pem, name.key) in `directory`; the certificate's path."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)
    return directory / f"{name}.pem"


def make_server_cert(directory: Path, ca: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost signed by the CA `ca`; (cert, key)."""
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                                          "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=directory)
    return directory / "server.pem", directory / "server.key"


class TlsProxy:
    """Accepts TLS on 127.0.0.1:`port` and forwards the plain bytes to 127.0.0.1:`target_port`."""

    def __init__(self, target_port: int, certfile: Path, keyfile: Path) -> None:
        self.target_port = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certfile, keyfile)
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, ctx: None)  # failed handshakes are expected (wrong CA)
        self.thread = threading.Thread(target=self.loop.run_forever, name="tls-proxy", daemon=True)
        self.server: asyncio.Server | None = None
        self.port = 0

    def start(self) -> TlsProxy:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError, ssl.SSLError):
            writer.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory, redis_server):
    """(proxy, CA path, wrong CA path): a TLS endpoint in front of the session's embedded Redis."""
    directory = tmp_path_factory.mktemp("tls")
    ca = make_ca(directory, "ca")
    wrong_ca = make_ca(directory, "other-ca")
    proxy = TlsProxy(redis_server.port, *make_server_cert(directory, "ca")).start()
    try:
        yield proxy, ca, wrong_ca
    finally:
        proxy.stop()


def rediss_url(redis_server: EmbeddedRedis, proxy: TlsProxy, db: int, ca: Path) -> str:
    plain = redis_server.url_for_db(db)
    credentials = plain.split("//", 1)[1].split("@", 1)[0]
    return f"rediss://{credentials}@127.0.0.1:{proxy.port}/{db}?ssl_ca_certs={ca}&ssl_cert_reqs=required"


@pytest.fixture
def tls_url(tls, redis_server, redis_db):
    proxy, ca, _ = tls
    return rediss_url(redis_server, proxy, redis_db, ca)


def test_connect_registry_and_broker_client_over_tls(tls_url, redis_keys):
    wait_for_redis(tls_url, timeout=5)
    r = connect(tls_url)
    assert r.connection_pool.connection_class.__name__ == "SSLConnection" and r.ping()
    registry = EngineRegistry(r, redis_keys)
    engine = FakeEngine(tls_url, redis_keys, "e0").start()
    client = BrokerClient(tls_url, redis_keys, heartbeat_ttl=2.0, engine_refresh=0.05, subscribe_timeout=5.0)
    try:
        assert [e["engine_id"] for e in registry.ready_engines()] == ["e0"]
        assert client.wait_subscribed(10)
        outs = collect(client.submit(add(first_token=3, max_tokens=3)), timeout=10)
        assert [t for o in outs for t in o.new_token_ids] == [3001, 3002, 3003]  # streams + pub/sub over TLS
    finally:
        client.stop()
        engine.stop()
        r.close()


def test_a_wrong_ca_fails_with_a_clear_error(tls, redis_server, redis_db):
    proxy, _, wrong_ca = tls
    url = rediss_url(redis_server, proxy, redis_db, wrong_ca)
    with pytest.raises(BrokerUnavailable, match="certificate verify failed") as failure:
        wait_for_redis(url, timeout=0.5)
    assert _password(url) not in str(failure.value)
    assert mask_url(url).split("?")[0] in str(failure.value)


def test_status_over_tls(tls_url, redis_keys):
    registry = EngineRegistry(connect(tls_url), redis_keys)
    registry.register("e7", {"model": "m"})
    out = subprocess.run([*cli("status", "--redis-url", tls_url, "--key-prefix", redis_keys.prefix, "--json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    status = json.loads(out.stdout)
    assert [e["engine_id"] for e in status["engines"]] == ["e7"]
    assert _password(tls_url) not in out.stdout + out.stderr


def test_celery_translation_of_tls_and_unix_urls():
    settings = celery_redis_settings("rediss://u:p@h:1/2?ssl_ca_certs=/ca.pem")
    assert settings["broker_url"] == settings["result_backend"] == "rediss://u:p@h:1/2"
    assert settings["broker_use_ssl"] == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.pem"}
    unix = celery_redis_settings("unix://u:p@/run/r.sock?db=3")
    assert unix["broker_url"] == "redis+socket://u:p@/run/r.sock?virtual_host=3" and unix["broker_use_ssl"] is None
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        celery_redis_settings("rediss://h:1/0?ssl_cert_reqs=maybe")


def _probe(url: str, keys: RedisKeys) -> Celery:
    """A Celery app that talks to the batch workers of `keys` through `url` (remote control only)."""
    app = Celery(f"probe-{uuid.uuid4().hex[:6]}", set_as_current=False)
    options = {"global_keyprefix": keys.celery(), **celery_transport_options(url, route_key=keys.celery())}
    app.conf.update(**celery_redis_settings(url, route_key=keys.celery()), broker_transport_options=options,
                    result_backend_transport_options=options)
    return app


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """The rediss+cluster:// URL of a 3-primary embedded cluster reachable only over TLS (see the module doc)."""
    directory = tmp_path_factory.mktemp("tls-cluster")
    ca = make_ca(directory, "ca")
    cert = make_server_cert(directory, "ca")
    cluster, proxies = ClusterRedis(3).start(), []
    try:
        for node in cluster.nodes.values():
            proxies.append(TlsProxy(node.port, *cert).start())
            with redis.Redis(*node.address, username="admin", password=cluster.passwords["admin"]) as admin:
                admin.config_set("cluster-announce-bus-port", node.cluster_port)
                admin.config_set("cluster-announce-port", proxies[-1].port)
        announced = {p.port for p in proxies}

        def slots_announce_proxies() -> bool:
            for node in cluster.nodes.values():
                with redis.Redis(*node.address, username="admin", password=cluster.passwords["admin"]) as admin:
                    if {e[2][1] for e in admin.execute_command("CLUSTER", "SLOTS")} - announced:
                        return False
            return True

        wait_for(slots_announce_proxies, 20, "every node to announce its proxy's port")
        yield cluster_url([("127.0.0.1", p.port) for p in proxies], "redserve", cluster.passwords["redserve"],
                          tls={"ssl_ca_certs": str(ca), "ssl_cert_reqs": "required"})
    finally:
        for proxy in proxies:
            proxy.stop()
        cluster.stop()


def test_cluster_over_tls(tls_cluster, redis_keys):
    c = parse_cluster_url(tls_cluster)
    assert tls_cluster.startswith("rediss+cluster://") and c.tls and c.node_url("h", 1).startswith("rediss://")
    with pytest.raises(ValueError, match="options"):
        parse_cluster_url(tls_cluster.replace("rediss+", "redis+"))  # ssl_* options need the TLS scheme
    r = connect(tls_cluster)
    engine = FakeEngine(tls_cluster, redis_keys, "e0").start()
    client = BrokerClient(tls_cluster, redis_keys, heartbeat_ttl=2.0, engine_refresh=0.05, subscribe_timeout=5.0)
    try:
        assert {n.port for n in r.get_primaries()} <= {p for _, p in c.nodes}  # only the proxies' ports
        assert all(n.redis_connection.connection_pool.connection_class.__name__ == "SSLConnection"
                   for n in r.get_primaries())
        assert client.wait_subscribed(10)
        outs = collect(client.submit(add(first_token=4, max_tokens=3)), timeout=10)
        assert [t for o in outs for t in o.new_token_ids] == [4001, 4002, 4003]  # streams + sharded pub/sub
        out = subprocess.run([*cli("status", "--redis-url", tls_cluster, "--key-prefix", redis_keys.prefix)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "cluster of 3 primaries" in out.stdout, out.stdout + out.stderr
        assert _password(tls_cluster.replace("rediss+cluster", "rediss").split(",")[0]) not in out.stdout
    finally:
        client.stop()
        engine.stop()
        r.close()


@pytest.mark.parametrize("transport", ["rediss", "unix", "rediss+cluster"])
def test_batch_worker_answers_a_ping(transport, request, redis_server, redis_db, redis_keys, tiny_llama_dir,
                                     tmp_path):
    """A real `redserve batch worker` (URL from the environment, as in compose) on TLS, a unix socket, or a
    cluster over TLS."""
    unix_server = EmbeddedRedis(unix_socket=True).start() if transport == "unix" else None
    if transport == "rediss+cluster":
        url = request.getfixturevalue("tls_cluster")
    elif unix_server:
        url = unix_server.url
    else:
        tls = request.getfixturevalue("tls")
        url = rediss_url(redis_server, tls[0], redis_db, tls[1])
    procs = Procs(tmp_path, env={"REDSERVE_REDIS_URL": url, "REDSERVE_KEY_PREFIX": redis_keys.prefix,
                                 "REDSERVE_STATE_DIR": str(tmp_path)})
    app = _probe(url, redis_keys)
    try:
        worker = procs.start("worker", cli("--log-level", "WARNING", "batch", "worker", "--model", tiny_llama_dir,
                                           "--concurrency", "1"))
        replies = wait_for(lambda: app.control.ping(timeout=0.5), 60, "a ping reply from the batch worker",
                           interval=0.1, watch=(worker,))
        assert len(replies) == 1
        r = connect(url)  # the pool process's broker client is up and heartbeating through the same URL
        wait_for(lambda: r.scard(redis_keys.clients()) == 1, 30, "the worker's broker client", watch=(worker,))
        r.close()
    finally:
        procs.close()
        app.close()
        if unix_server:
            unix_server.stop()
    assert "Traceback" not in procs.log("worker"), procs.log("worker")


def test_unix_socket_status_and_engine_registry(redis_keys):
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://redserve:")
        EngineRegistry(connect(server.url), redis_keys).register("u1", {"model": "m"})
        out = subprocess.run([*cli("status", "--key-prefix", redis_keys.prefix, "--json")], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "REDSERVE_REDIS_URL": server.url})
        assert out.returncode == 0, out.stdout + out.stderr
        assert [e["engine_id"] for e in json.loads(out.stdout)["engines"]] == ["u1"]
        assert _password(server.url) not in out.stdout + out.stderr

