"""Incremental detokenization (protocol.detokenizer): no U+FFFD mid-stream, pieces add up to decode()."""

from __future__ import annotations

import random

import pytest

from protocol.detokenizer import IncrementalDetokenizer

EURO = "€".encode()  # 3 bytes
EMOJI = "😀".encode()  # 4 bytes


class ByteTokenizer:
    """Each id is a byte string; id 0 is a special token."""

    VOCAB = {0: b"<s>", 1: b"a", 2: b" b", 3: EURO[:1], 4: EURO[1:2], 5: EURO[2:], 6: EMOJI[:2], 7: EMOJI[2:3],
             8: EMOJI[3:], 9: b"\x80", 10: "é".encode(), 11: b"\n"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0))
        return data.decode("utf-8", errors="replace")


def run(tokens: list[int], prompt: list[int] = (), skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(ByteTokenizer(), prompt, skip)
    pieces = [detok.add([t]) for t in tokens]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    pieces = run([1, 3, 4, 5, 2])
    assert pieces == ["a", "", "", "€", " b", ""]


def test_four_byte_character() -> None:
    assert "".join(run([6, 7, 8])) == "😀"
    assert run([6, 7, 8])[:2] == ["", ""]


def test_sequence_ending_inside_a_character_is_flushed_at_the_end() -> None:
    pieces = run([1, 3, 4])
    assert pieces[:-1] == ["a", "", ""]
    assert pieces[-1] == ByteTokenizer().decode([3, 4])


def test_special_tokens_skipped_or_kept() -> None:
    assert "".join(run([1, 0, 1])) == "aa"
    assert "".join(run([1, 0, 1], skip=False)) == "a<s>a"


def test_prompt_context_is_not_part_of_the_output() -> None:
    assert "".join(run([2, 1], prompt=[1, 1, 10])) == " ba"


def test_prompt_ending_inside_a_character_does_not_corrupt_the_output() -> None:
    tokens = [4, 5, 1]
    assert "".join(run(tokens, prompt=[1, 3])) == ByteTokenizer().decode(tokens)


@pytest.mark.parametrize("seed", range(50))
def test_random_sequences_add_up_to_decode(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(len(ByteTokenizer.VOCAB)) for _ in range(rng.randrange(1, 40))]
    prompt = [rng.randrange(len(ByteTokenizer.VOCAB)) for _ in range(rng.randrange(0, 6))]
    for skip in (True, False):
        pieces = run(tokens, prompt, skip)
        assert "".join(pieces) == ByteTokenizer().decode(tokens, skip_special_tokens=skip)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_several_tokens_at_once() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.add([1, 3, 4]) == ""
    assert detok.add([5, 2]) == "a€ b"
    assert detok.output_token_ids == [1, 3, 4, 5, 2]


def test_real_tokenizer_random_ids(tiny_llama_dir: str) -> None:
    from api.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(tiny_llama_dir)
    for seed in range(40):
        rng = random.Random(seed)
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
        tokens = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            detok = IncrementalDetokenizer(tokenizer, prompt, skip)
            pieces = [detok.add([t]) for t in tokens] + [detok.flush()]
            assert "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=skip)
            assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_real_tokenizer_text_round_trip(tiny_llama_dir: str) -> None:
    from api.tokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(tiny_llama_dir)
    text = "naïve café: 😀 → ∑ def f(x):\n    return x  # 漢字"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
