"""The launcher's supervision rules without a whole stack: backoff and crash loop, the embedded Redis's
watch, and what the children are given (secrets in the environment, never on argv)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import redis
from stack_procs import wait_for

from redserve.cli import build_parser
from redserve.redis_server import EmbeddedRedis
from redserve.stack import RedisWatch
from redserve.stack import Stack as SupervisedStack
from redserve.supervisor import ChildSpec, CrashLoop, RestartPolicy, Supervisor, has_exited

API_KEY = "sk-supervisor-test-key"


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run() -> None:
    now = [0.0]
    policy = RestartPolicy(initial_backoff=0.5, max_backoff=2.0, stable_after=30, max_restarts=100)
    supervisor = Supervisor(policy, clock=lambda: now[0])
    child = supervisor.start(ChildSpec("crasher", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), 5))
    backoffs = []
    try:
        for uptime in (0, 0, 0, 0, 31, 0):
            wait_for(lambda: has_exited(child.proc), 30, "the crasher to exit", interval=0.02)
            now[0] += uptime
            supervisor.check()
            backoffs.append(child.restart_at - now[0])
            now[0] = child.restart_at
            supervisor.check()
            assert child.running
    finally:
        supervisor.stop([])
    assert backoffs == [0.5, 1.0, 2.0, 2.0, 0.5, 1.0]


def test_redis_watch_restarts_on_the_same_url_and_stops_a_crash_loop() -> None:
    policy = RestartPolicy(initial_backoff=0.01, max_backoff=0.01, max_restarts=1)
    restarted: list[str] = []
    with EmbeddedRedis() as server:
        watch = RedisWatch(server, Supervisor(policy), restarted.append)
        url = server.url
        os.kill(server.pid, signal.SIGKILL)
        wait_for(lambda: not server.running, 10, "Redis to die", interval=0.02)
        wait_for(lambda: (watch.check(), restarted)[1], 10, "the restarted Redis", interval=0.02)
        assert restarted == ["redis"] and server.running and server.url == url
        client = redis.Redis.from_url(url)
        try:
            assert client.ping()  # same port, same passwords
        finally:
            client.close()
        os.kill(server.pid, signal.SIGKILL)
        wait_for(lambda: not server.running, 10, "Redis to die again", interval=0.02)
        with pytest.raises(CrashLoop, match="redis was killed by SIGKILL"):
            watch.check()


def test_children_get_the_redis_url_and_api_key_through_the_environment(tmp_path: Path, monkeypatch) -> None:
    # The real children retitle themselves (setproctitle hides argv once they run), so check what is spawned.
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    url = "redis://:redis-secret@127.0.0.1:1/0"
    args = build_parser().parse_args(["serve", "--redis-url", url, "--api-key", API_KEY, "--model", str(tmp_path)])
    stack = SupervisedStack(args)
    specs: list[ChildSpec] = []
    stack.supervisor.start = specs.append
    stack.start()
    assert {s.name for s in specs} == {"coordinator", "engine-0", "api", "batch"}
    assert stack._redis_watch is None  # an external Redis is not ours to restart
    for spec in specs:
        argv = " ".join(spec.argv)
        assert "redis-secret" not in argv and API_KEY not in argv and "--redis-url" not in argv, argv
        assert spec.env["REDSERVE_REDIS_URL"] == url
        assert (spec.env.get("REDSERVE_API_KEY") == API_KEY) == (spec.name == "api")


def test_api_workers_default_scales_with_cores() -> None:
    from redserve.stack import api_workers
    assert [api_workers(c) for c in (1, 2, 8, 16, 32, 64, 256)] == [2, 2, 2, 4, 8, 8, 8]
