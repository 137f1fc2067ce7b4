"""Structured outputs (JSON schema, JSON object, regex, choice, Lark grammar) through llguidance.

A request's constraint travels as a small grammar spec in its sampling parameters
(``SamplingParams.structured_output``): ``{"kind": K, "value": V}`` with K one of
``protocol.sampling_params.GRAMMAR_KINDS``; V is the schema as JSON text for "json_schema", text for
"regex" and "grammar" (Lark, or GBNF), a list of strings for "choice", absent for "json_object".

Rules:
- `protocol.grammar_spec` turns a spec into an llguidance grammar (and says why one cannot compile: the
  API's check); the engine compiles again when it builds the request's matcher (it never trusts the wire).
- The engine keeps one `LLMatcher` per constrained sequence (``Request.grammar``; n > 1: one each).
  Before a step, `StructuredOutputs.bitmasks` fills the token masks of the constrained rows that
  sample this step, in one batched llguidance call; the masks travel to the workers with the
  scheduler output, so every TP rank applies the same mask. Unconstrained steps cost nothing.
- After a step the scheduler advances the matcher with the sampled token (`grammar_finished`).
  Once the grammar is complete its mask allows only EOS, so the sequence finishes with "stop" on
  EOS (as vLLM); a failed matcher finishes it too.
- Heavy imports (llguidance's tokenizer, transformers) happen on the first constrained request.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from protocol.grammar_spec import grammar_from_spec

logger = logging.getLogger(__name__)


def grammar_finished(matcher: LLMatcher, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """Advance the matcher by the sampled token; True when the sequence must stop: EOS ended a
    complete grammar (EOS the scheduler did not stop on, e.g. with ignore_eos), or the matcher failed
    (which the mask should make impossible). A complete grammar otherwise lets only EOS through next,
    so the sequence ends on EOS, hidden from the text like any EOS."""
    if not matcher.consume_token(token_id) or matcher.is_error():
        logger.warning("structured output matcher failed at token %d: %s", token_id, matcher.get_error())
        return True
    return token_id in eos_token_ids and matcher.is_stopped()


class StructuredOutputs:
    """The engine's llguidance tokenizer (built on first use, ~1 s) and its mask executor."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.mask_words = (vocab_size + 31) // 32
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
            self._tokenizer = from_tokenizer(hf, n_vocab=max(self.vocab_size, len(hf)),
                                             eos_token=self.eos_token_ids or None)
            self._executor = LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
        return self._tokenizer

    def matcher(self, spec: dict[str, Any]) -> LLMatcher:
        """A fresh matcher for one sequence. Raises ValueError when the grammar does not compile."""
        grammar = grammar_from_spec(spec)
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {matcher.get_error()}")
        return matcher

    def bitmasks(self, rows: list[tuple[str, LLMatcher]]) -> dict[str, bytes]:
        """The next-token bitmask (little-endian int32 words, bit i = token i allowed) of each row."""
        if not rows:
            return {}
        masks = np.zeros((len(rows), self.mask_words), dtype=np.int32)
        self._llg_tokenizer()
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, (_, m) in enumerate(rows)],
                                               masks.ctypes.data, self.mask_words * 4, len(rows))
        return {req_id: masks[i].tobytes() for i, (req_id, _) in enumerate(rows)}
