"""Incremental JSON validation: agrees with json.loads, in any chunking, and locates object members."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.text.parsers.json_stream import JsonScanner, JsonSyntaxError

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)


def strict_loads(text: str) -> object:
    """json.loads without Python's NaN/Infinity extension (not JSON)."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _feed(text: str, cuts: list[int]) -> tuple[JsonScanner, JsonSyntaxError | None]:
    scanner = JsonScanner()
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    for a, b in zip(points, points[1:]):
        try:
            used = scanner.feed(text[a:b])
        except JsonSyntaxError as error:
            return scanner, error
        if used < b - a:
            break
    return scanner, None


@settings(max_examples=150, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans(),
       cuts=st.lists(st.integers(0, 500), max_size=10))
def test_valid_json_in_any_chunks_completes_at_its_last_character(value, indent, ascii_only, cuts):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    scanner, error = _feed(text + " tail", cuts)
    assert error is None
    if not scanner.done:  # a bare number ends only at its terminator or at the end of input
        assert scanner.finish()
    assert text[:scanner.pos].rstrip() == text or scanner.pos == len(text)
    if isinstance(value, dict):
        members = {json.loads(text[m.key_start:m.key_end]): json.loads(text[m.value_start:m.value_end])
                   for m in scanner.members}
        assert members == value


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet='{}[]:,"\\ 0123456789.-+eEtrufalsnx\n', max_size=16),
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_scanner_never_accepts_what_json_loads_rejects(text, cuts):
    scanner, error = _feed(text + " ", cuts)
    if scanner.done:
        strict_loads(text[:scanner.pos])  # raises if the scanner accepted invalid JSON
    elif error is not None:
        with pytest.raises(ValueError):
            strict_loads(text)
        # Everything before the error is a valid prefix: the same scanner accepts it again.
        again = JsonScanner()
        again.feed(text[:error.pos])


@pytest.mark.parametrize("text", ["{'a': 1}", '{"a": 1,}', "[1 2]", "01", "1.", "-", ".5", "NaN", '"a\nb"',
                                  '"\\x"', '"\\u12g4"', "tru3", '{"a" 1}', "{,}", "]"])
def test_invalid_json_is_rejected(text):
    with pytest.raises(ValueError):
        strict_loads(text)
    scanner, error = _feed(text + " ", [])
    accepted_whole = error is None and scanner.finish() and text[:scanner.pos].strip() == text.strip()
    assert not accepted_whole


def test_members_of_a_partial_object_are_located_as_they_arrive():
    scanner = JsonScanner()
    text = '{"name": "get", "arguments": {"q": [1, 2'
    scanner.feed(text)
    name, args = scanner.members
    assert text[name.key_start:name.key_end] == '"name"'
    assert text[name.value_start:name.value_end] == '"get"'
    assert text[args.value_start:] == '{"q": [1, 2' and args.value_end == -1
    assert scanner.feed("]}} trailing") == 3 and scanner.done
