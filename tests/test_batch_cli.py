"""`redserve batch` without processes: where Redis is found, Celery settings, the item runner's retries,
the progress bar, and the stack state file written by `redserve serve`."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

import api.batch.runner as runner_module
from api.answer import Answer
from api.batch import tasks
from api.batch.cli import ProgressBar, _settings
from api.batch.records import BatchRequest
from api.batch.runner import ItemRunner
from api.errors import ApiError
from broker.keys import RedisKeys
from common.stack_state import (
    StackState,
    read_stack_state,
    remove_stack_state,
    state_path,
    write_stack_state,
)
from redserve.cli import build_parser


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("REDSERVE_STATE_DIR", str(tmp_path / "state"))
    for name in ("REDSERVE_REDIS_URL", "REDSERVE_KEY_PREFIX", "REDSERVE_MODEL"):
        monkeypatch.delenv(name, raising=False)
    saved = tasks._settings
    yield
    tasks._settings = saved


def parse(*argv: str):
    return build_parser().parse_args(["batch", *argv])


def test_batch_keys_layout() -> None:
    keys = RedisKeys("rs")
    assert keys.batch_results("b1") == "{rs}:batch:b1:results"
    assert keys.batch_claims("b1") == "{rs}:batch:b1:claims"
    assert keys.celery() == "{rs}:celery:"
    with pytest.raises(ValueError):
        keys.batch_claims("a:b")


def test_stack_state_round_trip_and_stale_files(tmp_path) -> None:
    assert read_stack_state() is None
    write_stack_state(StackState("redis://127.0.0.1:1234/0", "px", "/m", ["m"]))
    assert state_path() == tmp_path / "state" / "stack.json"
    state = read_stack_state()
    assert (state.redis_url, state.key_prefix, state.model, state.pid) == ("redis://127.0.0.1:1234/0", "px", "/m",
                                                                           os.getpid())
    remove_stack_state()
    assert not state_path().exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_stack_state(StackState("redis://x:1/0", pid=int(dead.stdout)))  # written by a process now gone
    assert read_stack_state() is None


def test_redis_url_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    write_stack_state(StackState("redis://stack:1/0", "stackprefix", "/models/m", ["m"]))
    s = _settings(parse("status", "b1"))
    assert (s.redis_url, s.key_prefix) == ("redis://stack:1/0", "stackprefix")
    w = _settings(parse("worker"))
    assert (w.model, w.served_model_names) == ("/models/m", ["m"])
    assert _settings(parse("status", "b1", "--redis-url", "redis://flag:1/0")).key_prefix == "rs"
    monkeypatch.setenv("REDSERVE_REDIS_URL", "redis://env:1/0")
    monkeypatch.setenv("REDSERVE_KEY_PREFIX", "envprefix")
    s = _settings(parse("status", "b1"))
    assert (s.redis_url, s.key_prefix) == ("redis://env:1/0", "envprefix")
    assert _settings(parse("status", "b1", "--redis-url", "redis://flag:1/0")).redis_url == "redis://flag:1/0"


def test_commands_explain_what_is_missing(tmp_path) -> None:
    env = {**os.environ, "REDSERVE_STATE_DIR": str(tmp_path)}
    env.pop("REDSERVE_REDIS_URL", None)
    env.pop("REDSERVE_MODEL", None)
    run = [sys.executable, "-m", "redserve.cli", "batch"]
    no_redis = subprocess.run([*run, "status", "b1"], capture_output=True, text=True, env=env, timeout=60)
    assert no_redis.returncode == 2 and "no Redis URL" in no_redis.stderr
    no_model = subprocess.run([*run, "worker", "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True,
                              text=True, env=env, timeout=60)
    assert no_model.returncode == 2 and "--model" in no_model.stderr


def test_celery_settings_are_reliable_and_prefixed() -> None:
    app = tasks.configure(tasks.BatchSettings("redis://127.0.0.1:1/3", key_prefix="px", visibility_timeout=30))
    conf = app.conf
    assert conf.broker_url == conf.result_backend == "redis://127.0.0.1:1/3"
    assert conf.broker_transport_options["global_keyprefix"] == "{px}:celery:"
    assert conf.broker_transport_options["visibility_timeout"] == 30
    assert conf.broker_transport_options["unacked_restore_interval"] == 3
    assert conf.result_backend_transport_options == {"global_keyprefix": "{px}:celery:"}
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"
    task = app.tasks[tasks.TASK_NAME]
    assert task.acks_late and task.reject_on_worker_lost


def test_serve_and_worker_flags() -> None:
    assert build_parser().parse_args(["serve", "--no-batch-worker"]).no_batch_worker
    args = parse("worker", "--concurrency", "3", "--model", "/m", "--visibility-timeout", "60")
    assert (args.concurrency, args.model, args.visibility_timeout) == (3, "/m", 60.0)
    args = parse("submit", "in.jsonl", "--output", "out.jsonl", "--chunk-size", "4")
    assert (args.input, args.output, args.chunk_size) == ("in.jsonl", "out.jsonl", 4)


def test_runner_retries_transient_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [ApiError(503, "no engine is ready"), ApiError(429, "too many"), None]

    def handler(state, body, is_disconnected):
        error = answers.pop(0)
        if error is not None:
            raise error
        assert not is_disconnected()
        return Answer(body={"echo": body["prompt"]})

    monkeypatch.setitem(runner_module._HANDLERS, "/v1/completions", handler)
    monkeypatch.setattr(runner_module.time, "sleep", lambda s: None)
    runner = ItemRunner(state=None, retry_for=60)
    assert runner.run(BatchRequest("a", "/v1/completions", {"prompt": "hi"})) == (200, {"echo": "hi"})
    answers[:] = [ApiError(400, "bad", param="prompt")]
    status, body = runner.run(BatchRequest("a", "/v1/completions", {"prompt": "hi"}))
    assert status == 400 and body["error"]["param"] == "prompt" and not answers


def test_runner_gives_up_on_transient_answers_and_maps_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(state, body, is_disconnected):
        raise ApiError(503, "no engine is ready")

    def crash(state, body, is_disconnected):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner_module.time, "sleep", lambda s: None)
    monkeypatch.setitem(runner_module._HANDLERS, "/v1/completions", unavailable)
    assert ItemRunner(state=None, retry_for=0).run(BatchRequest("a", "/v1/completions", {}))[0] == 503
    monkeypatch.setitem(runner_module._HANDLERS, "/v1/completions", crash)
    status, body = ItemRunner(state=None, retry_for=0).run(BatchRequest("a", "/v1/completions", {}))
    assert status == 500 and "RuntimeError" in body["error"]["message"]


def test_progress_bar_plain_text() -> None:
    out = io.StringIO()
    bar = ProgressBar(out)
    for done in (0, 1, 2, 2, 4):
        bar.show(done, 1 if done else 0, 4)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[" + "." * 30 + "] 0/4 done, 0 failed"
    assert lines[-1] == "[" + "#" * 30 + "] 4/4 done, 1 failed"
    assert len(lines) == 2  # changes within 5 s are folded; the last state is always shown
