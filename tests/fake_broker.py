"""A scripted, in-process stand-in for the broker client, and helpers to drive the Flask app with it.

The API tests that need no Redis and no engine (tests/test_api_fake_broker.py and others) build the app
with `make_app(model_dir, tokenizer, FakeClient(script))`, or just its state with `make_state`; a script
turns each AddRequest into the outputs an engine would send. Importing this module does not import Flask
(tests/test_batch_runner.py runs the batch path where Flask cannot be imported).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from api.config import ApiConfig
from api.state import ApiState
from api.tokenizer import ModelTokenizer
from broker.errors import NoEngineAvailable
from protocol.messages import AddRequest, RequestOutput

Script = Callable[[AddRequest], list[RequestOutput | None]]


class FakeHandle:
    """Mimics broker.client.request_handle.RequestHandle over a scripted list (None = nothing yet, forever)."""

    def __init__(self, add: AddRequest, outputs: list[RequestOutput | None]) -> None:
        self.request_id = add.request_id
        self.n = add.params.n
        self._outputs = deque(outputs)
        self._finished_indices: set[int] = set()
        self.aborted = False
        self.aborted_sequences: list[int] = []
        self.finished = False

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        if self.finished:
            return None
        if not self._outputs or self._outputs[0] is None:
            time.sleep(min(timeout or 0.0, 0.01))
            return None
        out = self._outputs.popleft()
        if out.finish_reason is not None:
            self._finished_indices.add(out.index)
        if out.error_code is not None or len(self._finished_indices) >= self.n:
            self.finished = True
        return out

    def abort(self) -> None:
        self.aborted = True
        self.finished = True

    def abort_sequence(self, index: int) -> None:
        self.aborted_sequences.append(index)

    def close(self) -> None:
        if not self.finished:
            self.abort()


class FakeClient:
    """Mimics the parts of BrokerClient the API uses."""

    def __init__(self, script: Script, max_model_len: int = 256) -> None:
        self.script = script
        self.max_model_len = max_model_len
        self.ready = True
        self.handles: list[FakeHandle] = []
        self.submit_error: BaseException | None = None

    def submit(self, add: AddRequest, engine_id: str | None = None) -> FakeHandle:
        if self.submit_error is not None:
            raise self.submit_error
        if not self.ready:
            raise NoEngineAvailable("no engine")
        handle = FakeHandle(add, self.script(add))
        self.handles.append(handle)
        return handle

    def ready_engines(self) -> list[dict[str, Any]]:
        if not self.ready:
            return []
        return [{"engine_id": "0", "state": "ready", "max_model_len": self.max_model_len}]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def token_script(tokens: list[int], finish: str = "length", logprobs: bool = False, cached: int = 0) -> Script:
    """Each sequence emits `tokens` (up to max_tokens), one per output, sequences interleaved; every output
    says `cached` prompt tokens came from the prefix cache."""

    def script(add: AddRequest) -> list[RequestOutput | None]:
        n, limit = add.params.n, add.params.max_tokens
        mine = tokens[:limit]
        outs: list[RequestOutput | None] = []
        for k, token in enumerate(mine):
            for i in range(n):
                last = k == len(mine) - 1
                entry = [[-0.5, 1, [token, 5], [-0.5, -1.5]]] if logprobs else None
                outs.append(RequestOutput(add.request_id, i, [token], finish if last else None,
                                          num_prompt_tokens=len(add.prompt_token_ids), num_cached_tokens=cached,
                                          logprobs=entry))
        return outs

    return script


def make_state(tiny_llama_dir: str, tokenizer: ModelTokenizer, client: FakeClient, **config: Any) -> ApiState:
    cfg = ApiConfig(model=tiny_llama_dir, redis_url="redis://127.0.0.1:1/0", **config)
    return ApiState(cfg, tokenizer=tokenizer, client=client)


def make_app(tiny_llama_dir: str, tokenizer: ModelTokenizer, client: FakeClient, **config: Any):
    from api.app import create_app  # here, not at the top: the module stays importable without Flask

    state = make_state(tiny_llama_dir, tokenizer, client, **config)
    return create_app(state.config, state).test_client()


def sse_events(response) -> list[Any]:
    events = []
    for block in response.get_data(as_text=True).split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ----------------------------------------------------------------------------------------- Generation
