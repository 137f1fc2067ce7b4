"""Shared pytest fixtures.

Redis: one private `redis-server` per test session (`redis_server`); each test gets its own
database, flushed before and after (`redis_url`), and its own key prefix (`redis_keys`): pub/sub
channels are not per database, so the prefix is what keeps tests' channels apart.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import pytest
import redis

from broker.connection import connect
from broker.keys import RedisKeys
from broker.redis_server import EmbeddedRedis

_databases = itertools.cycle(range(1, 16))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    url = f"redis://127.0.0.1:{redis_server.port}/{next(_databases)}"
    admin = redis.Redis.from_url(url)
    admin.flushdb()
    yield url
    admin.flushdb()
    admin.close()


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
    from engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama", seed=0,
                               **TINY_MODEL_SIZES))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", seed=1,
                               **TINY_MODEL_SIZES))
