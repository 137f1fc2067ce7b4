"""Safe to expose: the API key on every route but /health, no caller templates unless trusted, bounded
template rendering, and caller text escaped in log lines.

Through real HTTP (the session `api_stack`: Redis + engine + `redserve api --api-key test-key`, plus API
servers spawned here with other flags); log lines through the Flask test client and the batch runner.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from api.answer import Answer
from api.app import create_app
from api.batch import runner as batch_runner
from api.batch.records import BatchRequest
from api.chat_template import RESERVED_TEMPLATE_KWARGS, TemplateLimitExceeded
from api.config import ApiConfig
from api.log_safety import printable
from api.state import ApiState
from api.tokenizer import ModelTokenizer
from worker.models.tiny_model import CHAT_TEMPLATE

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
CALLER_TEMPLATE = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


def loops(body: str) -> str:
    """Two nested loops of 100,000 iterations (10**10 in all) around `body`."""
    return f"{{%- for i in range(100000) -%}}{{%- for j in range(100000) -%}}{body}{{%- endfor -%}}{{%- endfor -%}}"



# The tiny model's own template, unless the request asks for a pathological branch (a kwarg picks it).
LOOPING_TEMPLATE = ("{%- if mode == 'time' -%}" + loops("") +
                    "{%- elif mode == 'size' -%}" + loops("{{ 'x' * 100 }}") +
                    "{%- else -%}" + CHAT_TEMPLATE + "{%- endif -%}")
CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]}],
    [{"role": "user", "content": "a\nb <|im_end|> ü"}, {"role": "assistant", "content": None}],
]


# ------------------------------------------------------------------------------------------ API key

@pytest.mark.parametrize(("method", "path", "body"), [
    ("post", "/tokenize", {"prompt": "hi"}),
    ("post", "/detokenize", {"tokens": [5, 6]}),
    ("get", "/version", None),
    ("get", "/metrics", None),
    ("get", "/v1/models", None),
    ("post", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("get", "/no-such-route", None),
])
def test_every_route_but_health_needs_the_key(api_stack, method, path, body) -> None:
    url = api_stack.base_url + path
    bare = requests.request(method, url, json=body, timeout=30)
    assert bare.status_code == 401, bare.text
    assert bare.json()["error"]["code"] == "invalid_api_key"
    wrong = requests.request(method, url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401
    keyed = requests.request(method, url, json=body, headers=AUTH, timeout=60)
    assert keyed.status_code == (404 if path == "/no-such-route" else 200), keyed.text
    assert requests.get(f"{api_stack.base_url}/health", timeout=10).status_code == 200


# -------------------------------------------------------------------------------- caller templates

@pytest.mark.parametrize("body", [
    {"messages": USER, "chat_template": CALLER_TEMPLATE},
    {"messages": USER, "chat_template_kwargs": {"chat_template": CALLER_TEMPLATE}},
])
@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_caller_template_is_refused_by_default(api_stack, route, body) -> None:
    r = requests.post(api_stack.base_url + route, json={**body, "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert "--trust-request-chat-template" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", sorted(RESERVED_TEMPLATE_KWARGS))
def test_reserved_template_kwargs_are_refused(tiny_llama_dir, name) -> None:
    tokenizer = ModelTokenizer(tiny_llama_dir, trust_request_chat_template=True)
    with pytest.raises(ValueError, match="may not set"):
        tokenizer.render_chat(USER, True, **{name: True})


def test_reserved_template_kwargs_are_400_over_http(api_stack) -> None:
    body = {"messages": USER, "chat_template_kwargs": {"messages": [], "add_generation_prompt": False}}
    for route in ("/tokenize", "/v1/chat/completions"):
        r = requests.post(api_stack.base_url + route, json=body, headers=AUTH, timeout=30)
        assert r.status_code == 400 and "may not set" in r.json()["error"]["message"], r.text


def test_trusted_server_renders_caller_templates_and_may_open_metrics(api_stack) -> None:
    proc, base = api_stack.spawn_api("api-trusting", "--api-key", KEY, "--trust-request-chat-template",
                                     "--public-metrics", workers=1)
    try:
        api_stack.wait_healthy(base, timeout=90, watch=(proc,))
        expected = ModelTokenizer(api_stack.model_dir).encode("[hi]", add_special_tokens=False)
        for body in ({"messages": USER, "chat_template": CALLER_TEMPLATE},
                     {"messages": USER, "chat_template_kwargs": {"chat_template": CALLER_TEMPLATE}}):
            r = requests.post(f"{base}/tokenize", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 200 and r.json()["tokens"] == expected, r.text
        chat = {"messages": USER, "chat_template": CALLER_TEMPLATE, "max_tokens": 2}
        r = requests.post(f"{base}/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected), r.text
        assert requests.get(f"{base}/metrics", timeout=10).status_code == 200
        assert requests.post(f"{base}/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401
    finally:
        assert api_stack.stop_process(proc) == 0


# ------------------------------------------------------------------------------- bounded rendering

def test_rendering_is_transformers_own(tiny_llama_dir) -> None:
    tokenizer = ModelTokenizer(tiny_llama_dir)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            ours = tokenizer.render_chat(messages, add_generation_prompt)
            theirs = tokenizer.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                             tokenize=False)
            assert ours == theirs
    ranges = "{% for m in messages %}{{ range(3)|list }}{{ range(7)|length }}{{ range(9)[2:5]|list }}{% endfor %}"
    trusting = ModelTokenizer(tiny_llama_dir, trust_request_chat_template=True)
    assert trusting.render_chat(USER, True, chat_template=ranges) == "[0, 1, 2]7[2, 3, 4]"


def test_rendering_is_bounded_in_time_and_size(tiny_llama_dir) -> None:
    tokenizer = ModelTokenizer(tiny_llama_dir, trust_request_chat_template=True, render_timeout=0.5,
                               max_render_chars=10_000)
    with pytest.raises(TemplateLimitExceeded, match="exceeded 0.5 s"):
        tokenizer.render_chat(USER, True, chat_template=loops(""))
    with pytest.raises(TemplateLimitExceeded, match="exceeded 10000 characters"):
        tokenizer.render_chat(USER, True, chat_template=loops("{{ 'x' * 100 }}"))
    macro = ("{% macro f() %}{% for i in range(100000) %}{{ caller() }}{% endfor %}{% endmacro %}"
             "{% for i in range(100000) %}{% call f() %}{% endcall %}{% endfor %}")
    with pytest.raises(TemplateLimitExceeded):
        tokenizer.render_chat(USER, True, chat_template=macro)
    assert tokenizer.render_chat(USER, True) == tokenizer.tokenizer.apply_chat_template(
        USER, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def looping_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A copy of the tiny model whose own chat template loops forever when asked to."""
    out = tmp_path_factory.mktemp("looping") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, out)
    config_path = Path(out, "tokenizer_config.json")
    config = json.loads(config_path.read_text())
    config["chat_template"] = LOOPING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(out)


def test_pathological_server_template_is_cut_off_while_others_are_served(api_stack, looping_model_dir) -> None:
    proc, base = api_stack.spawn_api("api-looping", "--model", looping_model_dir, "--chat-template-timeout", "4",
                                     workers=1)
    try:
        api_stack.wait_healthy(base, timeout=90, watch=(proc,))
        stuck: dict[str, Any] = {}

        def render(mode: str) -> None:
            body = {"messages": USER, "chat_template_kwargs": {"mode": mode}}
            stuck[mode] = requests.post(f"{base}/tokenize", json=body, timeout=120)

        slow = threading.Thread(target=render, args=("time",))
        slow.start()
        normal = requests.post(f"{base}/tokenize", json={"messages": USER}, timeout=60)
        assert normal.status_code == 200 and normal.json()["count"] > 0, normal.text
        assert slow.is_alive(), "the looping render ended before a parallel request was served"
        slow.join(timeout=120)
        assert stuck["time"].status_code == 400, stuck["time"].text
        assert "chat template rendering exceeded 4 s" in stuck["time"].json()["error"]["message"]
        render("size")
        assert stuck["size"].status_code == 400, stuck["size"].text
        assert "characters" in stuck["size"].json()["error"]["message"]
        chat = {"messages": USER, "max_tokens": 2}
        assert requests.post(f"{base}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    finally:
        assert api_stack.stop_process(proc) == 0


# ------------------------------------------------------------------------------------- log lines

HOSTILE = "x\r\nFAKE 200 OK\x1b[31mred\x1b[0m\u2028end"


def test_printable_is_one_escaped_line() -> None:
    text = printable(HOSTILE)
    assert text == "x\\r\\nFAKE 200 OK\\x1b[31mred\\x1b[0m\\u2028end"
    assert text.isprintable() and text.isascii()
    assert printable("a\\nb") == "a\\\\nb"  # a literal backslash-n is not an escaped newline
    assert printable("y" * 500, limit=10) == "yyyyyyyyyy...(500 chars)"
    assert printable(None) == "None"


def test_request_path_in_log_lines_is_escaped(tiny_llama_dir, caplog) -> None:
    config = ApiConfig(model=tiny_llama_dir, redis_url="redis://127.0.0.1:1/0", api_key="sekret")
    http = create_app(config, ApiState(config, client=object())).test_client()
    caplog.set_level(logging.DEBUG, logger="api.app")
    response = http.get("/v1/models%0d%0aFAKE%20200%20OK%1b[31m%e2%80%a8")
    assert response.status_code == 401
    records = [r for r in caplog.records if r.name == "api.app"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert "/v1/models\\r\\nFAKE 200 OK\\x1b[31m\\u2028 -> 401" in line


def test_batch_custom_id_in_log_lines_is_escaped(monkeypatch, caplog) -> None:
    answers = iter([(429, "busy\nFAKE"), (200, "ok")])

    def transient_then_ok(state, body, connected):
        status, message = next(answers)
        return Answer(status, {"error": {"message": message}} if status != 200 else {"ok": True})

    def broken(state, body, connected):
        raise RuntimeError("boom")

    monkeypatch.setitem(batch_runner._HANDLERS, "/v1/completions", transient_then_ok)
    monkeypatch.setitem(batch_runner._HANDLERS, "/v1/chat/completions", broken)
    runner = batch_runner.ItemRunner(state=None, retry_for=60)
    monkeypatch.setattr(batch_runner.time, "sleep", lambda _: None)
    caplog.set_level(logging.INFO, logger="api.batch.runner")
    assert runner.run(BatchRequest(HOSTILE, "/v1/completions", {}))[0] == 200
    assert runner.run(BatchRequest(HOSTILE, "/v1/chat/completions", {}))[0] == 500
    lines = [r.getMessage() for r in caplog.records if r.name == "api.batch.runner"]
    assert len(lines) == 2
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line
        assert printable(HOSTILE) in line
    assert "busy\\nFAKE" in lines[0]
