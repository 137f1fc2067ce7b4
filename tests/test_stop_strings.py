"""Stop strings (protocol.stop_strings): truncation, partial matches held back, include_stop_str_in_output."""

from __future__ import annotations

import pytest

from protocol.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    out = []
    for piece in pieces:
        emit, stop = matcher.feed(piece)
        out.append(emit)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_no_stop_strings_pass_text_through() -> None:
    m = StopStringMatcher([])
    assert not m.active
    assert feed_all(m, ["a", "b"]) == (["a", "b", ""], None)


def test_match_inside_one_piece_truncates() -> None:
    out, stop = feed_all(StopStringMatcher(["END"]), ["hello END world"])
    assert (out, stop) == (["hello "], "END")


def test_include_stop_str_in_output() -> None:
    out, stop = feed_all(StopStringMatcher(["END"], include_stop_str_in_output=True), ["hello END world"])
    assert (out, stop) == (["hello END"], "END")


def test_stop_string_split_across_pieces_is_never_shown() -> None:
    out, stop = feed_all(StopStringMatcher(["</s>"]), ["abc<", "/", "s", "> tail"])
    assert stop == "</s>"
    assert "".join(out) == "abc"
    assert "<" not in "".join(out)


def test_partial_match_released_when_it_turns_out_not_to_match() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("xx ST") == ("xx ", None)
    assert m.feed("ART") == ("START", None)
    assert m.flush() == ""


def test_held_tail_released_by_flush() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", None)
    assert m.flush() == "S"


def test_earliest_match_wins() -> None:
    out, stop = feed_all(StopStringMatcher(["world", "lo"]), ["hello world"])
    assert (out, stop) == (["hel"], "lo")


def test_overlapping_candidates() -> None:
    m = StopStringMatcher(["abcd", "bce"])
    assert m.feed("xab") == ("x", None)
    emit, stop = m.feed("ce")
    assert (emit, stop) == ("a", "bce")


def test_after_a_match_nothing_more_is_emitted() -> None:
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == ("a", "x")
    assert m.feed("more") == ("", "x")
    assert m.flush() == ""


def test_include_stop_str_does_not_hold_back() -> None:
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.feed("ab ST") == ("ab ST", None)
    assert m.feed("OP!") == ("OP", "STOP")


@pytest.mark.parametrize("bad", [[""], [3]])
def test_bad_stop_strings(bad: list) -> None:
    with pytest.raises(ValueError, match="^stop strings must be non-empty strings$"):
        StopStringMatcher(bad)


def test_character_by_character_equals_whole_text() -> None:
    text = "The quick brown fox says STOP and more"
    whole, stop_whole = feed_all(StopStringMatcher(["STOP", "fox!"]), [text])
    chars, stop_chars = feed_all(StopStringMatcher(["STOP", "fox!"]), list(text))
    assert "".join(whole) == "".join(chars) == "The quick brown fox says "
    assert stop_whole == stop_chars == "STOP"


def test_include_stop_str_split_across_many_short_pieces() -> None:
    m = StopStringMatcher(["<END>"], include_stop_str_in_output=True)
    out, stop = feed_all(m, ["x", "<", "E", "N", "D", ">", "tail"])
    assert stop == "<END>"
    assert "".join(out) == "x<END>"


def test_first_occurrence_in_a_piece_wins_over_a_later_one() -> None:
    out, stop = feed_all(StopStringMatcher(["END"]), ["one END two END three"])
    assert (out, stop) == (["one "], "END")
    out, stop = feed_all(StopStringMatcher(["END"], include_stop_str_in_output=True), ["one END two END"])
    assert (out, stop) == (["one END"], "END")


def test_tie_at_one_position_goes_to_the_stop_string_listed_first() -> None:
    assert feed_all(StopStringMatcher(["ab", "abc"]), ["xabcd"]) == (["x"], "ab")
    assert feed_all(StopStringMatcher(["abc", "ab"]), ["xabcd"]) == (["x"], "abc")
    included = StopStringMatcher(["abc", "ab"], include_stop_str_in_output=True)
    assert included.feed("xabcd") == ("xabc", "abc")


def test_include_stop_str_emits_nothing_after_the_match() -> None:
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.feed("go STOP there") == ("go STOP", "STOP")
    assert m.feed("more") == ("", "STOP")
    assert m.flush() == ""


def test_include_stop_str_with_a_one_character_stop_string() -> None:
    m = StopStringMatcher(["X"], include_stop_str_in_output=True)
    assert m.feed("ab") == ("ab", None)
    assert m.feed("cd") == ("cd", None)
    assert m.feed("eXf") == ("eX", "X")


def test_flush_releases_the_held_text_once() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.flush() == "ST"
    assert m.flush() == ""
