"""The batch worker answers items through the API's own handlers, without Flask, with the HTTP bodies.

The batch side runs in a child process where ``import flask`` / ``import werkzeug`` fail, after importing
the Celery worker's module (`api.batch.tasks`); its answers must equal what the Flask app sends for the
same bodies over the same scripted broker client (ids and timestamps aside).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from fake_broker import FakeClient, make_app, token_script

from api.tokenizer import ModelTokenizer

TEXT = "Hello world, this is a test. STOP here and more text follows"
CHAT = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 50, "n": 2, "stop": ["STOP"], "logprobs": 1}),
    ("/v1/completions", {"prompt": ["x", "yy"], "max_tokens": 4, "echo": True, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT}),
    ("/v1/completions", {"prompt": [99999]}),
    ("/v1/responses", {"input": CHAT, "instructions": "Be brief.", "max_output_tokens": 6}),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}),
]

BATCH_SIDE = """
import json, sys
sys.modules["flask"] = sys.modules["werkzeug"] = None  # from here on, importing either fails
from api.batch import tasks  # the Celery worker's module, which builds the ItemRunner
from api.batch.records import BatchRequest
from api.batch.runner import ItemRunner
from api.tokenizer import ModelTokenizer
from tests.fake_broker import FakeClient, make_state, token_script
model_dir, text, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tokenizer = ModelTokenizer(model_dir)
state = make_state(model_dir, tokenizer, FakeClient(token_script(tokenizer.encode(text), logprobs=True, cached=1)))
runner = ItemRunner(state, retry_for=0)
print(json.dumps([runner.run(BatchRequest(str(i), url, body)) for i, (url, body) in enumerate(cases)]))
"""


def _stable(body: dict[str, Any]) -> dict[str, Any]:
    """The body without what differs between two answers to the same request (ids and timestamps, the
    Responses output items' own ids too)."""
    stable = {k: v for k, v in body.items() if k not in ("id", "created", "created_at")}
    if isinstance(stable.get("output"), list):
        stable["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in stable["output"]]
    return stable


def test_batch_items_go_through_the_http_handlers_without_flask(tiny_llama_dir: str,
                                                                tokenizer: ModelTokenizer) -> None:
    done = subprocess.run([sys.executable, "-c", BATCH_SIDE, tiny_llama_dir, TEXT, json.dumps(CASES)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    batch = json.loads(done.stdout.splitlines()[-1])

    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(tokenizer.encode(TEXT), logprobs=True, cached=1)))
    for (url, body), (status, batch_body) in zip(CASES, batch, strict=True):
        r = http.post(url, json=body)
        assert (status, _stable(batch_body)) == (r.status_code, _stable(r.get_json())), url
    assert [status for status, _ in batch] == [200, 200, 200, 404, 400, 200, 400]
    completion, echoed, chat = (body for _, body in batch[:3])
    assert [c["text"] for c in completion["choices"]] == ["Hello world, this is a test. "] * 2
    assert [c["text"][:2] for c in echoed["choices"]] == ["xH", "yy"]
    assert chat["choices"][0]["message"]["content"] and len(chat["choices"][0]["logprobs"]["content"]) == 6
    assert completion["usage"]["completion_tokens"] > 0 and batch[3][1]["error"]["code"] == "model_not_found"
    # the prefix-cache hits the engine reported: each prompt once (n=2 for the first, two prompts for the second)
    assert [body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in (completion, echoed, chat)] == [1, 2, 1]
    response = batch[5][1]
    assert response["object"] == "response" and response["output"][0]["content"][0]["text"]
    assert response["usage"]["output_tokens"] == 6 and response["status"] == "incomplete"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 1
    assert batch[6][1]["error"]["param"] == "previous_response_id"
