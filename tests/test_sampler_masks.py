"""What the sampler takes away before it samples: repetition/presence/frequency penalties (vLLM semantics),
min_tokens masks and structured-output grammar bitmasks, on worker.sampler directly, each vectorised path
against a per-row reference."""

from __future__ import annotations

import pytest
import torch
from sampler_helpers import VOCAB, make_batch, random_logits, tokens

from worker.sampler import Sampler, apply_grammar_bitmasks, apply_penalties


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"))


def _penalized(logits: torch.Tensor, prompt: list[int], output: list[int], **fields) -> torch.Tensor:
    return apply_penalties(logits.clone(), make_batch(1, prompt_token_ids=[prompt], output_token_ids=[output],
                                                      **fields))


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 4.0, 1.0] + [0.5] * (VOCAB - 6)])
    out = _penalized(logits, prompt=[0, 1], output=[2, 3, 3], repetition_penalty=2.0)
    expected = logits.clone()
    expected[0, 0] = 1.0  # prompt token, positive: divided
    expected[0, 1] = -4.0  # prompt token, negative: multiplied
    expected[0, 2] = 1.5  # output token
    expected[0, 3] = -2.0
    torch.testing.assert_close(out, expected)


def test_frequency_penalty_scales_with_output_count() -> None:
    logits = random_logits(1, seed=9)
    out = _penalized(logits, prompt=[5, 6], output=[1, 2, 2, 2], frequency_penalty=0.5)
    expected = logits.clone()
    expected[0, 1] -= 0.5
    expected[0, 2] -= 1.5
    torch.testing.assert_close(out, expected)  # prompt tokens 5, 6 untouched


def test_presence_penalty_once_per_present_output_token() -> None:
    logits = random_logits(1, seed=10)
    out = _penalized(logits, prompt=[5], output=[1, 2, 2, 2], presence_penalty=0.7)
    expected = logits.clone()
    expected[0, 1] -= 0.7
    expected[0, 2] -= 0.7
    torch.testing.assert_close(out, expected)


def test_penalties_combined_and_negative() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0] + [0.0] * (VOCAB - 3)])
    out = _penalized(logits, prompt=[0], output=[1, 1, 2], repetition_penalty=1.5, frequency_penalty=-0.5,
                     presence_penalty=0.25)
    expected = logits.clone()
    expected[0, 0] = 1.0 / 1.5
    expected[0, 1] = -1.0 * 1.5 + 1.0 - 0.25
    expected[0, 2] = 2.0 / 1.5 + 0.5 - 0.25
    torch.testing.assert_close(out, expected)


def test_penalties_per_row(sampler: Sampler) -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1.0
    logits[:, 4] = 0.9
    batch = make_batch(2, temperature=0.0, presence_penalty=[1.0, 0.0], prompt_token_ids=[[], []],
                       output_token_ids=[[3], [3]])
    assert tokens(sampler, logits, batch) == [4, 3]


def test_min_tokens_mask(sampler: Sampler) -> None:
    logits = random_logits(2, seed=11)
    top2 = logits[0].topk(2).indices.tolist()
    batch = make_batch(2, temperature=0.0, stop_token_masks=[[top2[0]], []])
    assert tokens(sampler, logits, batch) == [top2[1], int(logits[1].argmax())]


def _one_row_penalties(row: torch.Tensor, prompt: list[int], output: list[int], rep: float, presence: float,
                       frequency: float) -> torch.Tensor:
    """vLLM's penalties for one row, written out token by token."""
    row = row.clone()
    for tok in set(prompt) | set(output):
        row[tok] = row[tok] / rep if row[tok] > 0 else row[tok] * rep
    for tok in set(output):
        row[tok] -= frequency * output.count(tok)
        row[tok] -= presence
    return row


def test_penalties_of_many_rows_match_each_row_alone() -> None:
    g = torch.Generator().manual_seed(21)
    rows = 9
    logits = torch.randn(rows, VOCAB, generator=g) * 2
    logits[3, :4] = float("-inf")  # masked earlier (min_tokens, grammar): stays -inf
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(0, 12, (rows,), generator=g)]
    outputs = [torch.randint(0, 8, (int(n),), generator=g).tolist() for n in torch.randint(0, 12, (rows,), generator=g)]
    params = dict(repetition_penalty=[1.0, 1.5, 0.8, 1.2, 1.0, 2.0, 1.0, 1.3, 1.1],
                  presence_penalty=[0.0, 0.5, -1.0, 0.2, 0.0, 0.0, 1.5, 0.0, 0.3],
                  frequency_penalty=[0.0, 0.3, 0.0, -0.5, 0.7, 0.0, 0.0, 0.2, 0.1])
    out = apply_penalties(logits.clone(), make_batch(rows, prompt_token_ids=prompts, output_token_ids=outputs,
                                                     **params))
    for r in range(rows):
        expected = _one_row_penalties(logits[r], prompts[r], outputs[r], params["repetition_penalty"][r],
                                      params["presence_penalty"][r], params["frequency_penalty"][r])
        torch.testing.assert_close(out[r], expected)


def test_min_tokens_masks_of_many_rows_and_ids_outside_the_vocab(sampler: Sampler) -> None:
    logits = random_logits(4, seed=22)
    ranked = logits.argsort(dim=-1, descending=True).tolist()
    masks = [ranked[0][:3], [], ranked[2][:1] + [VOCAB + 5, -1], ranked[3][:2]]  # out-of-vocab ids: ignored
    out = tokens(sampler, logits, make_batch(4, temperature=0.0, stop_token_masks=masks))
    assert out == [ranked[0][3], ranked[1][0], ranked[2][1], ranked[3][2]]


def _mask_words(allowed: list[int], words: int) -> bytes:
    bits = [0] * words
    for t in allowed:
        bits[t // 32] |= 1 << (t % 32)
    return b"".join(int(b).to_bytes(4, "little", signed=False) for b in bits)


def test_grammar_bitmask_forbids_unset_bits_and_tokens_past_its_end() -> None:
    logits = random_logits(3, seed=25)
    out = apply_grammar_bitmasks(logits, [_mask_words([3, 40, 63], 2), None, _mask_words([0, 32], 2)])
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in out]
    assert finite == [[3, 40, 63], list(range(VOCAB)), [0, 32]]
    torch.testing.assert_close(out[1], logits[1])
    assert out[0, 40] == logits[0, 40] and torch.isfinite(logits).all()  # the input is not modified
    short = apply_grammar_bitmasks(logits[:1], [_mask_words([5, 31], 1)])  # covers 32 of the 64 tokens
    assert torch.isfinite(short[0]).nonzero().flatten().tolist() == [5, 31]


def test_repetition_penalty_before_any_output_token() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0] + [0.5] * (VOCAB - 3)])
    out = _penalized(logits, prompt=[0, 1], output=[], repetition_penalty=2.0)
    expected = logits.clone()
    expected[0, :2] = torch.tensor([1.0, -4.0])
    torch.testing.assert_close(out, expected)
