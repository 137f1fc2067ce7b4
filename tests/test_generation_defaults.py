"""The model's generation_config.json sampling values as request defaults (``--generation-config``).

Through real processes: one `redserve engine` and two `redserve api` servers (auto and vllm) on a copy
of the tiny model whose generation_config.json says ``top_k: 1`` (greedy whatever the temperature).
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from conftest import ApiStack

from api.generation_defaults import apply_generation_defaults, load_generation_defaults
from redserve.redis_server import EmbeddedRedis

AUTH = {"Authorization": f"Bearer {ApiStack.API_KEY}"}
PROMPT = [5, 17, 42, 99, 7]


def write_generation_config(model_dir, **fields) -> None:
    path = model_dir / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **fields}))


def test_only_sampling_fields_of_the_right_type_become_defaults(tmp_path) -> None:
    write_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, min_p=0, repetition_penalty=1.1,
                            max_new_tokens=5, eos_token_id=2)
    assert load_generation_defaults(str(tmp_path), "auto") == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1}
    assert load_generation_defaults(str(tmp_path), "vllm") == {}
    write_generation_config(tmp_path, top_k=2.5, temperature="hot")
    assert "top_k" not in load_generation_defaults(str(tmp_path), "auto")
    assert "temperature" not in load_generation_defaults(str(tmp_path), "auto")
    assert load_generation_defaults(str(tmp_path / "absent"), "auto") == {}


def test_a_value_the_request_gives_wins_and_null_means_unset() -> None:
    defaults = {"temperature": 0.6, "top_k": 20}
    body = {"temperature": 1.0, "top_k": None, "prompt": "x"}
    assert apply_generation_defaults(body, defaults) == {"temperature": 1.0, "top_k": 20, "prompt": "x"}
    assert apply_generation_defaults(["not", "a", "dict"], defaults) == ["not", "a", "dict"]


@pytest.fixture(scope="module")
def stacks(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    write_generation_config(model_dir, top_k=1, temperature=0.8)
    redis_server = EmbeddedRedis().start()
    stack = ApiStack(str(model_dir), tmp_path_factory.mktemp("gen-defaults-logs"), redis_server)
    try:
        stack.start_engine()
        stack.api, auto_url = stack.spawn_api("api-auto", "--api-key", ApiStack.API_KEY, workers=1)
        vllm_api, vllm_url = stack.spawn_api("api-vllm", "--api-key", ApiStack.API_KEY,
                                             "--generation-config", "vllm", workers=1)
        stack.wait_healthy(auto_url)
        stack.wait_healthy(vllm_url, watch=(vllm_api,))
        yield stack, auto_url, vllm_url
    finally:
        stack.close()


def completion_tokens(base_url: str, **params) -> str:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 7, **params}
    reply = requests.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_unset_fields_take_the_model_defaults_over_http(stacks) -> None:
    stack, auto_url, vllm_url = stacks
    greedy = completion_tokens(auto_url, temperature=0)
    assert completion_tokens(auto_url) == greedy  # top_k 1 from generation_config.json: greedy
    assert completion_tokens(auto_url, top_k=0) != greedy  # the request's own value wins: sampled
    assert completion_tokens(vllm_url) != greedy  # --generation-config vllm: the file is ignored
    assert completion_tokens(vllm_url, temperature=0) == greedy
    log = (stack.logs / "api-auto.log").read_text()
    assert "generation defaults from generation_config.json: {'temperature': 0.8, 'top_k': 1}" in log
    assert "--generation-config vllm ignores generation_config.json" in (stack.logs / "api-vllm.log").read_text()
