"""`redserve redis-cli`: inspection of the stack's authenticated Redis with plain redis-cli."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from redis.connection import parse_url
from stack_procs import cli

from common.stack_state import StackState, write_stack_state
from redserve.redis_server import EmbeddedRedis


@pytest.fixture
def stack_file(tmp_path, monkeypatch):
    """A private Redis recorded in a stack file, as `redserve serve` records its embedded one."""
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("REDSERVE_REDIS_URL", raising=False)
    with EmbeddedRedis() as server:
        write_stack_state(StackState(server.url, "rs", "/m", ["m"], admin_redis_url=server.admin_url))
        yield server


def redis_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli("redis-cli", *argv), capture_output=True, text=True, timeout=60,
                          env={**os.environ})


def test_runs_commands_as_the_app_user_from_the_stack_file(stack_file):
    assert redis_cli("SADD", "{rs}:engines", "0").stdout.strip() == "1"
    assert redis_cli("SMEMBERS", "{rs}:engines").stdout.strip() == "0"
    for command in (["CONFIG", "GET", "maxmemory"], ["FLUSHALL"], ["ACL", "WHOAMI"]):
        denied = redis_cli(*command)
        assert "NOPERM" in denied.stdout + denied.stderr, command


def test_admin_may_reconfigure(stack_file):
    out = redis_cli("--admin", "CONFIG", "GET", "maxmemory-policy").stdout.split()
    assert out == ["maxmemory-policy", "noeviction"]
    assert redis_cli("--admin", "ACL", "WHOAMI").stdout.strip() == "admin"


def test_an_explicit_url_wins_and_no_stack_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("REDSERVE_REDIS_URL", raising=False)
    missing = redis_cli("PING")
    assert missing.returncode != 0 and "--redis-url" in missing.stderr
    with EmbeddedRedis() as server:
        assert redis_cli("--redis-url", server.url, "PING").stdout.strip() == "PONG"
        no_admin = redis_cli("--admin", "PING")
        assert no_admin.returncode != 0 and "embedded Redis" in no_admin.stderr


def test_status_finds_the_running_stack_too(stack_file):
    out = subprocess.run(cli("status", "--json"), capture_output=True, text=True, timeout=60, env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert "engines" in json.loads(out.stdout)
    password = parse_url(stack_file.url)["password"]
    assert password not in out.stdout + out.stderr


def test_behind_sentinels_redis_cli_and_status_reach_the_primary(tmp_path, monkeypatch):
    from redserve.redis_replicas import ReplicatedRedis

    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("REDSERVE_REDIS_URL", raising=False)
    replicated = ReplicatedRedis(1).start()
    try:
        write_stack_state(StackState(replicated.url, "rs", "/m", ["m"], admin_redis_url=replicated.admin_url,
                                     redis_nodes=replicated.describe()))
        assert "role:master" in redis_cli("INFO", "replication").stdout
        assert redis_cli("--admin", "ROLE").stdout.split()[0] == "master"
        out = subprocess.run(cli("status", "--json"), capture_output=True, text=True, timeout=60, env={**os.environ})
        topology = json.loads(out.stdout)["redis_replication"]
        primary, replica = (f"127.0.0.1:{node.port}" for node in replicated.data.values())
        assert topology == {"master_name": "redserve", "primary": primary, "replicas": [replica]}
    finally:
        replicated.stop()
