"""The regex front end: the language it compiles must be the one Python's re (ASCII mode) fully matches."""
from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rawserve.engine.guided.grammar import (EMPTY, Alt, ByteSet, Bytes, Grammar, GrammarError, Ref, Seq, accepts,
                                            lit, seq)
from rawserve.engine.guided.regex import parse_regex


def matches(pattern: str, text: str) -> bool:
    return accepts(Grammar({"root": parse_regex(pattern)}), text)


def oracle(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


# Patterns whose meaning is the same in Python (re.ASCII) and here, with strings on both sides of the line.
# `.` is only fed strings without \r, U+2028 and U+2029 (Python's `.` allows them; ECMA's and ours do not).
ORACLE_CASES: list[tuple[str, list[str]]] = [
    (r"\d{3}-\d{4}", ["123-4567", "123-456", "1234-567", "abc-defg", "123-45678", "", "١٢٣-٤٥٦٧"]),
    (r"(cat|category|cattle)", ["cat", "category", "cattle", "catt", "categor", "cats", "", "dog"]),
    (r".{0,5}", ["", "a", "中文", "😀😀😀😀😀", "😀😀😀😀😀😀", "abcdef", "é\t", "a\nb"]),
    (r"[α-ω]+", ["αβγ", "ω", "", "a", "αa", "Α"]),
    (r'[^"]*', ["", "é", "abc", 'a"b', '"', "中文😀", "\n"]),
    (r"a\.b\\c\td", ["a.b\\c\td", "axb\\c\td", "a.b\\c d"]),
    (r"\u00e9+", ["é", "ééé", "e", ""]),
    (r"a*", ["", "a", "aaaa", "b", "ab"]),
    (r"[a-zA-Z_][a-zA-Z0-9_]*", ["x", "_foo9", "Bar_Baz", "9abc", "", "a-b", "é"]),
    (r"[\w.+-]+@[\w-]+\.[a-z]{2,}", ["a.b+c@ex-ample.com", "x@y.io", "x@y.c", "@y.com", "x@.com", "a b@c.de"]),
    (r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", ["2024-02-29", "2024-13-01", "2024-00-10", "2024-12-31",
                                                    "2024-12-32", "24-12-31", "2024-1-01"]),
    (r"^(?:\+?1[-. ]?)?\(?\d{3}\)?[-. ]?\d{3}[-. ]?\d{4}$", ["+1 (555) 123-4567", "555.123.4567",
                                                           "5551234567", "555-1234", "+2 555 123 4567"]),
    (r"(ab|a)(bc|c)?", ["abc", "ab", "a", "abbc", "ac", "abcc"]),
    (r"(?P<year>\d{2})(?P<sep>[/-])x", ["12/x", "12-x", "12x", "123/x"]),
    (r"a|", ["a", "", "aa"]),
    (r"|b|", ["", "b", "bb"]),
    (r"x{2,}y{,2}z{1}", ["xx", "xxxyyz", "xxz", "xz", "xxyyyz"]),
    (r"(a|b)*?c+?d??e{1,3}?", ["c", "abcde", "ababccceee", "d", "cdeeee"]),
    (r"[]a]+", ["]", "a]a", "b", ""]),
    (r"[-a]+[a-]", ["--", "a-", "aa", "b-"]),
    (r"[^a-z0-9]", ["A", "-", "é", "😀", "a", "5", "", "AB"]),
    (r"[\d\s]+", ["1 2\t3", "12", " ", "a", ""]),
    (r"\D\W", ["a!", "é ", "1!", "a_", "😀😀"]),
    (r"[\x41-\x43]\x7e\n\r\f\v\0", ["A~\n\r\x0c\x0b\x00", "D~\n\r\x0c\x0b\x00"]),
    (r"\*\+\?\(\)\[\]\{\}\|\^\$\/\-", ["*+?()[]{}|^$/-"]),
    (r"a{3}", ["aaa", "aa", "aaaa"]),
    (r"(ab){2}", ["abab", "ab", "ababab"]),
    (r"((a|b)c)+", ["ac", "acbc", "a", "abc", ""]),
    (r"a{0}b", ["b", "ab"]),
    (r"a{", ["a{", "a"]),
    (r"a{x}", ["a{x}", "ax"]),
    (r"[\w-]{2}", ["a-", "-_", "a", "!a"]),
]


@pytest.mark.parametrize(("pattern", "texts"), ORACLE_CASES, ids=[p for p, _ in ORACLE_CASES])
def test_language_equals_python_re_fullmatch(pattern: str, texts: list[str]) -> None:
    for text in texts:
        assert matches(pattern, text) == oracle(pattern, text), (pattern, text)


@pytest.mark.parametrize(("pattern", "accepted", "rejected"), [
    # ECMA `.`: no line terminator at all, unlike Python, which only excludes \n.
    (r".", ["a", "é", "\t", "😀"], ["\n", "\r", "\u2028", "\u2029", "", "ab"]),
    # ECMA \s includes Unicode spaces; \S is its complement over all of Unicode.
    (r"\s", [" ", "\t", "\n", "\r", "\v", "\f", "\u00a0", "\u2003", "\u3000", "\ufeff"], ["a", "\x1c", "_"]),
    (r"\S", ["a", "é", "😀", "\x1c"], [" ", "\u00a0", "\u3000", "\n"]),
    (r"[^\s]", ["a"], ["\u2003", " "]),
    # \d and \w are ASCII only.
    (r"\d\w", ["1a", "9_"], ["١a", "1é"]),
    (r"\u{1F600}\u{e9}", ["😀é"], ["😀", "é"]),
    (r"\ud83d\ude00", ["😀"], ["\\ud83d"]),
    (r"\cJ\x", ["\nx"], []),  # \cJ is a control char; \x with no hex digits is an error -> see refusals
    (r"^abc$", ["abc"], ["ab", "^abc$"]),
    (r"^a$|^b$", ["a", "b"], ["ab", ""]),
    (r"\Aab\z", ["ab"], ["a"]),
    (r"a(?#a comment)b", ["ab"], ["a", "b"]),
    (r"[\b]", ["\b"], ["b"]),
    (r"(?<year>\d{2})-", ["12-"], ["1-"]),  # ECMA's named group; Python 3.11 lacks it
])
def test_ecma_semantics_where_python_differs(pattern: str, accepted: list[str], rejected: list[str]) -> None:
    if pattern == r"\cJ\x":
        with pytest.raises(GrammarError, match="hex digits"):
            parse_regex(pattern)
        pattern = r"\cJx"
    for text in accepted:
        assert matches(pattern, text), (pattern, text)
    for text in rejected:
        assert not matches(pattern, text), (pattern, text)


@pytest.mark.parametrize(("pattern", "names"), [
    (r"(?=a)a", ["lookahead", "position 0"]),
    (r"a(?!b)", ["negative lookahead", "position 1"]),
    (r"(?<=a)b", ["lookbehind", "position 0"]),
    (r"(?<!a)b", ["negative lookbehind"]),
    (r"(a)\1", ["backreference", "\\1", "position 3"]),
    (r"(a)b\9", ["backreference", "\\9"]),
    (r"(?<x>a)\k<x>", ["named backreference", "\\k<name>"]),
    (r"(?P<x>a)(?P=x)", ["backreference", "(?P=name)"]),
    (r"\bword", ["word boundary", "\\b"]),
    (r"a\Bb", ["word boundary", "\\B", "position 1"]),
    (r"a++", ["possessive", "'++'"]),
    (r"a*+", ["possessive"]),
    (r"a{2}+", ["possessive"]),
    (r"(?i)abc", ["inline flag", "(?i)"]),
    (r"(?i:abc)", ["inline flag"]),
    (r"(?s-m:a)", ["inline flag"]),
    (r"(?>a)", ["atomic group"]),
    (r"(ab", ["unbalanced parenthesis", "never closed", "position 0"]),
    (r"ab)", ["unbalanced parenthesis", "position 2"]),
    (r"((a)|b", ["unbalanced parenthesis"]),
    (r"[ab", ["unbalanced bracket", "position 0"]),
    (r"x[^", ["unbalanced bracket", "position 1"]),
    (r"*a", ["nothing to repeat", "position 0"]),
    (r"a|+b", ["nothing to repeat", "position 2"]),
    (r"(?:{2})", ["nothing to repeat"]),
    (r"^*", ["nothing to repeat"]),
    (r"a**", ["multiple repeat"]),
    (r"a{2}{3}", ["multiple repeat"]),
    (r"a{5,2}", ["minimum above its maximum", "{5,2}"]),
    (r"a{10001}", ["10,000", "10001"]),
    (r"a{1,20000}", ["10,000", "20000"]),
    (r"a{99999999999999999999}", ["10,000"]),
    (r"a^b", ["'^'", "position 1"]),
    (r"(^a)", ["'^'"]),
    (r"a$b", ["'$'", "position 1"]),
    (r"(a$)", ["'$'"]),
    (r"[z-a]", ["out of order", "'z-a'"]),
    (r"[a-\d]", ["range"]),
    (r"\q", ["unknown escape", "\\q"]),
    ("abc\\", ["lone backslash"]),
    (r"\x4", ["hex digits"]),
    (r"\u12", ["hex digits"]),
    (r"\u{110000}", ["10FFFF"]),
    (r"\ud800", ["surrogate"]),
    (r"\p{L}", ["Unicode property"]),
    (r"[^\s\S]", ["matches no character"]),
    (r"\01", ["octal"]),
])
def test_refusals_name_the_construct(pattern: str, names: list[str]) -> None:
    with pytest.raises(GrammarError) as info:
        parse_regex(pattern)
    for name in names:
        assert name in str(info.value), (pattern, str(info.value))


def test_adjacent_literals_merge_into_one_bytes_node() -> None:
    assert parse_regex(r"ab\.c\u00e9") == Bytes("ab.cé".encode())
    assert parse_regex(r"(?:ab)(cd)") == Bytes(b"abcd")
    assert parse_regex(r"a{3}") == Bytes(b"aaa")


def test_sequences_in_a_sequence_are_flattened_and_join_their_neighbours_literals_at_their_ends() -> None:
    """seq copies a sequence item's middle whole (every Seq is flat already) and joins its end literals with the
    literals beside it."""
    x, y, r = ByteSet(((48, 57),)), ByteSet(((97, 122),)), Ref("r")
    inner = seq(lit("a"), x, lit("b"))
    assert seq(lit("<"), inner, lit(">")) == Seq((Bytes(b"<a"), x, Bytes(b"b>")))
    assert seq(inner, seq(lit("c"), y), r, inner) == Seq((Bytes(b"a"), x, Bytes(b"bc"), y, r, Bytes(b"a"), x,
                                                           Bytes(b"b")))
    # a literal joined with nothing stays the node it was: a schema's size counts nodes by identity
    one = lit("q")
    assert seq(x, one, y).items[1] is one and seq(seq(x, one), y).items[1] is one
    assert seq(lit(""), x, EMPTY) is x and seq() == EMPTY


def test_ascii_class_is_one_byte_set() -> None:
    assert parse_regex(r"[a-zA-Z0-9_]") == ByteSet(((48, 57), (65, 90), (95, 95), (97, 122)))
    assert parse_regex(r"\w") == parse_regex(r"[a-zA-Z0-9_]")
    assert parse_regex(r"[x]") == Bytes(b"x")


def test_non_ascii_class_is_utf8_byte_sequences() -> None:
    node = parse_regex(r"[a-zé]")
    assert isinstance(node, Alt)
    assert node.items == (ByteSet(((97, 122),)), Seq((ByteSet(((0xC3, 0xC3),)), ByteSet(((0xA9, 0xA9),)))))


def test_unicode_class_excludes_surrogates_and_spans_planes() -> None:
    assert matches(r"[^a]", "\U0010ffff")
    assert matches(r"[^a]", "\ud7ff")
    assert not matches(r"[^a]", b"\xed\xa0\x80")  # an encoded surrogate is not UTF-8


# ----- property tests against Python's re

PROPERTY_PATTERNS = [
    r"\d{3}-\d{4}",
    r"(cat|category|cattle)",
    r"[a-zA-Z_][a-zA-Z0-9_]{0,8}",
    r"[α-ω]{1,4}",
    r'[^"]{0,6}',
    r"[\w.+-]{1,5}@[\w-]{1,5}\.[a-z]{2,3}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(a|bc|)*d?",
    r"(x{1,2}y?){2,3}",
    r"[^a-c]\W\D",
]


def _compiled(pattern: str) -> re.Pattern[str]:
    # re.ASCII pins \d and \w to ASCII; Hypothesis's from_regex fails on it with non-ASCII classes.
    return re.compile(pattern, re.ASCII if pattern.isascii() else 0)


def _valid_text(text: str) -> bool:
    """Text UTF-8 can carry and on which ECMA and Python agree (no lone surrogates)."""
    return not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@pytest.mark.parametrize("pattern", PROPERTY_PATTERNS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_strings_generated_from_the_pattern_are_accepted(pattern: str, data: st.DataObject) -> None:
    text = data.draw(st.from_regex(_compiled(pattern), fullmatch=True).filter(_valid_text))
    assert matches(pattern, text), (pattern, text)


@pytest.mark.parametrize("pattern", PROPERTY_PATTERNS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_text_agrees_with_python_re(pattern: str, data: st.DataObject) -> None:
    # Draw from the pattern's own characters plus a few strangers, so matches are not vanishingly rare.
    alphabet = sorted(set(pattern) | set("0123456789-@.aé😀 \t\"_"))
    near = st.from_regex(_compiled(pattern), fullmatch=True).filter(_valid_text)
    mutated = st.tuples(near, st.text(alphabet=alphabet, max_size=2)).map(lambda t: t[0] + t[1])
    text = data.draw(st.one_of(st.text(alphabet=alphabet, max_size=12), mutated))
    assert matches(pattern, text) == oracle(pattern, text), (pattern, text)
