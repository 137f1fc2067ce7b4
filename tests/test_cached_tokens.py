"""Prefix-cache hits in usage, end to end (real Redis, engine and API processes: the session's `api_stack`, the
official openai client): `usage.prompt_tokens_details.cached_tokens` on /v1/completions and
/v1/chat/completions (whole answers and the `stream_options.include_usage` chunk) and
`usage.input_tokens_details.cached_tokens` on /v1/responses.

Each test sends a prompt of several KV blocks that starts with text of its own (so nothing is cached the first
time), then the same prompt again: the second answer counts the prompt's whole blocks as cached (the engine
always computes the prompt's last token), the first counts none. n > 1 counts the prompt once.
"""

from __future__ import annotations

import uuid

import pytest
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from broker.connection import connect
from broker.registry import EngineRegistry

STORY = ("The lighthouse keeper counted the ships that passed the rocks each night, wrote their names in a "
         "book with a green cover, and sent the book to the harbour master at the end of every month. ") * 4


@pytest.fixture(scope="module")
def block_size(api_stack) -> int:
    """The KV block size the stack's engine registered."""
    [engine] = EngineRegistry(connect(api_stack.redis_url)).ready_engines()
    return int(engine["block_size"])


def fresh_text() -> str:
    """A long text no earlier request started with."""
    return f"Log {uuid.uuid4().hex}: {STORY}"


def whole_blocks(prompt_tokens: int, block_size: int) -> int:
    """The cached tokens a repeat of a computed prompt finds: its whole blocks short of its last token."""
    return (prompt_tokens - 1) // block_size * block_size


def cached(usage: CompletionUsage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def check_hit(usage: CompletionUsage, block_size: int) -> None:
    assert usage.prompt_tokens >= 4 * block_size, "the test prompt should span several KV blocks"
    assert 0 < cached(usage) <= usage.prompt_tokens and cached(usage) % block_size == 0, usage
    assert cached(usage) == whole_blocks(usage.prompt_tokens, block_size), usage


def stream_usage(stream) -> CompletionUsage:
    """The usage of a streamed answer: its last chunk's, on no other chunk."""
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    return chunks[-1].usage


def test_completions_count_the_cached_prompt_blocks(client, model, block_size) -> None:
    prompt = fresh_text()
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert cached(first.usage) == 0 and first.usage.prompt_tokens == second.usage.prompt_tokens
    check_hit(second.usage, block_size)
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    body = raw.http_response.json()
    Completion.model_validate(body)  # the answer fits the SDK's model as sent, not only as the SDK builds it
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": cached(second.usage)}

    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    usage = stream_usage(streamed)
    assert cached(usage) == cached(second.usage) and usage.prompt_tokens == second.usage.prompt_tokens


def test_a_streamed_first_answer_counts_none(client, model, block_size) -> None:
    prompt = fresh_text()
    first = stream_usage(client.completions.create(model=model, prompt=prompt, max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True}))
    second = stream_usage(client.completions.create(model=model, prompt=prompt, max_tokens=3, stream=True,
                                                    stream_options={"include_usage": True}))
    assert cached(first) == 0
    check_hit(second, block_size)


def test_n_and_several_prompts_count_each_prompt_once(client, model, block_size) -> None:
    prompts = [fresh_text(), fresh_text()]
    first = client.completions.create(model=model, prompt=prompts, n=3, max_tokens=3, temperature=1.0)
    # the 2nd and 3rd sequences of each prompt run on its cached blocks, but the prompt was computed once
    assert len(first.choices) == 6 and cached(first.usage) == 0
    second = client.completions.create(model=model, prompt=prompts, n=3, max_tokens=3, temperature=1.0)
    singles = [client.completions.create(model=model, prompt=p, max_tokens=1).usage for p in prompts]
    assert second.usage.prompt_tokens == sum(u.prompt_tokens for u in singles)
    assert cached(second.usage) == sum(cached(u) for u in singles) == sum(
        whole_blocks(u.prompt_tokens, block_size) for u in singles) > 0


def test_chat_completions_count_the_cached_prompt_blocks(client, model, block_size) -> None:
    messages = [{"role": "user", "content": fresh_text()}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert cached(first.usage) == 0
    raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=4,
                                                           temperature=0)
    body = raw.http_response.json()
    second = ChatCompletion.model_validate(body)
    check_hit(second.usage, block_size)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": cached(second.usage)}

    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    usage = stream_usage(streamed)
    assert cached(usage) == cached(second.usage) and usage.prompt_tokens == second.usage.prompt_tokens


def test_responses_count_the_cached_input_blocks(client, model, block_size) -> None:
    text = fresh_text()
    first = client.responses.create(model=model, input=text, instructions="Be brief.", max_output_tokens=4)
    assert first.usage.input_tokens_details.cached_tokens == 0
    raw = client.responses.with_raw_response.create(model=model, input=text, instructions="Be brief.",
                                                    max_output_tokens=4)
    second = Response.model_validate(raw.http_response.json())
    hit = second.usage.input_tokens_details.cached_tokens
    assert second.usage.input_tokens >= 4 * block_size and first.usage.input_tokens == second.usage.input_tokens
    assert 0 < hit == whole_blocks(second.usage.input_tokens, block_size) and hit % block_size == 0

    events = list(client.responses.create(model=model, input=text, instructions="Be brief.", max_output_tokens=4,
                                          stream=True))
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens == hit
    assert all(e.response.usage is None for e in events[:2])  # response.created / in_progress: no usage yet
