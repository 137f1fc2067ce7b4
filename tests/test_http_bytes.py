"""The HTTP bytes the API answers, pinned: a fixed list of requests against a real stack (Redis, `redserve
engine` in float32 on the tiny random-weight llama, `redserve api`), each answer compared byte for byte with
its golden file under tests/data/http_bytes/.

What a golden holds: the status, the Content-Type and the whole body (a stream's server-sent events as sent).
Only what legitimately varies between runs is normalized: ids (``"id"``, ``"call_id"``, ``"item_id"``), the
``created`` / ``created_at`` timestamps. Everything else (text, token ids, usage, key order, whitespace, error
messages) must be equal, byte for byte, and so must every number but the floats (logprobs): those are compared to
float32 rounding, `FLOAT_TOLERANCE`, since the kernels' summation order changes their last digits between CPU
kinds (AVX2, AVX-512) and between kernel versions (a GQA group's keys scored together) without changing the model.

The stack is this module's own (fresh engine, so the prefix cache and hence ``cached_tokens`` depend only on
the requests below) and the requests run one at a time in the order listed, from one test. Outputs are greedy
or seeded, in float32: the same on one machine run after run.

``REDSERVE_REGEN_GOLDEN=1`` rewrites the goldens from the running code instead of comparing (only do that on
code whose HTTP output is known to be right, then review the diff).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import ApiStack
from tests.test_tool_calls import ASK, HERMES_TEMPLATE, TOOLS

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "http_bytes"
REGENERATE = os.environ.get("REDSERVE_REGEN_GOLDEN") == "1"
MODEL = "tiny-llama"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "def hello("
CHAT = [{"role": "user", "content": "Say something."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                   "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}

CMPL = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
RESP = "/v1/responses"

# (name, method, path, body); a bytes body is sent as it is. Order matters (one engine, its prefix cache).
REQUESTS: list[tuple[str, str, str, Any]] = [
    ("cmpl_plain", "post", CMPL, {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}),
    ("cmpl_token_prompt", "post", CMPL, {"prompt": [1, 450, 4996, 17354, 1701, 29916], "max_tokens": 8,
                                         "temperature": 0}),
    ("cmpl_n2_seeded", "post", CMPL, {"prompt": PROMPT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 7}),
    ("cmpl_two_prompts", "post", CMPL, {"prompt": [PROMPT, "import os\n"], "max_tokens": 6, "temperature": 0}),
    ("cmpl_stop", "post", CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": ["r fi"]}),
    ("cmpl_stop_included", "post", CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                          "stop": ["r fi"], "include_stop_str_in_output": True}),
    ("cmpl_stop_n2", "post", CMPL, {"prompt": PROMPT, "max_tokens": 12, "n": 2, "temperature": 1.0, "seed": 3,
                                    "stop": [").ext", "keyff"]}),
    ("cmpl_stop_token_ids", "post", CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                           "stop_token_ids": [840]}),
    ("cmpl_logprobs_echo", "post", CMPL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 3,
                                          "echo": True}),
    ("cmpl_echo_only", "post", CMPL, {"prompt": PROMPT, "max_tokens": 0, "echo": True}),
    ("cmpl_return_token_ids", "post", CMPL, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                             "return_token_ids": True, "prompt_logprobs": 1}),
    ("cmpl_ignore_eos_min_tokens", "post", CMPL, {"prompt": PROMPT, "max_tokens": 10, "min_tokens": 10,
                                                  "temperature": 0.8, "seed": 11, "ignore_eos": True}),
    ("cmpl_stream", "post", CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **STREAM_USAGE}),
    ("cmpl_stream_stop", "post", CMPL, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": ["r fi"],
                                        "stream": True}),
    ("cmpl_stream_logprobs_echo", "post", CMPL, {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                 "logprobs": 2, "echo": True, **STREAM_USAGE}),
    ("cmpl_stream_n2_token_ids", "post", CMPL, {"prompt": PROMPT, "max_tokens": 6, "n": 2, "temperature": 1.0,
                                                "seed": 5, "return_token_ids": True, "stream": True}),
    ("chat_plain", "post", CHAT_PATH, {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0}),
    ("chat_stop", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 16, "temperature": 0, "stop": "er =="}),
    ("chat_logprobs", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True,
                                          "top_logprobs": 2}),
    ("chat_n2_seeded", "post", CHAT_PATH, {"messages": CHAT, "max_completion_tokens": 8, "n": 2,
                                           "temperature": 1.0, "seed": 9}),
    ("chat_stream", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 16, "temperature": 0, **STREAM_USAGE}),
    ("chat_stream_logprobs_stop", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 16, "temperature": 0,
                                                      "logprobs": True, "top_logprobs": 1, "stop": ["er =="],
                                                      "stream": True}),
    ("chat_json_schema", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 80, "temperature": 1.0, "seed": 7,
                                             "response_format": {"type": "json_schema", "json_schema": {
                                                 "name": "person", "schema": PERSON}}}),
    ("chat_json_object_stream", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 40, "temperature": 1.0,
                                                    "seed": 4, "response_format": {"type": "json_object"},
                                                    **STREAM_USAGE}),
    ("chat_guided_choice", "post", CHAT_PATH, {"messages": CHAT, "max_tokens": 10, "temperature": 0,
                                               "guided_choice": ["yes", "no", "maybe"]}),
    ("chat_tools_required", "post", CHAT_PATH, {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                "max_tokens": 80, "temperature": 1.0, "seed": 2,
                                                "parallel_tool_calls": False}),
    ("chat_tools_named_stream", "post", CHAT_PATH, {"messages": ASK, "tools": TOOLS, "max_tokens": 80,
                                                    "temperature": 1.0, "seed": 6, "tool_choice": {
                                                        "type": "function", "function": {"name": "get_weather"}},
                                                    **STREAM_USAGE}),
    ("chat_tools_auto", "post", CHAT_PATH, {"messages": ASK, "tools": TOOLS, "tool_choice": "auto",
                                            "max_tokens": 12, "temperature": 0}),
    ("chat_tools_auto_stream", "post", CHAT_PATH, {"messages": ASK, "tools": TOOLS, "tool_choice": "auto",
                                                   "max_tokens": 12, "temperature": 0, "stream": True}),
    ("responses_plain", "post", RESP, {"input": "Say something.", "max_output_tokens": 12, "temperature": 0}),
    ("responses_stream", "post", RESP, {"input": "Say something.", "max_output_tokens": 8, "temperature": 0,
                                        "stream": True}),
    ("responses_tools", "post", RESP, {"input": "Weather in Paris?", "max_output_tokens": 60, "temperature": 1.0,
                                       "top_p": 0.9, "tool_choice": "required", "parallel_tool_calls": False,
                                       "tools": [{"type": "function", "name": "get_weather",
                                                  "parameters": TOOLS[0]["function"]["parameters"]}]}),
    ("err_bad_json", "post", CMPL, b"{not json"),
    ("err_bad_model", "post", CMPL, {"model": "gpt-17", "prompt": "x"}),
    ("err_bad_model_chat", "post", CHAT_PATH, {"model": "gpt-17", "messages": CHAT}),
    ("err_bad_max_tokens_type", "post", CMPL, {"prompt": "x", "max_tokens": "ten"}),
    ("err_bad_temperature", "post", CMPL, {"prompt": "x", "temperature": -3}),
    ("err_n0", "post", CMPL, {"prompt": "x", "n": 0}),
    ("err_token_out_of_vocab", "post", CMPL, {"prompt": [4096]}),
    ("err_prompt_too_long", "post", CMPL, {"prompt": list(range(5, 1005)) * 3}),
    ("err_text_prompt_too_long", "post", CMPL, {"prompt": "hello " * 40000}),
    ("err_chat_too_long", "post", CHAT_PATH, {"messages": [{"role": "user", "content": "hi " * 3000}]}),
    ("err_max_tokens_too_large", "post", CMPL, {"prompt": "x", "max_tokens": 5000}),
    ("err_stream_options_without_stream", "post", CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("err_empty_stop", "post", CMPL, {"prompt": "x", "stop": [""]}),
    ("err_chat_messages", "post", CHAT_PATH, {"messages": "hi"}),
    ("err_top_logprobs_alone", "post", CHAT_PATH, {"messages": CHAT, "top_logprobs": 2}),
    ("err_bad_schema", "post", CHAT_PATH, {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    ("err_tool_choice_unknown", "post", CHAT_PATH, {"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}),
    ("err_unknown_route", "post", "/v1/nowhere", {}),
    ("err_wrong_method", "get", CHAT_PATH, None),
]

_FLOATS = re.compile(rb"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")
FLOAT_TOLERANCE = 1e-5  # relative, and as much absolute: float32 rounding over a few thousand products


def same_answer(got: bytes, golden: bytes) -> bool:
    """Equal bytes, but for floats, which may differ within `FLOAT_TOLERANCE` (see the module docstring)."""
    if got == golden:
        return True
    if _FLOATS.sub(b"F", got) != _FLOATS.sub(b"F", golden):
        return False
    return all(abs(float(a) - float(b)) <= FLOAT_TOLERANCE * max(1.0, abs(float(b)))
               for a, b in zip(_FLOATS.findall(got), _FLOATS.findall(golden), strict=True))


_IDS = re.compile(rb'("(?:id|call_id|item_id)": ?")[^"]*(")')
_TIMES = re.compile(rb'("(?:created|created_at)": ?)\d+')


def normalize(body: bytes) -> bytes:
    """The body with what varies between runs (ids, timestamps) replaced by fixed placeholders."""
    return _TIMES.sub(rb"\g<1>0", _IDS.sub(rb"\g<1>ID\g<2>", body))


def capture(response: requests.Response) -> bytes:
    head = f"{response.status_code}\n{response.headers.get('Content-Type')}\n\n".encode()
    return head + normalize(response.content)


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir, tmp_path_factory) -> Iterator[str]:
    """A fresh stack of this module's own: Redis, the float32 engine, one API serving the model (under the
    name `MODEL`) with the Hermes chat template and tool parser, so tools run end to end."""
    from redserve.redis_server import EmbeddedRedis

    model_dir = tmp_path_factory.mktemp("bytes-model") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": HERMES_TEMPLATE}))
    stack = ApiStack(tiny_llama_dir, tmp_path_factory.mktemp("bytes-logs"), EmbeddedRedis().start())
    try:
        stack.start_engine()
        stack.api, stack.base_url = stack.spawn_api(
            "api", "--model", str(model_dir), "--served-model-name", MODEL, "--api-key", KEY,
            "--tool-call-parser", "hermes", "--enable-auto-tool-choice", workers=1)
        stack.wait_healthy(stack.base_url)
        yield stack.base_url
    finally:
        stack.close()


def send(base_url: str, method: str, path: str, body: Any) -> requests.Response:
    kwargs: dict[str, Any] = {"headers": {**AUTH, "Content-Type": "application/json"}, "timeout": 120}
    if isinstance(body, bytes):
        kwargs["data"] = body
    elif body is not None:
        kwargs["data"] = json.dumps(body)
    return requests.request(method, base_url + path, **kwargs)


def test_http_bytes_match_the_goldens(base_url: str, tmp_path: Path) -> None:
    mismatched = []
    for name, method, path, body in REQUESTS:
        got = capture(send(base_url, method, path, body))
        golden = GOLDEN_DIR / f"{name}.txt"
        if REGENERATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_bytes(got)
        elif not golden.exists() or not same_answer(got, golden.read_bytes()):
            mismatched.append(name)
            (tmp_path / f"{name}.txt").write_bytes(got)
    assert not mismatched, f"answers differ from their goldens: {mismatched}; this run's answers are in {tmp_path}"


def test_floats_may_differ_by_rounding_and_nothing_else() -> None:
    golden = b'{"logprob":-4.512984275817871,"token":" y","index":0,"x":1e-05}'
    assert same_answer(b'{"logprob":-4.512983322143555,"token":" y","index":0,"x":1.00001e-05}', golden)
    assert not same_answer(b'{"logprob":-4.51,"token":" y","index":0,"x":1e-05}', golden)
    assert not same_answer(b'{"logprob":-4.512984275817871,"token":" z","index":0,"x":1e-05}', golden)
    assert not same_answer(b'{"logprob":-4.512984275817871,"token":" y","index":1,"x":1e-05}', golden)
    assert not same_answer(b'{"logprob":-4.512984275817871, "token":" y","index":0,"x":1e-05}', golden)


def test_normalize_replaces_only_ids_and_times() -> None:
    body = b'{"id":"cmpl-1f","created":17,"text":"\\"id\\": \\"x\\"","call_id": "call_9","created_at": 3}'
    assert normalize(body) == b'{"id":"ID","created":0,"text":"\\"id\\": \\"x\\"","call_id": "ID","created_at": 0}'
