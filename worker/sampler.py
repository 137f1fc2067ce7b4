"""Turns a step's logits into tokens, per request: greedy, temperature, top-k, top-p, min-p, seeds,
repetition/presence/frequency penalties, min_tokens, structured-output token masks, and logprobs with top-N.

Order (as vLLM): grammar mask -> raw logprobs -> min_tokens mask -> penalties -> temperature -> min_p -> top_k/top_p ->
sample. Sampling draws one exponential variate per vocabulary entry and takes argmax(p / q) (the
Gumbel-max equivalent); a seeded request draws from its own generator, so its tokens do not depend
on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from protocol.step_types import SampledToken
from worker.layers.fused_ops import fused_ops_for
from worker.transfer import HostCopy, to_device


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float32 or bfloat16 tensor; on the CPU one C++ pass per row when the kernels
    build (torch's CPU argmax reads a [64, 8192] batch at ~3 GB/s: ~0.6 ms of a batch-64 decode step)."""
    if x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1] and x.stride(-1) == 1 and (
            ops := fused_ops_for(x)) is not None:
        out = torch.empty(x.shape[0], dtype=torch.int64)
        ops.argmax_rows(out, x)
        return out
    return x.argmax(dim=-1)


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
    def plain_greedy(self) -> bool:
        """Every row takes its logits' argmax and nothing else reads them (no grammar, logprobs, stop masks or
        penalties): the logits may stay in the model's dtype, whose argmax is their float32 copy's."""
        return (self.all_greedy and not any(m is not None for m in self.grammar_bitmasks)
                and not any(n is not None for n in self.num_logprobs) and not any(self.stop_token_masks)
                and not self.needs_penalties)

    @property
    def needs_penalties(self) -> bool:
        return (any(p != 1.0 for p in self.repetition_penalty) or any(self.presence_penalty)
                or any(self.frequency_penalty))


class SampledBatch:
    """A step's samples, still on the device: the token ids [rows] and, when a row asked for logprobs, the
    sampled tokens' logprobs and ranks [rows] and the top-N ids and logprobs [rows, widest N].
    ``start_copy`` queues their copy to the host without waiting; ``tokens`` waits for it and returns one
    ``SampledToken`` per row."""

    def __init__(self, token_ids: torch.Tensor, num_logprobs: list[int | None],
                 logprob_tensors: list[torch.Tensor] | None = None):
        self.token_ids = token_ids
        self.num_logprobs = num_logprobs
        self.logprob_tensors = logprob_tensors or []
        self._copy: HostCopy | None = None

    def start_copy(self) -> None:
        if self._copy is None:
            self._copy = HostCopy([self.token_ids, *self.logprob_tensors])

    def tokens(self) -> list[SampledToken]:
        self.start_copy()
        token_ids, *logprobs = self._copy.wait()
        token_list = token_ids.tolist()
        if not logprobs:
            return [SampledToken(t) for t in token_list]
        entries = logprob_entries(*logprobs, self.num_logprobs)
        return [SampledToken(t, entry) for t, entry in zip(token_list, entries, strict=True)]


class Sampler:
    """Rules:
    - Whole-batch tensor ops throughout; the only per-row Python loop left draws the exponential noise of
      the seeded rows, one call each on that row's own generator (unseeded sampled rows share one draw
      from ``default_generator``; greedy rows draw nothing).
    - A seeded row's token depends only on its logits, parameters and generator, never on the batch.
    - ``sample`` reads nothing back from the device: its parameters, grammar masks and penalty histories go
      up through ``worker.transfer``, and the tokens stay there until ``SampledBatch.tokens``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.default_generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampledToken]:
        return self.sample(logits, batch).tokens()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledBatch:
        """The step's tokens (and logprobs), left on the device. ``logits`` may be in the model's dtype only for a
        ``plain_greedy`` batch (the runner asks the model for float32 logits otherwise)."""
        if batch.plain_greedy:
            return SampledBatch(argmax_rows(logits), batch.num_logprobs)
        logits = logits.float()
        if any(m is not None for m in batch.grammar_bitmasks):
            logits = apply_grammar_bitmasks(logits, batch.grammar_bitmasks)
        raw_logprobs = None
        if any(n is not None for n in batch.num_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(batch.stop_token_masks):
            logits = apply_token_masks(logits, batch.stop_token_masks)
        if batch.needs_penalties:
            logits = apply_penalties(logits, batch)
        if batch.all_greedy:
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, batch)
        if raw_logprobs is None:
            return SampledBatch(tokens, batch.num_logprobs)
        return SampledBatch(tokens, batch.num_logprobs, logprob_tensors(raw_logprobs, tokens, batch.num_logprobs))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        device = logits.device
        temperature = to_device(batch.temperature, torch.float32, device)
        greedy = temperature < 1e-5
        greedy_tokens = argmax_rows(logits)
        logits = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        if any(batch.min_p):
            probs = torch.softmax(logits, dim=-1)
            min_p = to_device(batch.min_p, torch.float32, device).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        widest_k = _widest_top_k(batch, logits.shape[1])
        if widest_k:
            sampled = self._sample_top_k(logits, batch, widest_k)
        else:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
            probs = torch.softmax(logits, dim=-1)
            sampled = argmax_rows(probs / self._exponential_noise(probs, batch.generators, batch.temperature))
        return torch.where(greedy, greedy_tokens, sampled)

    def _sample_top_k(self, logits: torch.Tensor, batch: SamplingBatch, widest_k: int) -> torch.Tensor:
        """Every sampled row keeps at most ``widest_k`` tokens: sort only those (``topk``), apply top-k/top-p
        to them, and draw noise only for them, except that a seeded row still draws its whole row (the
        same variates as the full path) and reads them at its candidates."""
        values, candidates = logits.topk(widest_k, dim=-1)
        ks = [k if 0 < k < logits.shape[1] else widest_k for k in batch.top_k]
        probs = torch.softmax(_top_k_top_p_sorted(values, ks, batch.top_p), dim=-1)
        q = self._exponential_noise(probs, [None] * len(ks), batch.temperature)
        for row, gen in enumerate(batch.generators):
            if gen is not None and batch.temperature[row] >= 1e-5:
                q[row] = torch.empty(logits.shape[1], device=logits.device).exponential_(generator=gen)[candidates[row]]
        return candidates.gather(1, (probs / q).argmax(dim=-1, keepdim=True)).squeeze(1)

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None],
                           temperature: list[float]) -> torch.Tensor:
        """One Exp(1) variate per entry of the sampled rows (greedy rows get 1.0, unused)."""
        sampled = [t >= 1e-5 for t in temperature]
        seeded = [row for row, gen in enumerate(generators) if gen is not None and sampled[row]]
        if not seeded and all(sampled):
            return torch.empty_like(probs).exponential_(generator=self.default_generator)
        q = torch.ones_like(probs)
        unseeded = [row for row, gen in enumerate(generators) if gen is None and sampled[row]]
        if unseeded:
            noise = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            q[to_device(unseeded, torch.long, probs.device)] = noise.exponential_(generator=self.default_generator)
        for row in seeded:
            q[row].exponential_(generator=generators[row])
        return q


def _flat_rows(lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``row * vocab + id`` for every id of every row's list, as one int64 tensor (indexes a flat [rows, vocab]).
    Ids outside the vocabulary are left out: they name no logit, and must not spill into the next row."""
    lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.long)
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(lists), dtype=torch.long), lengths)
    inside = (ids >= 0) & (ids < vocab)
    return to_device(rows[inside] * vocab + ids[inside], torch.long, device)


def apply_token_masks(logits: torch.Tensor, token_masks: list[list[int]]) -> torch.Tensor:
    """Set to -inf, in a copy, every row's listed token ids (min_tokens: stop and EOS ids)."""
    logits = logits.clone()
    logits.view(-1)[_flat_rows(token_masks, logits.shape[1], logits.device)] = float("-inf")
    return logits


def apply_grammar_bitmasks(logits: torch.Tensor, masks: list[bytes | None]) -> torch.Tensor:
    """Set to -inf the logits of the tokens a row's grammar forbids (bit i of its int32 words clear;
    tokens past the mask's end are forbidden). Rows without a mask are untouched."""
    rows = [row for row, mask in enumerate(masks) if mask is not None]
    vocab = logits.shape[1]
    words = torch.frombuffer(bytearray(b"".join(masks[row] for row in rows)), dtype=torch.int32)
    words = to_device(words.view(len(rows), -1), None, logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = to_device(rows, torch.long, logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties, all rows at once: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones), then frequency per output occurrence, then presence once per output
    token. Dense per-row token counts ([rows, vocab], by one scatter-add from the host's padded id lists),
    so nothing is read back from the device (a sparse form needs ``unique``, whose size the host must wait
    for). Returns a new tensor."""
    rows, vocab = logits.shape
    device = logits.device
    counts = _token_counts(batch.output_token_ids, rows, vocab, device)
    if any(p != 1.0 for p in batch.repetition_penalty):
        seen = (counts > 0) | (_token_counts(batch.prompt_token_ids, rows, vocab, device) > 0)
        rep = to_device(batch.repetition_penalty, torch.float32, device).unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if any(batch.frequency_penalty):
        logits = logits - to_device(batch.frequency_penalty, torch.float32, device).unsqueeze(1) * counts
    if any(batch.presence_penalty):
        logits = logits - to_device(batch.presence_penalty, torch.float32, device).unsqueeze(1) * (counts > 0)
    return logits


def _token_counts(lists: list[list[int]], rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32: how often each id occurs in each row's list (ids outside the vocabulary name no
    logit and are not counted)."""
    width = max((len(ids) for ids in lists), default=0)
    padded = np.full((rows, max(width, 1)), vocab, dtype=np.int64)  # column ``vocab``: padding, dropped below
    for row, ids in enumerate(lists):
        padded[row, :len(ids)] = ids
    padded[(padded < 0) | (padded > vocab)] = vocab
    index = to_device(padded, None, device)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's k most likely tokens (0 < k < vocab), then the smallest prefix whose probability
    reaches p (p < 1). Only the rows that filter are sorted; the others come back untouched."""
    vocab = logits.shape[-1]
    filtered = [row for row, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if 0 < k < vocab or p < 1.0]
    if not filtered:
        return logits
    if len(filtered) == logits.shape[0]:
        return _top_k_top_p_rows(logits, top_k, top_p)
    index = to_device(filtered, torch.long, logits.device)
    logits = logits.clone()
    logits[index] = _top_k_top_p_rows(logits[index], [top_k[r] for r in filtered], [top_p[r] for r in filtered])
    return logits


def _top_k_top_p_rows(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_logits = _top_k_top_p_sorted(sorted_logits, [k if 0 < k < vocab else vocab for k in top_k], top_p)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _top_k_top_p_sorted(sorted_logits: torch.Tensor, ks: list[int], top_p: list[float]) -> torch.Tensor:
    """Rows sorted in descending order: -inf from position k on, then past the smallest prefix whose
    probability (after top-k) reaches p; the first position always stays."""
    positions = torch.arange(sorted_logits.shape[1], device=sorted_logits.device).unsqueeze(0)
    remove = positions >= to_device(ks, torch.long, sorted_logits.device).unsqueeze(1)
    if any(p < 1.0 for p in top_p):
        ps = to_device(top_p, torch.float32, sorted_logits.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        cumulative = probs.cumsum(dim=-1) - probs
        remove |= cumulative > ps
    remove[:, 0] = False
    return sorted_logits.masked_fill(remove, float("-inf"))


def _widest_top_k(batch: SamplingBatch, vocab: int) -> int:
    """The largest top_k over the sampled rows when every one of them sets 0 < top_k < vocab, else 0."""
    ks = [k for k, t in zip(batch.top_k, batch.temperature, strict=True) if t >= 1e-5]
    return max(ks) if ks and all(0 < k < vocab for k in ks) else 0


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


def logprob_tensors(raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]) -> list:
    """On the device: the sampled tokens' raw logprobs and ranks (rank 1 = most likely) [rows], and the top-N
    ids and logprobs [rows, widest N asked] (N may be 0)."""
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    widest = max((n for n in num_logprobs if n), default=0)
    values, ids = raw_logprobs.topk(widest, dim=-1)
    return [chosen.squeeze(1), ranks, ids, values]


def logprob_entries(chosen: torch.Tensor, ranks: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor,
                    num_logprobs: list[int | None]) -> list:
    """Per row (host tensors of ``logprob_tensors``): None when it asked for no logprobs, else
    ``[logprob, rank, top_ids, top_logprobs]`` of its sampled token, with its top-N."""
    chosen_list, rank_list = chosen.tolist(), ranks.tolist()
    id_rows, value_rows = top_ids.tolist(), top_values.tolist()
    return [None if n is None else [chosen_list[row], rank_list[row], id_rows[row][:n] if n else [],
                                    value_rows[row][:n] if n else []]
            for row, n in enumerate(num_logprobs)]
