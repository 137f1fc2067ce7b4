import os
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from broker.connection import connect, wait_for_redis
from broker.errors import BrokerUnavailable
from broker.redis_server import EmbeddedRedis, redis_cli_path, redis_server_path


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


def test_start_stop_leaves_no_process_and_no_tempdir():
    server = EmbeddedRedis().start()
    pid, url = server.pid, server.url
    tmpdir = server._tmpdir
    assert url.startswith("redis://127.0.0.1:")
    assert redis.Redis.from_url(url).ping()
    assert redis.Redis.from_url(url).config_get("save") == {"save": ""}
    server.stop()
    assert not _pid_alive(pid)
    assert not os.path.exists(tmpdir)
    server.stop()  # idempotent
    assert not server.running


def test_redis_cli_from_the_same_place_works(redis_server):
    out = subprocess.run(
        [redis_cli_path(), "-p", str(redis_server.port), "PING"], capture_output=True, text=True, timeout=10
    )
    assert out.stdout.strip() == "PONG"


def test_unix_socket():
    with EmbeddedRedis(unix_socket=True) as server:
        assert server.url.startswith("unix://")
        assert server.port is None
        client = connect(server.url)
        assert client.ping()
        client.close()


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
        from broker.redis_server import EmbeddedRedis
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
