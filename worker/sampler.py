"""Turns a step's logits into tokens, per request: greedy, temperature, top-k, top-p, min-p, seeds,
repetition/presence/frequency penalties, min_tokens, structured-output token masks, and logprobs with top-N.

Order (as vLLM): grammar mask -> raw logprobs -> min_tokens mask -> penalties -> temperature -> min_p -> top_k/top_p ->
sample. Sampling draws one exponential variate per vocabulary entry and takes argmax(p / q) (the
Gumbel-max equivalent); a seeded request draws from its own generator, so its tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.step_types import SampledToken


@dataclass
class SamplingBatch:
    """Per-row parameters for the rows being sampled this step (one row per request)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    repetition_penalty: list[float]
    presence_penalty: list[float]
    frequency_penalty: list[float]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    stop_token_masks: list[list[int]] = field(default_factory=list)
    grammar_bitmasks: list[bytes | None] = field(default_factory=list)  # structured output: int32 bit words

    @property
    def all_greedy(self) -> bool:
        return all(t < 1e-5 for t in self.temperature)

    @property
    def needs_penalties(self) -> bool:
        return (any(p != 1.0 for p in self.repetition_penalty) or any(self.presence_penalty)
                or any(self.frequency_penalty))


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.default_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        logits = logits.float()
        if any(m is not None for m in batch.grammar_bitmasks):
            logits = apply_grammar_bitmasks(logits, batch.grammar_bitmasks)
        raw_logprobs = None
        if any(n is not None for n in batch.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(batch.stop_token_masks):
            logits = logits.clone()
            for row, ids in enumerate(batch.stop_token_masks):
                if ids:
                    logits[row, ids] = float("-inf")
        if batch.needs_penalties:
            logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, batch)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return [SampledToken(t) for t in token_list]
        return [SampledToken(t, None if batch.num_logprobs[row] is None
                             else _logprobs(raw_logprobs[row], t, batch.num_logprobs[row]))
                for row, t in enumerate(token_list)]

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor(batch.temperature, device=device)
        greedy = temperature < 1e-5
        greedy_tokens = logits.argmax(dim=-1)
        logits = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        if any(batch.min_p):
            probs = torch.softmax(logits, dim=-1)
            min_p = torch.tensor(batch.min_p, device=device).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(batch.top_k) or any(p < 1.0 for p in batch.top_p):
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        for row, gen in enumerate(batch.generators):
            q[row].exponential_(generator=gen or self.default_generator)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)


def apply_grammar_bitmasks(logits: torch.Tensor, masks: list[bytes | None]) -> torch.Tensor:
    """Set to -inf the logits of the tokens a row's grammar forbids (bit i of its int32 words clear;
    tokens past the mask's end are forbidden). Rows without a mask are untouched."""
    rows = [row for row, mask in enumerate(masks) if mask is not None]
    vocab = logits.shape[1]
    words = torch.frombuffer(bytearray(b"".join(masks[row] for row in rows)), dtype=torch.int32)
    words = words.view(len(rows), -1).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(rows, vocab, device=device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
    for row in range(rows):
        out = torch.tensor(batch.output_token_ids[row], dtype=torch.long, device=device)
        counts[row].index_add_(0, out, torch.ones(out.numel(), device=device))
        seen[row, batch.prompt_token_ids[row]] = True
    seen |= counts > 0
    rep = torch.tensor(batch.repetition_penalty, device=device).unsqueeze(1).expand(rows, vocab)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - torch.tensor(batch.frequency_penalty, device=device).unsqueeze(1) * counts
    return logits - torch.tensor(batch.presence_penalty, device=device).unsqueeze(1) * (counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = positions >= ks.unsqueeze(1)
    ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs
    remove |= cumulative > ps
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def prompt_logprob_entries(logits: torch.Tensor, next_token_ids: list[int], top_n: int) -> list[list]:
    """One ``[logprob, rank, top_ids, top_logprobs]`` entry per row: the raw log-softmax of the row
    at its next (prompt) token, that token's rank, and the row's top-N."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    if top_n:
        values, ids = logprobs.topk(top_n, dim=-1)
        top_ids, top_values = ids.tolist(), values.tolist()
    else:
        top_ids = top_values = [[] for _ in next_token_ids]
    return [[lp, rank, ids_, vals] for lp, rank, ids_, vals in zip(chosen_list, ranks, top_ids, top_values,
                                                                   strict=True)]


def _logprobs(row_logprobs: torch.Tensor, token: int, top_n: int | None) -> list:
    sampled = row_logprobs[token]
    rank = int((row_logprobs > sampled).sum()) + 1
    if top_n:
        values, ids = row_logprobs.topk(top_n)
        return [float(sampled), rank, ids.tolist(), values.tolist()]
    return [float(sampled), rank, [], []]
