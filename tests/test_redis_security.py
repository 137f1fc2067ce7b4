"""The embedded Redis is authenticated, the app user cannot reconfigure or wipe it, no secret leaks
through its command line or its files, and its memory limits are in effect (a real server each time)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from redserve.redis_conf import ADMIN_USER, APP_USER
from redserve.redis_server import EmbeddedRedis, redis_cli_path

# Commands the application user must never run: each would reconfigure, wipe, stop or take over the server.
FORBIDDEN = [
    ["CONFIG", "SET", "dir", "/tmp"],
    ["CONFIG", "GET", "requirepass"],
    ["FLUSHALL"],
    ["FLUSHDB"],
    ["DEBUG", "SLEEP", "0"],
    ["SHUTDOWN", "NOSAVE"],
    ["MODULE", "LOAD", "/tmp/evil.so"],
    ["ACL", "SETUSER", "evil", "on", ">pw", "+@all"],
    ["ACL", "LIST"],
    ["REPLICAOF", "127.0.0.1", "1"],
    ["SLAVEOF", "127.0.0.1", "1"],
    ["MIGRATE", "127.0.0.1", "1", "k", "0", "100"],
    ["SAVE"],
    ["BGSAVE"],
    ["SCRIPT", "FLUSH"],
    ["SCRIPT", "KILL"],
    ["FUNCTION", "FLUSH"],
    ["KEYS", "*"],
    ["CLIENT", "KILL", "ID", "1"],
    ["MONITOR"],
]

# What redserve (broker, engines, coordinator, batch store) and Celery/kombu send.
NEEDED = [
    ["PING"], ["INFO"], ["SELECT", "3"], ["CLIENT", "SETNAME", "x"], ["CLIENT", "ID"], ["CLIENT", "INFO"],
    ["CLIENT", "SETINFO", "LIB-NAME", "redis-py"],
    ["XADD", "s", "*", "f", "v"], ["XREADGROUP", "GROUP", "g", "c", "COUNT", "1", "STREAMS", "s", ">"],
    ["XGROUP", "CREATE", "s", "g", "$", "MKSTREAM"], ["XACK", "s", "g", "1-0"], ["XPENDING", "s", "g"],
    ["XAUTOCLAIM", "s", "g", "c", "0", "0-0"], ["XTRIM", "s", "MAXLEN", "10"], ["XLEN", "s"],
    ["PUBLISH", "ch", "m"], ["SUBSCRIBE", "ch"], ["PSUBSCRIBE", "ch*"], ["PUBSUB", "NUMSUB", "ch"],
    ["HSET", "h", "f", "v"], ["HGETALL", "h"], ["SADD", "s2", "m"], ["SMEMBERS", "s2"], ["SREM", "s2", "m"],
    ["SET", "k", "v", "NX", "EX", "5"], ["GET", "k"], ["INCR", "n"], ["DEL", "k"], ["UNLINK", "k"],
    ["EXPIRE", "k", "5"], ["PTTL", "k"], ["EXISTS", "k"], ["TYPE", "k"], ["SCAN", "0"],
    ["EVAL", "return 1", "0"], ["EVALSHA", "0" * 40, "0"], ["SCRIPT", "LOAD", "return 1"],
    ["SCRIPT", "EXISTS", "0" * 40], ["MULTI"], ["EXEC"], ["WATCH", "k"],
    ["LPUSH", "q", "m"], ["RPUSH", "q", "m"], ["BRPOP", "q", "1"], ["LRANGE", "q", "0", "-1"], ["LREM", "q", "0", "m"],
    ["ZADD", "z", "1", "m"], ["ZRANGEBYSCORE", "z", "0", "1"], ["ZREM", "z", "m"],
    # the README's redis-cli inspection commands
    ["SMEMBERS", "{rs}:engines"], ["HGET", "h", "f"], ["TTL", "k"], ["XINFO", "GROUPS", "s"],
    ["XPENDING", "s", "g", "-", "+", "10"], ["PUBSUB", "CHANNELS", "rs:out:*"], ["SCAN", "0", "MATCH", "rs:*"],
]


def _password(url: str) -> str:
    return redis.connection.parse_url(url)["password"]


@pytest.fixture
def admin(redis_server):
    client = redis.Redis.from_url(redis_server.admin_url, decode_responses=True)
    yield client
    client.close()


def test_no_or_a_wrong_password_is_refused(redis_server):
    no_retry = {"port": redis_server.port, "retry": Retry(NoBackoff(), 0)}  # redis-py retries auth errors
    with pytest.raises(redis.AuthenticationError, match="(?i)authentication required"):
        redis.Redis(protocol=2, **no_retry).ping()
    for user, password in [(APP_USER, "wrong"), ("default", ""), ("default", "x"), (ADMIN_USER, "wrong")]:
        with pytest.raises(redis.AuthenticationError, match="invalid username-password"):
            redis.Redis(username=user, password=password, **no_retry).ping()


@pytest.mark.parametrize("command", FORBIDDEN, ids=lambda c: " ".join(c[:2]))
def test_app_user_cannot_reconfigure_or_wipe_the_server(redis_server, admin, command):
    assert admin.execute_command("ACL", "DRYRUN", APP_USER, *command) != "OK"
    app = redis.Redis.from_url(redis_server.url, protocol=2)
    try:
        with pytest.raises(redis.ResponseError):  # NOPERM (DEBUG, MODULE: also disabled for everyone)
            app.execute_command(*command)
    finally:
        app.close()
    assert admin.ping() and admin.config_get("dir")["dir"] != "/tmp"


@pytest.mark.parametrize("command", NEEDED, ids=lambda c: " ".join(c[:2]))
def test_app_user_may_run_what_redserve_and_celery_need(admin, command):
    assert admin.execute_command("ACL", "DRYRUN", APP_USER, *command) == "OK"


def test_admin_may_run_everything(redis_server, admin):
    assert admin.acl_whoami() == ADMIN_USER
    assert admin.config_set("maxmemory-policy", "noeviction")
    db15 = redis.Redis.from_url(redis_server.url_for_db(15, admin=True))
    assert db15.flushdb()
    db15.close()
    assert admin.execute_command("ACL", "DRYRUN", ADMIN_USER, "SHUTDOWN", "NOSAVE") == "OK"


def test_redis_cli_inspection_with_the_password_in_the_environment(redis_server):
    """The README's command: REDISCLI_AUTH=<password> redis-cli --user redserve -p PORT ..."""
    port = str(redis_server.port)
    env = {**os.environ, "REDISCLI_AUTH": _password(redis_server.url)}
    out = subprocess.run([redis_cli_path(), "--user", APP_USER, "-p", port, "PING"], env=env,
                         capture_output=True, text=True, timeout=10)
    assert out.stdout.strip() == "PONG"
    env["REDISCLI_AUTH"] = _password(redis_server.admin_url)
    out = subprocess.run([redis_cli_path(), "--user", ADMIN_USER, "-p", port, "CONFIG", "GET", "maxmemory-policy"],
                         env=env, capture_output=True, text=True, timeout=10)
    assert out.stdout.split() == ["maxmemory-policy", "noeviction"]
    env.pop("REDISCLI_AUTH")
    out = subprocess.run([redis_cli_path(), "-p", port, "PING"], env=env, capture_output=True, text=True, timeout=10)
    assert "NOAUTH" in out.stdout + out.stderr


def test_no_password_on_the_server_command_line(redis_server):
    secrets = [_password(redis_server.url), _password(redis_server.admin_url)]
    argv = " ".join(map(str, redis_server._proc.args))
    with open(f"/proc/{redis_server.pid}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    assert not [s for s in secrets if s in argv or s in cmdline]


def test_server_files_are_private():
    with EmbeddedRedis(unix_socket=True) as server:
        tmpdir = server._tmpdir
        assert stat.S_IMODE(os.stat(tmpdir).st_mode) == 0o700
        names = sorted(os.listdir(tmpdir))
        assert {"redis.conf", "redis.log", "redis.sock"} <= set(names)
        for name in names:
            mode = stat.S_IMODE(os.stat(os.path.join(tmpdir, name)).st_mode)
            assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
        assert _password(server.url) in Path(tmpdir, "redis.conf").read_text()


def test_memory_limits_are_in_effect(admin):
    assert admin.config_get("maxmemory")["maxmemory"] == str(1 << 30)
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    assert "pubsub 268435456 67108864 60" in admin.config_get("client-output-buffer-limit")["client-output-buffer-limit"]


def test_a_full_redis_refuses_writes_instead_of_evicting():
    with EmbeddedRedis(maxmemory="4mb") as server:
        client = redis.Redis.from_url(server.url)
        client.set("first", "kept")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(200):
                client.set(f"big{i}", b"x" * 65536)
        assert client.get("first") == b"kept"
        client.close()
