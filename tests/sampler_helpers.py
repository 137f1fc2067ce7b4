"""Helpers shared by the sampler tests: SamplingBatch rows with vLLM's defaults, seeded logits, draws."""

from __future__ import annotations

import torch

from worker.sampler import Sampler, SamplingBatch

VOCAB = 64


def make_batch(rows: int, **fields) -> SamplingBatch:
    values = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, generators=None, num_logprobs=None,
                  repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    values.update(fields)
    per_row = {k: (v if isinstance(v, list) else [v] * rows) for k, v in values.items()}
    prompt = fields.get("prompt_token_ids", [[] for _ in range(rows)])
    output = fields.get("output_token_ids", [[] for _ in range(rows)])
    stop = fields.get("stop_token_masks", [[] for _ in range(rows)])
    for key in ("prompt_token_ids", "output_token_ids", "stop_token_masks"):
        per_row.pop(key, None)
    return SamplingBatch(**per_row, prompt_token_ids=prompt, output_token_ids=output, stop_token_masks=stop)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=seeded(seed)) * scale


def tokens(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
    return [t.token_id for t in sampler(logits, batch)]


def sample_many(sampler: Sampler, row: torch.Tensor, n: int, seed: int = 0, **fields) -> torch.Tensor:
    """n independent draws from one row of logits (one batch of n identical rows, one generator)."""
    sampler.default_generator.manual_seed(seed)
    return torch.tensor(tokens(sampler, row.expand(n, -1).clone(), make_batch(n, **fields)))


def entropy(samples: torch.Tensor) -> float:
    p = torch.bincount(samples, minlength=VOCAB).float() / samples.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())
