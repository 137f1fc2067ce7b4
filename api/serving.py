"""Steps shared by /v1/completions and /v1/chat/completions: prompt checks, starting a generation,
collecting it (non-streaming) or turning it into stream chunks (`api.answer`; `api.app` sends them as
server-sent events).

Rules:
- Everything that can be checked is checked before the engine sees the request: model name (404),
  token ids in the vocabulary (400). This module reads the limits (`context_length`: the READY engines'
  max_model_len); the handler fits the request to them with `api.protocol.fit_params` (prompt + max_tokens
  within max_model_len, 400). The request path runs one way: handler -> `api.protocol` (pure, on the
  request) and handler -> here (state, broker, answers); this module never imports a protocol module
  or a handler (tests/test_import_layers.py).
- Cost is bounded before work: `admit` takes the request's in-flight slots (prompts x n) right
  after parsing, before any tokenizing (429 + Retry-After when this process or the engines are
  full, 400 when the request could never fit); a text prompt longer than the context can hold in
  characters is refused before it is tokenized (`api.prompt_bound`). The slots are freed if the
  request fails before it runs, else by `Run.close()`.
- An engine whose request stream is full (`EngineOverloaded`) is a 503 engine_overloaded with
  Retry-After: the request was never sent.
- Streaming waits for the first delta before answering, so a request the engine rejects still gets
  its 4xx/5xx status; after that, an error is the stream's last chunk (an SSE error event, then
  ``data: [DONE]``).
- A client that goes away (a failed write closes the chunk stream; the socket probe notices it
  between outputs) aborts the request in the engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from api.answer import Chunk
from api.errors import ApiError, bad_request, engine_error, unavailable
from api.generation import ClientDisconnected, Generation, GenerationError
from api.metrics import IN_FLIGHT, RequestRecorder
from api.state import ApiState
from broker.errors import BrokerUnavailable, EngineOverloaded, NoEngineAvailable
from protocol.errors import MessageError
from protocol.output_processor import ChoiceOutput
from protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def check_model(state: ApiState, name: str | None) -> None:
    if not state.config.accepts_model(name):
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def token_namer(state: ApiState, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else state.tokenizer.token_text


def check_prompt_chars(state: ApiState, text: str, max_model_len: int, param: str = "prompt") -> None:
    """ApiError 400 if `text` has more characters than `max_model_len` tokens can hold (`api.prompt_bound`),
    decided without tokenizing it."""
    if state.prompt_bound.too_long(text, max_model_len):
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{len(text)} characters, more than {max_model_len} tokens can hold (at most "
            f"{state.prompt_bound.max_chars(max_model_len)}). Please reduce the length of the prompt.",
            param=param, code="context_length_exceeded")


def prompt_token_ids(state: ApiState, prompt: str | list[int], add_special_tokens: bool = True,
                     max_model_len: int | None = None) -> list[int]:
    """Tokenize a text prompt, or check a token-id prompt against the vocabulary (ApiError 400).

    With `max_model_len`, a text that cannot fit it is refused before tokenizing (`api.prompt_bound`).
    """
    if isinstance(prompt, str):
        if max_model_len is not None:
            check_prompt_chars(state, prompt, max_model_len)
        ids = state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        vocab = state.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt")
        ids = list(prompt)
    if not ids:
        raise bad_request("the prompt is empty: at least one token is required", param="prompt")
    return ids


def context_length(state: ApiState) -> int:
    """The READY engines' max_model_len (ApiError 503 without one)."""
    try:
        return state.max_model_len()
    except NoEngineAvailable as e:
        raise unavailable(f"no engine is ready: {e}") from e
    except BrokerUnavailable as e:
        raise unavailable(f"the broker is unavailable: {e}", code="broker_unavailable") from e


class Slots:
    """In-flight slots taken by `admit`. Used as ``with admit(...) as slots:`` they are freed if the
    block raises; otherwise whoever took them (a `Run`) frees them with `release()` (idempotent)."""

    def __init__(self, state: ApiState, count: int) -> None:
        self.state = state
        self.count = count
        IN_FLIGHT.labels(state.config.model_name).inc()

    def release(self) -> None:
        if self.count:
            self.state.limiter.release(self.count)
            IN_FLIGHT.labels(self.state.config.model_name).dec()
            self.count = 0

    def __enter__(self) -> Slots:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is not None:
            self.release()


def admit(state: ApiState, num_prompts: int, n: int) -> Slots:
    """Take prompts x n in-flight slots before any other work (ApiError 400: the request can never fit;
    429 + Retry-After: this process or every engine is full; 503: the broker is unavailable)."""
    limit, wanted = state.limiter.limit, num_prompts * n
    if wanted > limit:
        raise bad_request(f"this request asks for {num_prompts} prompt(s) x n={n} = {wanted} sequences; at most "
                          f"{limit} per request on this server", param="prompt" if num_prompts > limit else "n")
    try:
        state.check_engine_backlog()
    except BrokerUnavailable as e:
        raise unavailable(f"the broker is unavailable: {e}", code="broker_unavailable") from e
    state.limiter.acquire(wanted)
    return Slots(state, wanted)


class Run:
    """A started `Generation` and the in-flight slots it holds."""

    def __init__(self, state: ApiState, slots: Slots) -> None:
        self.state = state
        self.generation: Generation | None = None
        self._slots = slots

    def close(self) -> None:
        """Abort what still runs, record metrics, free the slots; idempotent."""
        if self.generation is not None:
            self.generation.close()
        self._slots.release()


def start_run(state: ApiState, prompts: list[list[int]], params: list[SamplingParams], request_id: str,
              is_disconnected: Callable[[], bool], slots: Slots) -> Run:
    """Submit every prompt, holding `slots` until the run closes; broker errors become ApiErrors."""
    run = Run(state, slots)
    try:
        run.generation = Generation(state.client, state.tokenizer, prompts, params, request_id,
                                    deadline=time.time() + state.config.request_timeout,
                                    recorder=RequestRecorder(state.config.model_name, params),
                                    is_disconnected=is_disconnected)
        run.generation.start()
    except NoEngineAvailable as e:
        run.close()
        raise unavailable(f"no engine is ready: {e}") from e
    except EngineOverloaded as e:
        run.close()
        raise unavailable(f"the engines are overloaded: {e}", code="engine_overloaded") from e
    except BrokerUnavailable as e:
        run.close()
        raise unavailable(f"the broker is unavailable: {e}", code="broker_unavailable") from e
    except MessageError as e:
        run.close()
        raise bad_request(f"the request cannot be encoded: {e}") from e
    except BaseException:
        run.close()
        raise
    return run


def collect(run: Run) -> list[ChoiceOutput]:
    """Run to the end; the choices in index order. ApiError if the request failed."""
    n = run.generation.params[0].n
    choices = [ChoiceOutput(i) for i in range(n * len(run.generation.prompts))]
    try:
        for delta in run.generation:
            choices[delta.index].add(delta)
    except GenerationError as e:
        raise engine_error(e.code, e.message) from e
    finally:
        run.close()
    return choices


def prefetched(run: Run) -> Iterator[ChoiceOutput]:
    """Wait for the first delta (so errors still become an HTTP status); all the deltas, the first included."""
    events = iter(run.generation)
    try:
        first = next(events, None)
    except GenerationError as e:
        run.close()
        raise engine_error(e.code, e.message) from e
    except BaseException:
        run.close()
        raise
    return itertools.chain([] if first is None else [first], events)


def chunk_stream(run: Run, head: Iterable[Chunk], deltas: Iterable[ChoiceOutput],
                 render: Callable[[ChoiceOutput], list[Chunk]],
                 tail: Callable[[], list[Chunk]]) -> Generator[Chunk | ApiError, None, None]:
    """A stream's chunks (`api.answer`): head chunks, one or more chunks per delta, tail chunks. A failure
    is yielded as its ApiError and ends the stream; a client that went away raises ClientDisconnected.
    Closing it (or its end) closes the run."""
    try:
        yield from head
        for delta in deltas:
            yield from render(delta)
        yield from tail()
    except GenerationError as e:
        yield engine_error(e.code, e.message)
    except ClientDisconnected:
        raise
    except Exception:
        logger.exception("request %s: failed while streaming", run.generation.request_id)
        yield ApiError(500, "internal error while streaming the response")
    finally:
        run.close()


def usage(run: Run) -> dict[str, Any]:
    """OpenAI's usage object of a run (chat and completions; /v1/responses renames it). `prompt_tokens_details`
    is always there, as OpenAI sends it: `cached_tokens` are the prompt tokens served from the prefix cache."""
    generation = run.generation
    prompt, completion = generation.prompt_tokens, generation.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}
