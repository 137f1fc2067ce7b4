"""The output processor (protocol.output_processor) on its own, over a character tokenizer, and the offline `LLM`
through it: the same text, stop strings and finish reasons as the API, found without re-reading the text."""

from __future__ import annotations

import pytest

from protocol.messages import FinishReason, RequestOutput
from protocol.output_processor import ChoiceOutput, PromptOutputs
from protocol.sampling_params import SamplingParams

EOS = 0


class CharTokenizer:
    """Id 0 is a special EOS; any other id is the character chr(id). Records how many ids each decode read."""

    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        return "".join("<eos>" if i == EOS else chr(i) for i in ids if not (skip_special_tokens and i == EOS))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def out(index: int, tokens: list[int], finish: FinishReason | None = None, stop_reason=None, cached: int = 0,
        logprobs: list | None = None) -> RequestOutput:
    return RequestOutput("r", index, tokens, finish, stop_reason, num_cached_tokens=cached, logprobs=logprobs)


def feed(outputs: PromptOutputs, text: str, index: int = 0, finish_last: FinishReason | None = None):
    """Feed `text` one token per output; return the joined choice and every `Processed`."""
    choice, processed = ChoiceOutput(index), []
    tokens = ids(text)
    for k, token in enumerate(tokens):
        last = k == len(tokens) - 1
        p = outputs.apply(out(index, [token], finish_last if last else None))
        processed.append(p)
        if p.delta is not None:
            choice.add(p.delta)
    return choice, processed


def test_plain_text_and_length_finish() -> None:
    outputs = PromptOutputs(0, CharTokenizer(), ids("ab"), SamplingParams(max_tokens=5))
    choice, _ = feed(outputs, "hello", finish_last=FinishReason.LENGTH)
    assert (choice.text, choice.token_ids, choice.finish_reason) == ("hello", ids("hello"), "length")
    assert outputs.finished and outputs.completion_tokens == 5


def test_stop_string_split_across_tokens_is_never_shown_and_stops_the_request() -> None:
    outputs = PromptOutputs(0, CharTokenizer(), ids("p"), SamplingParams(stop=["xyz"]))
    choice, processed = feed(outputs, "abxyzcd")
    assert (choice.text, choice.finish_reason, choice.stop_reason) == ("ab", "stop", "xyz")
    assert choice.token_ids == ids("abxyz") and outputs.completion_tokens == 5
    assert [p.abort_request for p in processed[:5]] == [False] * 4 + [True]
    assert all(p.delta is None and not p.abort_request for p in processed[5:])  # after the stop: ignored


def test_include_stop_str_in_output() -> None:
    outputs = PromptOutputs(0, CharTokenizer(), ids("p"), SamplingParams(stop=["xyz"], include_stop_str_in_output=True))
    choice, _ = feed(outputs, "abxyzcd")
    assert (choice.text, choice.stop_reason) == ("abxyz", "xyz")


def test_the_engine_stop_token_counts_but_is_not_shown() -> None:
    outputs = PromptOutputs(0, CharTokenizer(), ids("p"), SamplingParams(stop_token_ids=[ord("!")]))
    p = outputs.apply(out(0, ids("hi!"), FinishReason.STOP, ord("!")))
    assert (p.delta.text, p.delta.token_ids, p.delta.stop_reason) == ("hi", ids("hi!"), ord("!"))
    assert not p.abort_request and outputs.completion_tokens == 3  # the engine finished it itself
    shown = PromptOutputs(0, CharTokenizer(), ids("p"), SamplingParams(stop_token_ids=[ord("!")],
                                                                       include_stop_str_in_output=True))
    assert shown.apply(out(0, ids("hi!"), FinishReason.STOP, ord("!"))).delta.text == "hi!"


def test_one_of_n_stopped_by_a_string_aborts_that_sequence_only() -> None:
    outputs = PromptOutputs(4, CharTokenizer(), ids("p"), SamplingParams(n=2, stop=["S"]))
    first = outputs.apply(out(1, ids("aS")))
    assert (first.delta.index, first.delta.text, first.abort_sequence, first.abort_request) == (5, "a", 1, False)
    assert outputs.apply(out(1, ids("b"))).delta is None  # already finished
    last = outputs.apply(out(0, ids("cS")))
    assert (last.abort_sequence, last.abort_request) == (None, True)
    assert outputs.finish_reasons == ["stop", "stop"]


def test_cut_and_cached_tokens() -> None:
    outputs = PromptOutputs(0, CharTokenizer(), ids("0123456789"), SamplingParams(n=3))
    outputs.apply(out(0, ids("a"), cached=0))
    outputs.apply(out(1, ids("b"), cached=8))
    outputs.apply(out(1, ids("c"), cached=9))
    assert outputs.cached_tokens == 0
    outputs.apply(out(0, ids("d"), FinishReason.LENGTH))
    cut = outputs.cut(FinishReason.ABORT)
    assert [(c.index, c.finish_reason) for c in cut] == [(1, "abort"), (2, "abort")] and outputs.finished


def test_a_long_output_is_never_decoded_whole() -> None:
    """Each step decodes a window of a few tokens and searches only the new text: the work per token does not
    grow with the output (the old offline path decoded and searched everything at every step)."""
    tokenizer = CharTokenizer()
    outputs = PromptOutputs(0, tokenizer, ids("prompt"), SamplingParams(stop=["never there"]))
    choice, _ = feed(outputs, "x" * 2000, finish_last=FinishReason.LENGTH)
    assert choice.text == "x" * 2000
    assert max(tokenizer.decoded_lengths) <= 8


# ------------------------------------------------------------------------------------------ offline LLM

@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from engine import LLM

    llm = LLM(model=tiny_llama_dir, dtype="float32")
    yield llm
    llm.shutdown()


def test_offline_stop_strings_cut_and_stop_the_engine(llm) -> None:
    plain = llm.generate("def hello(", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop = plain.text[8:12]
    cut = plain.text.index(stop)
    out = llm.generate("def hello(", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (plain.text[:cut], "stop", stop)
    assert out.token_ids == plain.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    assert not llm.engine.has_unfinished_requests()
    both = llm.generate("def hello(", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2,
                                                     stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs
    assert [c.text for c in both] == [plain.text[:cut + len(stop)]] * 2


def test_offline_stop_token_is_counted_not_shown(llm) -> None:
    plain = llm.generate("def hello(", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop_id = plain.token_ids[3]
    out = llm.generate("def hello(", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    first = plain.token_ids.index(stop_id)
    assert out.token_ids == plain.token_ids[:first + 1] and out.stop_reason == stop_id
    assert out.text == llm.tokenizer.decode(plain.token_ids[:first])
