"""The API layer over a scripted, in-process broker client: no Redis, no engine, no gunicorn.

Covers `api.generation` (stop strings, n > 1, errors, disconnects) and the Flask app (shapes of
answers, every error status, streaming errors) with the Flask test client.
"""

from __future__ import annotations

import json
import threading

import pytest
from fake_broker import FakeClient, make_app, sse_events, token_script

from api.app import sse_body
from api.errors import ApiError, sse_error
from api.generation import ClientDisconnected, Generation, GenerationError
from api.tokenizer import ModelTokenizer
from protocol.messages import AddRequest, ErrorCode, RequestOutput
from protocol.sampling_params import SamplingParams

TEXT = "Hello world, this is a test. STOP here and more text follows"


@pytest.fixture
def text_tokens(tokenizer: ModelTokenizer) -> list[int]:
    return tokenizer.encode(TEXT)


def run_generation(client: FakeClient, tokenizer: ModelTokenizer, params: SamplingParams, prompts=None, **kw):
    gen = Generation(client, tokenizer, prompts or [[10, 11]], params, "req", poll_interval=0.02, **kw).start()
    texts: dict[int, str] = {}
    finish: dict[int, tuple] = {}
    with gen:
        for delta in gen:
            texts[delta.index] = texts.get(delta.index, "") + delta.text
            if delta.finish_reason is not None:
                finish[delta.index] = (delta.finish_reason, delta.stop_reason)
    return gen, texts, finish


def test_generation_plain(tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens))
    gen, texts, finish = run_generation(client, tokenizer, SamplingParams(max_tokens=100))
    assert texts == {0: TEXT} and finish == {0: ("length", None)}
    assert gen.completion_tokens == len(text_tokens) and gen.prompt_tokens == 2
    assert not client.handles[0].aborted


def test_generation_stop_string_aborts_the_engine(tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens))
    gen, texts, finish = run_generation(client, tokenizer, SamplingParams(max_tokens=100, stop=["STOP"]))
    assert texts == {0: "Hello world, this is a test. "} and finish == {0: ("stop", "STOP")}
    assert client.handles[0].aborted
    consumed = len(tokenizer.encode("Hello world, this is a test. STOP"))
    assert gen.completion_tokens <= consumed + 1 < len(text_tokens)


def test_generation_stop_string_in_one_of_n_stops_only_that_sequence(tokenizer, text_tokens) -> None:
    other_text = "a plain sentence that runs on and on, " * 4
    other = tokenizer.encode(other_text)

    def script(add: AddRequest) -> list[RequestOutput | None]:
        outs: list[RequestOutput | None] = []
        for k in range(max(len(text_tokens), len(other))):
            for i, tokens in enumerate((text_tokens, other)):
                if k < len(tokens):
                    outs.append(RequestOutput(add.request_id, i, [tokens[k]], "length" if k == len(tokens) - 1 else None))
        return outs

    client = FakeClient(script)
    _, texts, finish = run_generation(client, tokenizer, SamplingParams(n=2, max_tokens=100, stop=["STOP"]))
    assert finish[0] == ("stop", "STOP") and texts[0] == "Hello world, this is a test. "
    assert finish[1] == ("length", None) and texts[1] == other_text
    assert client.handles[0].aborted_sequences == [0]


def test_generation_include_stop_str(tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens))
    params = SamplingParams(max_tokens=100, stop=["STOP"], include_stop_str_in_output=True)
    _, texts, _ = run_generation(client, tokenizer, params)
    assert texts == {0: "Hello world, this is a test. STOP"}


def test_generation_stop_token_is_counted_but_not_shown(tokenizer, text_tokens) -> None:
    def script(add: AddRequest) -> list[RequestOutput | None]:
        outs: list[RequestOutput | None] = [RequestOutput(add.request_id, 0, [t]) for t in text_tokens[:3]]
        return [*outs, RequestOutput(add.request_id, 0, [text_tokens[3]], "stop", stop_reason=text_tokens[3])]

    for include, shown in ((False, 3), (True, 4)):
        params = SamplingParams(max_tokens=100, stop_token_ids=[text_tokens[3]], include_stop_str_in_output=include)
        gen, texts, finish = run_generation(FakeClient(script), tokenizer, params)
        assert texts == {0: tokenizer.decode(text_tokens[:shown])}
        assert finish == {0: ("stop", text_tokens[3])} and gen.completion_tokens == 4


def test_generation_n2_aborts_only_when_every_choice_is_done(tokenizer, text_tokens) -> None:
    stop_at = text_tokens.index(tokenizer.encode(" test")[0]) if tokenizer.encode(" test")[0] in text_tokens else 3

    def script(add: AddRequest) -> list[RequestOutput | None]:
        outs: list[RequestOutput | None] = []
        for k, token in enumerate(text_tokens):
            outs.append(RequestOutput(add.request_id, 0, [token]))
            if k <= stop_at:
                outs.append(RequestOutput(add.request_id, 1, [token], "length" if k == stop_at else None))
        return outs

    client = FakeClient(script)
    _, texts, finish = run_generation(client, tokenizer, SamplingParams(max_tokens=100, n=2, stop=["STOP"]))
    assert finish[0] == ("stop", "STOP") and finish[1] == ("length", None)
    assert texts[0] == "Hello world, this is a test. "
    assert client.handles[0].aborted


def test_generation_several_prompts(tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens[:4]))
    gen, texts, finish = run_generation(client, tokenizer, SamplingParams(max_tokens=10, n=2),
                                        prompts=[[1, 2], [3, 4, 5]])
    assert sorted(texts) == [0, 1, 2, 3] and all(t == tokenizer.decode(text_tokens[:4]) for t in texts.values())
    assert [h.request_id for h in client.handles] == ["req-0", "req-1"]
    assert gen.prompt_tokens == 5 and gen.completion_tokens == 16


def test_generation_counts_each_prompts_cached_tokens_once(tokenizer, text_tokens) -> None:
    """Per prompt, the lowest count of its sequences (the one that computed the prompt; the others ran on its
    cached blocks), each sequence's count taken from its first output (a resumed sequence's engine counts
    from a longer prompt), never more than the prompt."""
    counts = {"req-0": ([0, 32, 32], 64), "req-1": ([48, 16, 48], 20), "req-2": ([], 0)}

    def script(add: AddRequest) -> list[RequestOutput | None]:
        firsts, later = counts[add.request_id]
        outs: list[RequestOutput | None] = []
        for k, token in enumerate(text_tokens[:3]):
            for i in range(3):
                outs.append(RequestOutput(add.request_id, i, [token], "length" if k == 2 else None,
                                          num_cached_tokens=firsts[i] if k == 0 and firsts else later))
        return outs

    gen, texts, _ = run_generation(FakeClient(script), tokenizer, SamplingParams(max_tokens=3, n=3),
                                   prompts=[list(range(40)), list(range(12)), list(range(30))])
    assert len(texts) == 9 and gen.prompt_tokens == 82
    assert gen.cached_tokens == 0 + 12 + 0  # the second prompt's 16 is more than its 12 tokens


def test_cached_tokens_in_every_usage(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens, cached=2)))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for path, body in (("/v1/completions", {"prompt": ["one two three", "four five six"], "n": 2, "max_tokens": 3}),
                       ("/v1/chat/completions", chat)):
        answer = http.post(path, json=body).get_json()
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * len(body.get("prompt", [0]))}
        events = sse_events(http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}}))
        assert events[-2]["usage"] == answer["usage"]
    reply = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3}).get_json()
    assert reply["usage"]["input_tokens_details"] == {"cached_tokens": 2, "cache_write_tokens": 0}


class FailureRecorder:
    """Keeps the error code a generation reports to its metrics recorder."""

    error: str | None = None

    def on_tokens(self, choice: int, count: int) -> None:
        pass

    def on_finish(self, prompt_tokens: int, completion_tokens: int, reasons: list[str], error: str | None) -> None:
        self.error = error


def test_generation_error_output_raises(tokenizer) -> None:
    client = FakeClient(lambda add: [RequestOutput.failure(add.request_id, ErrorCode.INVALID_REQUEST, "bad")])
    recorder = FailureRecorder()
    with pytest.raises(GenerationError) as info:
        run_generation(client, tokenizer, SamplingParams(), recorder=recorder)
    assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.message == "bad"
    assert recorder.error is ErrorCode.INVALID_REQUEST  # the metrics' failure label is the code, not prose


def test_generation_disconnect_aborts(tokenizer) -> None:
    client = FakeClient(lambda add: [RequestOutput(add.request_id, 0, [10]), None])
    recorder = FailureRecorder()
    with pytest.raises(ClientDisconnected):
        run_generation(client, tokenizer, SamplingParams(), is_disconnected=lambda: True, recorder=recorder)
    assert client.handles[0].aborted
    assert recorder.error is ErrorCode.CLIENT_DISCONNECTED  # the metrics' failure label


# ----------------------------------------------------------------------------------------- HTTP app

def test_completion_response_shape(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)))
    r = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi there", "max_tokens": 5})
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
    assert body["choices"][0]["text"] == tokenizer.decode(text_tokens[:5])
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = len(tokenizer.encode("hi there"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 5, "total_tokens": prompt_len + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_model_may_be_named_by_path(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)))
    assert http.post("/v1/completions", json={"model": tiny_llama_dir, "prompt": "x"}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_echo_and_logprobs(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens, logprobs=True)))
    r = http.post("/v1/completions", json={"prompt": [10, 11], "max_tokens": 3, "echo": True, "logprobs": 1})
    choice = r.get_json()["choices"][0]
    prompt_text = tokenizer.decode([10, 11])
    assert choice["text"] == prompt_text + tokenizer.decode(text_tokens[:3])
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert lp["token_logprobs"][:2] == [None, None] and lp["token_logprobs"][2:] == [-0.5] * 3
    assert lp["text_offset"][0] == 0 and lp["text_offset"][2] == len(tokenizer.token_text(10) + tokenizer.token_text(11))
    assert tokenizer.token_text(text_tokens[0]) in lp["top_logprobs"][2]


def test_chat_shapes(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens, logprobs=True)))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    r = http.post("/v1/chat/completions", json=body).get_json()
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(text_tokens[:4])}
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and len(content[0]["top_logprobs"]) == 2 and content[0]["logprob"] == -0.5
    events = sse_events(http.post("/v1/chat/completions", json={**body, "stream": True,
                                                                 "stream_options": {"include_usage": True}}))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 4
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == tokenizer.decode(text_tokens[:4])
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_streamed_text_equals_non_streamed(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)))
    body = {"prompt": "x", "max_tokens": 50, "n": 2, "stop": ["STOP"]}
    whole = http.post("/v1/completions", json=body).get_json()
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}))
    for i in range(2):
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i)
        assert streamed == whole["choices"][i]["text"] == "Hello world, this is a test. "
        assert whole["choices"][i]["finish_reason"] == "stop" and whole["choices"][i]["stop_reason"] == "STOP"


def test_api_key(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)), api_key="sekret")
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.get_json()["error"]["type"] == "authentication_error"
    assert http.post("/v1/completions", json={"prompt": "x"},
                     headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.post("/v1/completions", json={"prompt": "x"},
                     headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").status_code == 401


@pytest.mark.parametrize("method,path,body,status", [
    ("post", "/v1/nope", {}, 404),
    ("get", "/v1/completions", None, 405),
    ("post", "/v1/completions", {"model": "other", "prompt": "x"}, 404),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": "a"}, 400),
    ("post", "/v1/completions", {"prompt": [5000]}, 400),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400),
    ("post", "/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400),
    ("post", "/v1/completions", {"prompt": ""}, 400),
    ("post", "/v1/chat/completions", {"messages": []}, 400),
    ("post", "/detokenize", {"tokens": [-1]}, 400),
])
def test_error_statuses(tiny_llama_dir, tokenizer, text_tokens, method, path, body, status) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)))
    r = getattr(http, method)(path, json=body)
    assert r.status_code == status
    error = r.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_invalid_json_and_oversized_body(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)), max_body_bytes=2048)
    for raw in (b"{not json", b'{"prompt": "x", "temperature": NaN}', b"\xff\xfe", b"", b"[" * 1500):
        r = http.post("/v1/completions", data=raw, content_type="application/json")
        assert r.status_code == 400, raw
    r = http.post("/v1/completions", data=json.dumps({"prompt": "x" * 5000}), content_type="application/json")
    assert r.status_code == 413 and "error" in r.get_json()


def test_no_engine_is_503(tiny_llama_dir, tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens))
    client.ready = False
    http = make_app(tiny_llama_dir, tokenizer, client)
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["Retry-After"]
    client.ready = True
    assert http.get("/health").status_code == 200


def test_liveness_needs_no_engine_and_no_key(tiny_llama_dir, tokenizer, text_tokens) -> None:
    """/livez (liveness) is 200 while this process serves, engine or not; /health and /readyz (readiness) 503."""
    client = FakeClient(token_script(text_tokens))
    client.ready = False
    http = make_app(tiny_llama_dir, tokenizer, client, api_key="sekret")
    live = http.get("/livez")
    assert live.status_code == 200 and live.get_json() == {"status": "ok"}
    assert http.get("/health").status_code == 503 and http.get("/readyz").status_code == 503
    assert http.get("/version").status_code == 401
    client.ready = True
    assert [http.get(path).status_code for path in ("/livez", "/health", "/readyz")] == [200, 200, 200]


def test_engine_rejection_before_streaming_keeps_its_status(tiny_llama_dir, tokenizer) -> None:
    client = FakeClient(lambda add: [RequestOutput.failure(add.request_id, ErrorCode.INVALID_REQUEST, "nope")])
    http = make_app(tiny_llama_dir, tokenizer, client)
    for stream in (False, True):
        r = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 400 and r.get_json()["error"]["message"] == "nope"


def test_error_after_streaming_began_is_an_sse_event(tiny_llama_dir, tokenizer) -> None:
    client = FakeClient(lambda add: [RequestOutput(add.request_id, 0, [10]),
                                     RequestOutput.failure(add.request_id, ErrorCode.ENGINE_GONE, "gone")])
    http = make_app(tiny_llama_dir, tokenizer, client)
    r = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_gone"
    assert events[-2]["error"]["message"] == "gone"


def test_too_many_in_flight_is_429(tiny_llama_dir, tokenizer) -> None:
    client = FakeClient(lambda add: [RequestOutput(add.request_id, 0, [10]), None])
    http = make_app(tiny_llama_dir, tokenizer, client, max_queued_requests=1)
    first = http.post("/v1/completions", json={"prompt": "x", "stream": True}, buffered=False)
    assert first.status_code == 200
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    many = http.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert many.status_code == 400 and many.get_json()["error"]["param"] == "prompt"  # can never fit
    first.close()  # the client goes away: the stream's generator closes and aborts
    assert client.handles[0].aborted
    client.script = token_script([10, 11])
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_unexpected_errors_are_500_and_the_app_keeps_serving(tiny_llama_dir, tokenizer, text_tokens) -> None:
    client = FakeClient(token_script(text_tokens))
    http = make_app(tiny_llama_dir, tokenizer, client)
    client.submit_error = RuntimeError("boom")
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500 and r.get_json()["error"]["type"] == "server_error"
    client.submit_error = None
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_tokenize_and_detokenize(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens), max_model_len=77))
    r = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).get_json()
    assert r["tokens"] == text_tokens and r["count"] == len(text_tokens) and r["max_model_len"] == 77
    assert len(r["token_strs"]) == len(text_tokens)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).get_json()
    assert chat["tokens"][0] == 2  # <|im_start|>
    assert http.post("/detokenize", json={"tokens": text_tokens}).get_json() == {"prompt": TEXT}


def test_models_and_version(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens), max_model_len=77),
                    served_model_names=["a", "b"])
    data = http.get("/v1/models").get_json()["data"]
    assert [m["id"] for m in data] == ["a", "b"] and data[0]["max_model_len"] == 77 and data[0]["root"]
    assert http.get("/version").get_json()["version"]


def test_concurrent_requests_share_one_state(tiny_llama_dir, tokenizer, text_tokens) -> None:
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script(text_tokens)))
    results: list[int] = []

    def one() -> None:
        results.append(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8}).status_code)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 16


def test_the_api_never_imports_torch(tiny_llama_dir) -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import api.server\n"
        "from api.app import create_app\n"
        "from api.config import ApiConfig\n"
        f"app = create_app(ApiConfig(model={tiny_llama_dir!r}, redis_url='redis://127.0.0.1:1/0'))\n"
        "r = app.test_client().post('/tokenize', json={'messages': [{'role': 'user', 'content': 'hi'}]})\n"
        "assert r.status_code == 200, r.get_data()\n"
        "loaded = [m for m in ('torch', 'engine', 'worker') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stream_whose_last_delta_has_no_text_still_carries_finish_reason(tiny_llama_dir, tokenizer, text_tokens,
                                                                         route) -> None:
    """The stop token is hidden, so the finishing output adds no text: a chunk must still say why it ended."""
    stop_token = 2  # any id: the output that finishes with "stop" hides its last token
    http = make_app(tiny_llama_dir, tokenizer, FakeClient(token_script([*text_tokens[:3], stop_token], finish="stop")))
    body = {"max_tokens": 8, "stream": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    events = sse_events(http.post(route, json=body))
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"] is not None]
    assert finishes == ["stop"]


def test_sse_body_frames_chunks_errors_and_done() -> None:
    closed: list[bool] = []

    def chunks(end: BaseException | ApiError | None):
        try:
            yield {"text": "é"}
            if isinstance(end, ApiError):
                yield end
            elif end is not None:
                raise end
        finally:
            closed.append(True)

    assert list(sse_body(chunks(None))) == ['data: {"text":"é"}\n\n', "data: [DONE]\n\n"]
    error = ApiError(503, "gone", code="engine_gone")
    assert list(sse_body(chunks(error)))[1:] == [sse_error(error), "data: [DONE]\n\n"]
    assert list(sse_body(chunks(ClientDisconnected("req")))) == ['data: {"text":"é"}\n\n']  # nothing after
    held = chunks(None)  # still referenced here, as a traceback may hold it: closing the body must close it
    body = sse_body(held)
    next(body)
    closed.clear()
    body.close()
    assert closed == [True]
