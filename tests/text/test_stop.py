"""Stop strings: hold-back, earliest match, include/exclude, flush, and chunk-boundary independence."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.text.stop import StopChecker


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The whole text at once: the first stop string to complete (longest on a tie)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


def stream(chunks: list[str], stops: list[str], include: bool) -> tuple[list[str], str | None]:
    checker = StopChecker(stops, include)
    pieces = [checker.add(c) for c in chunks]
    if checker.stopped is None:
        pieces.append(checker.finish())
    return pieces, checker.stopped


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcx", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                    min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12), include=st.booleans())
def test_any_chunking_gives_the_whole_text_result_and_nothing_is_taken_back(text, stops, cuts, include):
    expected, expected_stop = reference(text, stops, include)
    pieces, stopped = stream(split(text, cuts), stops, include)
    assert ("".join(pieces), stopped) == (expected, expected_stop)
    shown = ""
    for piece in pieces:
        shown += piece
        assert expected.startswith(shown)
        # A shown text never ends in a partial stop string that later completed (it was held back).
        if expected_stop is not None and not include:
            assert expected_stop not in shown


def test_every_split_of_a_short_text_agrees():
    text, stops = "xxabcabyyab", ["abcab", "bca", "cab", "yya"]
    for include in (False, True):
        expected = reference(text, stops, include)
        for mask in itertools.product((False, True), repeat=len(text) - 1):
            chunks, start = [], 0
            for i, cut in enumerate(mask, 1):
                if cut:
                    chunks.append(text[start:i])
                    start = i
            chunks.append(text[start:])
            pieces, stopped = stream(chunks, stops, include)
            assert ("".join(pieces), stopped) == expected


def test_output_is_cut_at_the_stop_string_or_includes_it():
    checker = StopChecker(["END", "STOP"], include_stop_str_in_output=False)
    assert checker.add("Hello E") == "Hello "
    assert checker.add("ND and more") == ""
    assert checker.stopped == "END"
    assert checker.add("ignored") == "" and checker.finish() == ""
    including = StopChecker("END", include_stop_str_in_output=True)
    assert including.add("Hello EN") + including.add("D tail") == "Hello END"
    assert including.stopped == "END"


def test_a_prefix_of_a_stop_string_is_held_then_released():
    checker = StopChecker(["</answer>"])
    assert checker.add("x </ans") == "x "
    assert checker.add("w") == ""  # "</answ" could still become "</answer>"
    assert checker.add("x </an") == "</answx "
    assert checker.finish() == "</an"
    assert checker.stopped is None


def test_the_first_stop_string_to_complete_wins():
    checker = StopChecker(["abc", "b"])
    assert checker.add("zabc") == "za" and checker.stopped == "b"
    checker = StopChecker(["ab", "xab"])
    assert checker.add("xab") == "" and checker.stopped == "xab"  # same end: the longer one


def test_no_stop_strings_pass_text_through():
    checker = StopChecker(None)
    assert checker.add("anything") == "anything" and checker.finish() == "" and checker.stopped is None
    assert StopChecker([]).add("") == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [3]])
def test_bad_stop_strings_are_rejected(stop):
    with pytest.raises(ValueError, match="stop"):
        StopChecker(stop)
