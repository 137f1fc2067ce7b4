"""Sampler tests: seeds, greedy equivalences, temperature, top-k/top-p/min-p and logprobs, on
worker.sampler directly plus seeded sampling through the engine. Penalties, min_tokens and grammar masks
are in tests/test_sampler_masks.py."""

from __future__ import annotations

import math

import pytest
import torch
from sampler_helpers import VOCAB, entropy, make_batch, random_logits, sample_many, seeded, tokens

from engine import LLM, SamplingParams
from worker.sampler import (
    Sampler,
    apply_top_k_top_p,
    prompt_logprob_entries,
)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"))


def test_same_seed_same_tokens_different_seed_differs(sampler: Sampler) -> None:
    logits = random_logits(4)
    first = tokens(sampler, logits, make_batch(4, generators=[seeded(s) for s in (1, 2, 3, 4)]))
    again = tokens(sampler, logits, make_batch(4, generators=[seeded(s) for s in (1, 2, 3, 4)]))
    assert first == again
    runs = []
    for s in range(8):
        generators = [seeded(100 + s), seeded(2), seeded(3), seeded(4)]
        runs.append(tuple(tokens(sampler, logits, make_batch(4, generators=generators))))
    assert len({r[0] for r in runs}) > 1  # row 0's seed changes -> its token changes for some seed
    assert {r[1:] for r in runs} == {tuple(first[1:])}  # other rows untouched by row 0's seed


def test_seeded_row_independent_of_batch(sampler: Sampler) -> None:
    logits = random_logits(3, seed=5)
    gen = seeded(7)
    sequence_alone = [tokens(sampler, logits[1:2], make_batch(1, generators=[gen]))[0] for _ in range(5)]
    gen = seeded(7)
    sequence_batched = [tokens(sampler, logits, make_batch(3, generators=[None, gen, seeded(99 + i)]))[1]
                        for i in range(5)]
    assert sequence_alone == sequence_batched
    assert len(set(sequence_alone)) > 1


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = random_logits(5, seed=1)
    out = tokens(sampler, logits, make_batch(5, temperature=0.0))
    assert out == logits.argmax(-1).tolist()


def test_a_plain_greedy_batch_takes_the_logits_in_their_own_dtype(sampler: Sampler) -> None:
    """Greedy rows with nothing else reading the logits skip the float32 copy (the runner asks the model for
    logits in its dtype then): the same tokens as the widened logits', on a batch with many bfloat16 ties."""
    logits = (random_logits(8, seed=4) * 3).bfloat16()
    batch = make_batch(8, temperature=0.0)
    assert batch.plain_greedy
    assert tokens(sampler, logits, batch) == logits.float().argmax(-1).tolist()
    for other in (make_batch(8, temperature=0.5), make_batch(8, temperature=0.0, num_logprobs=[1] * 8),
                  make_batch(8, temperature=0.0, repetition_penalty=[1.2] * 8)):
        assert not other.plain_greedy


def test_top_k_1_equals_greedy(sampler: Sampler) -> None:
    logits = random_logits(6, seed=2, scale=0.3)  # flat enough that plain sampling would wander
    for seed in range(5):
        sampler.default_generator.manual_seed(seed)
        assert tokens(sampler, logits, make_batch(6, top_k=1)) == logits.argmax(-1).tolist()


def test_temperature_to_zero_equals_greedy(sampler: Sampler) -> None:
    logits = random_logits(6, seed=3)
    greedy = logits.argmax(-1).tolist()
    assert tokens(sampler, logits, make_batch(6, temperature=1e-6)) == greedy  # below the greedy epsilon
    for seed in range(5):  # a tiny positive temperature samples, but effectively greedily
        sampler.default_generator.manual_seed(seed)
        assert tokens(sampler, logits, make_batch(6, temperature=1e-3)) == greedy


def test_mixed_greedy_and_random_rows(sampler: Sampler) -> None:
    logits = random_logits(4, seed=4, scale=0.2)
    greedy = logits.argmax(-1).tolist()
    seen_non_greedy = False
    for seed in range(10):
        sampler.default_generator.manual_seed(seed)
        out = tokens(sampler, logits, make_batch(4, temperature=[0.0, 1.0, 0.0, 1.0]))
        assert out[0] == greedy[0] and out[2] == greedy[2]
        seen_non_greedy |= out[1] != greedy[1] or out[3] != greedy[3]
    assert seen_non_greedy


def test_high_temperature_increases_entropy(sampler: Sampler) -> None:
    row = random_logits(1, seed=6, scale=2.0)
    cold = entropy(sample_many(sampler, row, 4000, temperature=0.5))
    warm = entropy(sample_many(sampler, row, 4000, temperature=1.0))
    hot = entropy(sample_many(sampler, row, 4000, temperature=3.0))
    assert cold < warm < hot
    assert hot > 0.8 * math.log(VOCAB)


def test_sampling_follows_the_distribution(sampler: Sampler) -> None:
    row = torch.full((1, VOCAB), -1e9)
    row[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    counts = torch.bincount(sample_many(sampler, row, 6000), minlength=VOCAB).float() / 6000
    assert counts[:3].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.03)
    assert counts[3:].sum() == 0


def test_top_p_small_keeps_only_the_top_token(sampler: Sampler) -> None:
    row = random_logits(1, seed=7, scale=0.2)
    samples = sample_many(sampler, row, 500, top_p=0.01)
    assert set(samples.tolist()) == {int(row.argmax())}


def test_top_p_keeps_the_nucleus(sampler: Sampler) -> None:
    row = torch.full((1, VOCAB), -1e9)
    row[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    samples = sample_many(sampler, row, 3000, top_p=0.65)  # 0.4 + 0.3 covers 0.65
    assert set(samples.tolist()) == {0, 1}
    counts = torch.bincount(samples, minlength=2).float() / 3000
    assert counts[0] == pytest.approx(0.4 / 0.7, abs=0.04)


def test_top_k_keeps_k_tokens(sampler: Sampler) -> None:
    row = random_logits(1, seed=8, scale=0.1)
    samples = sample_many(sampler, row, 2000, top_k=3)
    assert set(samples.tolist()) == set(row[0].topk(3).indices.tolist())


def test_min_p_filters_unlikely_tokens(sampler: Sampler) -> None:
    row = torch.full((1, VOCAB), -1e9)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    row[0, :5] = probs.log()
    samples = sample_many(sampler, row, 3000, min_p=0.2)  # threshold 0.08: drops tokens 3 and 4
    assert set(samples.tolist()) == {0, 1, 2}
    samples = sample_many(sampler, row, 3000, min_p=0.0)
    assert {3, 4} <= set(samples.tolist())


def test_logprobs_sampled_rank_and_top_n(sampler: Sampler) -> None:
    logits = random_logits(3, seed=12, scale=2.0)
    reference = torch.log_softmax(logits, dim=-1)
    sampler.default_generator.manual_seed(3)
    out = sampler(logits, make_batch(3, temperature=[0.0, 1.0, 5.0], num_logprobs=[5, 3, 0],
                                     presence_penalty=[0.0, 0.0, 0.0]))
    for row, tok in enumerate(out):
        sampled_lp, rank, top_ids, top_lps = tok.logprobs
        assert sampled_lp == pytest.approx(float(reference[row, tok.token_id]), abs=1e-5)
        assert rank == int((reference[row] > reference[row, tok.token_id]).sum()) + 1
        n = [5, 3, 0][row]
        assert len(top_ids) == len(top_lps) == n
        assert top_ids == reference[row].topk(n).indices.tolist()
        assert top_lps == sorted(top_lps, reverse=True)
        assert top_lps == pytest.approx(reference[row, top_ids].tolist(), abs=1e-5)
    assert out[0].logprobs[1] == 1  # greedy samples the top token


def test_logprobs_are_of_raw_logits_not_processed_ones(sampler: Sampler) -> None:
    logits = random_logits(1, seed=13)
    top = int(logits.argmax())
    out = sampler(logits, make_batch(1, temperature=0.0, num_logprobs=2, stop_token_masks=[[top]],
                                     repetition_penalty=1.5, prompt_token_ids=[[top, 1, 2]],
                                     output_token_ids=[[3]]))[0]
    reference = torch.log_softmax(logits[0], dim=-1)
    assert out.token_id != top
    assert out.logprobs[0] == pytest.approx(float(reference[out.token_id]), abs=1e-5)
    assert out.logprobs[1] >= 2
    assert out.logprobs[2][0] == top  # the masked token still tops the raw distribution


def test_logprobs_only_for_rows_that_ask(sampler: Sampler) -> None:
    logits = random_logits(2, seed=14)
    out = sampler(logits, make_batch(2, temperature=0.0, num_logprobs=[None, 2]))
    assert out[0].logprobs is None
    assert out[1].logprobs is not None
    assert sampler(logits, make_batch(2, temperature=0.0))[0].logprobs is None


# --- through the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=16, num_kv_blocks=128)


PROMPTS = [[10 + i for i in range(7)], [200 + 3 * i for i in range(23)], [500 + i for i in range(40)]]


def test_seeded_request_independent_of_batch_composition(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True), params,
                                   SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)])
    assert mixed[1].outputs[0].token_ids == alone
    reordered = llm.generate([PROMPTS[2], PROMPTS[1]], [SamplingParams(temperature=1.0, max_tokens=3), params])
    assert reordered[1].outputs[0].token_ids == alone
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=4321, max_tokens=12,
                                                           ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone
    assert len(alone) == 12


def test_seeded_n_children_differ_and_repeat(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = [o.token_ids for o in llm.generate([PROMPTS[0]], params)[0].outputs]
    again = [o.token_ids for o in llm.generate([PROMPTS[0]], params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_top_k_1_through_engine_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))
    assert [g.outputs[0].token_ids for g in greedy] == [t.outputs[0].token_ids for t in top1]


def test_a_greedy_bfloat16_batch_samples_the_lm_heads_own_logits(tiny_llama_dir: str) -> None:
    """bfloat16, greedy, nothing else reading the logits: the sampler gets the LM head's bfloat16 logits (no
    float32 copy of [rows, vocab] a step) and picks the tokens the widened logits pick; a batch with a row that
    wants logprobs gets float32 logits again."""
    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", block_size=16, num_kv_blocks=128)
    try:
        runner = llm.engine.executor.runner
        seen: list[tuple[torch.dtype, bool]] = []
        sample = runner.sampler.sample

        def spy(logits, batch):
            seen.append((logits.dtype, batch.plain_greedy))
            if logits.dtype == torch.bfloat16:  # what the float32 path would have picked
                assert sample(logits.float(), batch).tokens() == sample(logits, batch).tokens()
            return sample(logits, batch)

        runner.sampler.sample = spy
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        llm.generate(PROMPTS, greedy)
        assert seen and set(seen) == {(torch.bfloat16, True)}
        seen.clear()
        llm.generate(PROMPTS, [greedy, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
                               greedy])
        assert (torch.float32, False) in seen and all(dtype == torch.float32 for dtype, plain in seen if not plain)
    finally:
        llm.shutdown()


# --- the vectorised paths against per-row references --------------------------------------------------------


def _flattening_distribution() -> torch.Tensor:
    """probs 0.4 / 0.3 / 0.2 / 0.1 at temperature 1: at temperature 2 they flatten to about
    0.325 / 0.282 / 0.230 / 0.163."""
    row = torch.full((1, VOCAB), -1e9)
    row[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    return row


def test_temperature_is_applied_before_top_p(sampler: Sampler) -> None:
    # temperature first: cumulative before token 2 is 0.607 < 0.65, token 2 stays;
    # temperature after top_p would keep only tokens 0 and 1 (0.4 + 0.3 reaches 0.65).
    samples = sample_many(sampler, _flattening_distribution(), 3000, temperature=2.0, top_p=0.65)
    assert set(samples.tolist()) == {0, 1, 2}


def test_temperature_is_applied_before_min_p(sampler: Sampler) -> None:
    # temperature first: threshold 0.6 * 0.325 = 0.195 keeps token 2 (0.230);
    # temperature after min_p would use 0.6 * 0.4 = 0.24 and drop it (0.2).
    samples = sample_many(sampler, _flattening_distribution(), 3000, temperature=2.0, min_p=0.6)
    assert set(samples.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (20, 0.8), (1, 1.0)])
def test_top_k_fast_path_equals_the_full_sort_path(sampler: Sampler, top_k: int, top_p: float) -> None:
    """With every sampled row under a top_k, only the k candidates are sorted; a seeded row must still
    get exactly the token of the full path (full sort, whole-row noise from its generator)."""
    logits = random_logits(6, seed=23, scale=0.5)
    temperature = [0.7, 1.0, 0.0, 1.3, 1.0, 0.9]
    fast = tokens(sampler, logits, make_batch(6, temperature=temperature, top_k=top_k, top_p=top_p,
                                              generators=[seeded(40 + r) for r in range(6)]))
    for r in range(6):
        if temperature[r] == 0.0:
            assert fast[r] == int(logits[r].argmax())
            continue
        scaled = logits[r:r + 1] / temperature[r]
        probs = torch.softmax(apply_top_k_top_p(scaled, [top_k], [top_p]), dim=-1)
        q = torch.empty_like(probs).exponential_(generator=seeded(40 + r))
        assert fast[r] == int((probs / q).argmax())


def test_seeded_top_k_row_independent_of_batch(sampler: Sampler) -> None:
    logits = random_logits(3, seed=24)
    alone = [tokens(sampler, logits[1:2], make_batch(1, top_k=10, generators=[seeded(9 + i)]))[0] for i in range(6)]
    batched = [tokens(sampler, logits, make_batch(3, top_k=[3, 10, 40], generators=[None, seeded(9 + i), seeded(i)]))[1]
               for i in range(6)]
    assert alone == batched and len(set(alone)) > 1


def test_prompt_logprob_entries_rank_and_top_n() -> None:
    logits = random_logits(2, seed=26, scale=2.0)
    reference = torch.log_softmax(logits, dim=-1)
    targets = [int(reference[0].argmax()), int(reference[1].argsort()[VOCAB // 2])]
    entries = prompt_logprob_entries(logits, targets, 3)
    for row, (lp, rank, top_ids, top_lps) in enumerate(entries):
        assert lp == pytest.approx(float(reference[row, targets[row]]), abs=1e-5)
        assert rank == int((reference[row] > reference[row, targets[row]]).sum()) + 1
        assert top_ids == reference[row].topk(3).indices.tolist()
        assert top_lps == pytest.approx(reference[row].topk(3).values.tolist(), abs=1e-5)
    assert entries[0][1] == 1 and entries[1][1] > 1
    assert [e[2:] for e in prompt_logprob_entries(logits, targets, 0)] == [[[], []], [[], []]]


def test_logprobs_zero_gives_the_sampled_token_only(sampler: Sampler) -> None:
    logits = random_logits(2, seed=27)
    out = sampler(logits, make_batch(2, temperature=0.0, num_logprobs=0))
    reference = torch.log_softmax(logits, dim=-1)
    for row, tok in enumerate(out):
        assert tok.logprobs[1:] == [1, [], []]
        assert tok.logprobs[0] == pytest.approx(float(reference[row].max()), abs=1e-5)


def test_top_k_top_p_on_some_rows_leaves_the_others_alone() -> None:
    logits = random_logits(3, seed=28)
    out = apply_top_k_top_p(logits, [3, 0, 0], [1.0, 1.0, 0.5])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == sorted(logits[0].topk(3).indices.tolist())
    torch.testing.assert_close(out[1], logits[1])
    kept = torch.isfinite(out[2])
    assert 1 <= int(kept.sum()) < VOCAB and bool(kept[logits[2].argmax()])


def test_a_row_without_top_k_is_not_cut_by_another_rows_top_k(sampler: Sampler) -> None:
    logits = random_logits(2, seed=29, scale=0.1)
    top5 = set(logits[0].topk(5).indices.tolist())
    row0 = set()
    for seed in range(30):
        sampler.default_generator.manual_seed(seed)
        row0.add(tokens(sampler, logits, make_batch(2, temperature=[0.7, 1.3], top_k=[0, 5]))[0])
    assert row0 - top5
