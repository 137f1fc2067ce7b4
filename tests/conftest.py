"""Shared pytest fixtures.

Redis: one private, authenticated Redis server per test session (`redis_server`); each test gets its
own database, flushed (as the admin user) before and after, and a URL of the application user for it
(`redis_url`), and its own key prefix (`redis_keys`): pub/sub channels are not per database, so the
prefix is what keeps tests' channels apart.

Multihost tests (marked ``multihost``) need network namespaces (root, iproute2, nftables): where they cannot
be made the tests skip, unless ``REDSERVE_REQUIRE_MULTIHOST=1`` (set by .ci/run as root, after installing
both): then each one fails with the reason, so CI never passes without having run them.
"""

from __future__ import annotations

import functools
import itertools
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from broker.connection import connect, mask_url
from broker.keys import RedisKeys
from redserve.redis_server import EmbeddedRedis
from worker.kernels import build
from worker.kernels.build import cache_root

# Tests that point REDSERVE_CACHE_DIR at a temporary folder (GGUF, tiny-model caches) keep using the C++
# kernels `make install` built, instead of compiling them again inside the run.
os.environ.setdefault("REDSERVE_KERNEL_CACHE_DIR", str(cache_root()))

_databases = itertools.cycle(range(1, 16))


@functools.cache
def _namespaces_unavailable() -> str | None:
    from tests import netns

    return netns.unavailable()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("multihost") is None or (reason := _namespaces_unavailable()) is None:
        return
    if os.environ.get("REDSERVE_REQUIRE_MULTIHOST") == "1":
        pytest.fail(f"REDSERVE_REQUIRE_MULTIHOST=1, but the multihost tests cannot run here: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_db(redis_server: EmbeddedRedis) -> Iterator[int]:
    """This test's database number, flushed (as the admin user: the app user cannot FLUSHDB) around it."""
    db = next(_databases)
    admin = redis.Redis.from_url(redis_server.url_for_db(db, admin=True))
    admin.flushdb()
    yield db
    admin.flushdb()
    admin.close()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis, redis_db: int) -> str:
    """The application user's URL of this test's database."""
    return redis_server.url_for_db(redis_db)


@pytest.fixture
def redis_admin(redis_server: EmbeddedRedis, redis_db: int) -> Iterator[redis.Redis]:
    """An admin client of this test's database, for what the app user may not do (FLUSHDB, CONFIG)."""
    client = redis.Redis.from_url(redis_server.url_for_db(redis_db, admin=True))
    yield client
    client.close()


@pytest.fixture
def redis_keys() -> RedisKeys:
    return RedisKeys(prefix=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    yield client
    client.close()


# --- tiny models (engine tests) -------------------------------------------------------------------------
# Built once per session with the real generator; small enough that the engine and transformers run them
# in milliseconds on CPU. The qwen2 variant has q/k/v biases and tied embeddings.

TINY_MODEL_SIZES = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                        vocab_size=1024)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from worker.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0,
                               **TINY_MODEL_SIZES))


@pytest.fixture(scope="session")
def tiny_llama_long_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny llama with 8192 positions: streams long enough (seconds) to still run when a test acts on them."""
    from worker.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-long", arch="llama", seed=0,
                               max_position_embeddings=8192, **TINY_MODEL_SIZES))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from worker.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", seed=1,
                               **TINY_MODEL_SIZES))


# The engine tests (test_engine_core, test_engine_limits, test_engine_models) run on both tiny models
# or on llama only.
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture
def llama_dir(tiny_llama_dir: str) -> str:
    return tiny_llama_dir


# --- API end-to-end stack (tests/test_api_e2e.py) -------------------------------------------------------
# Real processes: a private redis-server, `redserve engine` and `redserve api` (gunicorn, 2 workers) as
# subprocesses on the tiny llama model. Each child runs in its own session (so its whole process group can be
# killed, gunicorn workers included) and dies with the test process (PR_SET_PDEATHSIG). Logs: ApiStack.logs.

class ApiStack:
    """A running Redis + engine + API; `spawn_api` starts extra API servers, all stopped at teardown."""

    API_KEY = "test-key"

    def __init__(self, model_dir: str, logs, redis_server) -> None:
        self.model_dir = model_dir
        self.logs = logs
        self.redis = redis_server
        self.redis_url = redis_server.url
        self.engine = None
        self.api = None
        self.base_url = ""
        self._procs: list = []

    def spawn(self, name: str, argv: list[str]):
        import subprocess
        import sys

        from redserve.redis_server import pdeathsig_preexec

        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - closed with the stack
        proc = subprocess.Popen([sys.executable, "-m", "redserve.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pdeathsig_preexec())
        proc.log_file = log
        self._procs.append(proc)
        return proc

    def start_engine(self):
        self.engine = self.spawn("engine", ["engine", "--model", self.model_dir, "--redis-url", self.redis_url,
                                            "--dtype", "float32"])
        return self.engine

    def stop_engine(self) -> int | None:
        """SIGTERM the engine (it drains and deregisters); its exit code."""
        engine, self.engine = self.engine, None
        return self.stop_process(engine)

    def spawn_api(self, name: str, *extra: str, workers: int = 2) -> tuple:
        port = _free_tcp_port()
        proc = self.spawn(name, ["api", "--model", self.model_dir, "--redis-url", self.redis_url,
                                 "--port", str(port), "--workers", str(workers), *extra])
        return proc, f"http://127.0.0.1:{port}"

    def wait_healthy(self, base_url: str, timeout: float = 90.0, want: int = 200, watch: tuple = ()) -> None:
        """Poll /health until it answers `want`; fail early if a watched process (or the engine) exits."""
        import time

        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [[mask_url(a) if "://" in a else a for a in map(str, p.args)]
                    for p in (self.engine, self.api, *watch) if p is not None and p.poll() is not None]
            if dead:
                raise RuntimeError(f"a stack process exited: {dead}; see the logs in {self.logs}")
            try:
                if requests.get(f"{base_url}/health", timeout=2).status_code == want:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{base_url}/health did not answer {want} within {timeout}s; logs in {self.logs}")

    @staticmethod
    def stop_process(proc, timeout: float = 20.0) -> int | None:
        """SIGTERM the process's group, SIGKILL it after `timeout`; the exit code (None if killed)."""
        import contextlib
        import os
        import signal
        import subprocess

        code = proc.poll()
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # the leader is not reaped yet, so its group id is still ours: kill the whole group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        proc.log_file.close()
        return code

    def close(self) -> None:
        for proc in reversed(self._procs):
            self.stop_process(proc)
        self.redis.stop()


def _free_tcp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def api_stack(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiStack]:
    """Redis + `redserve engine` + `redserve api --workers 2 --api-key test-key`, up until the session ends.

    Yields the `ApiStack` (base_url, model_dir, redis_url, API_KEY, ...). Everything is killed at teardown,
    even when startup fails.
    """
    redis_server = EmbeddedRedis().start()
    stack = ApiStack(tiny_llama_dir, tmp_path_factory.mktemp("api-stack-logs"), redis_server)
    try:
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api("api", "--api-key", ApiStack.API_KEY,
                                                    "--max-body-bytes", str(1 << 20))
        stack.wait_healthy(stack.base_url)
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="module")
def client(api_stack: ApiStack):
    """An openai client of the session's API stack (its key, no retries). A test module that runs its own
    stack defines its own ``client``."""
    from openai import OpenAI
    return OpenAI(base_url=f"{api_stack.base_url}/v1", api_key=ApiStack.API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    """The served model's name, as /v1/models lists it."""
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: str):
    """The tiny model's `api.tokenizer.ModelTokenizer` (the API tests' fake-broker apps use it)."""
    from api.tokenizer import ModelTokenizer

    return ModelTokenizer(tiny_llama_dir)


# The paged-attention kernel as this CPU builds it and built again without AVX-512: on a CPU with AVX512-BF16 the
# native build decodes a bfloat16 cache and attends bfloat16 prefill tiles on paths of their own (vdpbf16ps), so
# the AVX2 paths stay checked too (tests/test_paged_attention.py, tests/test_prefill_attention.py).
ATTENTION_BUILDS = {"native": None, "avx2": ("-mno-avx512f",)}


@pytest.fixture(scope="module", params=list(ATTENTION_BUILDS))
def attention_kernel(request):
    cflags = ATTENTION_BUILDS[request.param]
    module = (build.load_extension("paged_attention") if cflags is None else
              build.load_extension("paged_attention_avx2", (build.CSRC / "paged_attention.cpp",), cflags))
    if module is None:
        pytest.skip(f"the paged-attention kernel ({request.param}) does not build here")
    return module
