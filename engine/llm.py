"""Offline inference, vLLM-style: ``LLM(model=DIR_OR_GGUF).generate(prompts, SamplingParams(...))``.

Rules:
- Each prompt is one engine request; its outputs go through the API's output processor
  (`protocol.output_processor`): the same text, stop strings (searched incrementally), finish reasons and
  token counts as the HTTP answer. A stop string stops its sequence in the engine at once (the request, once
  every choice is done).
- A ``CompletionOutput`` is one choice's deltas joined; ``RequestOutput.prompt_logprobs`` is
  ``[None, entry for token 1, ...]`` when ``params.prompt_logprobs`` is set.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm
from transformers import AutoTokenizer

from engine.core import EngineCore
from protocol.messages import RequestOutput as EngineOutput
from protocol.output_processor import ChoiceOutput, PromptOutputs
from protocol.sampling_params import SamplingParams
from worker.config import EngineConfig

CompletionOutput = ChoiceOutput  # vLLM's name for one choice's whole output


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None  # [None, entry for token 1, ...] when params.prompt_logprobs is set

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class LLM:
    """Runs an ``EngineCore`` in this process until every prompt is done.

    ``prompts`` is a string, a list of strings, a list of token ids, or a list of token-id lists.
    ``sampling_params`` is one ``SamplingParams`` for all prompts or one per prompt. Extra keyword
    arguments are ``EngineConfig`` fields (block_size, max_num_seqs, num_kv_blocks, ...).
    """

    def __init__(self, model: str, dtype: str = "auto", tensor_parallel_size: int = 1, seed: int = 0,
                 pipeline_parallel_size: int = 1, **engine_kwargs):
        self.config = EngineConfig(model=model, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                                   pipeline_parallel_size=pipeline_parallel_size,
                                   seed=seed, **engine_kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)  # a GGUF's converted dir
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True) -> list[RequestOutput]:
        """``use_tqdm`` (as vLLM): a progress bar on stderr (prompts done, input and output tokens/s);
        False for none, or a callable that makes the bar (``tqdm.tqdm``'s signature)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, RequestOutput] = {}
        processors: dict[str, PromptOutputs] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, token_ids, params)
            processors[request_id] = PromptOutputs(0, self.tokenizer, token_ids, params)
            results[request_id] = RequestOutput(
                request_id, prompt if isinstance(prompt, str) else None, token_ids,
                [CompletionOutput(i) for i in range(params.n)])
        progress = _Progress(use_tqdm, len(results))
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id]
                    self._apply(result, processors[out.request_id], out)
                    progress.update(result, len(out.new_token_ids))
        finally:
            progress.close()
        return list(results.values())

    def _apply(self, result: RequestOutput, processor: PromptOutputs, out: EngineOutput) -> None:
        processed = processor.apply(out)
        delta = processed.delta
        if delta is not None:
            if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
                result.prompt_logprobs = [None, *delta.prompt_logprobs]
            delta.prompt_logprobs = None
            result.outputs[delta.index].add(delta)
        result.num_cached_tokens = processor.cached_tokens
        if processed.abort_sequence is not None:
            self.engine.abort_sequence(result.request_id, processed.abort_sequence)
        if processed.abort_request:
            self.engine.abort_request([result.request_id])

    def shutdown(self) -> None:
        self.engine.shutdown()


class _Progress:
    """The progress bar of one ``generate`` call: a tick per finished request, vLLM's speed postfix."""

    def __init__(self, use_tqdm: bool | Callable[..., tqdm], total: int):
        make = use_tqdm if callable(use_tqdm) else tqdm
        self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True) if use_tqdm else None
        self.done: set[str] = set()
        self.input_tokens = self.output_tokens = 0

    def update(self, result: RequestOutput, new_tokens: int) -> None:
        if self.bar is None:
            return
        self.output_tokens += new_tokens
        if not result.finished or result.request_id in self.done:
            return
        self.done.add(result.request_id)
        self.input_tokens += len(result.prompt_token_ids)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        self.bar.set_postfix_str(f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
