"""Compiles a user regex (`guided_regex`, JSON Schema `pattern`) into the grammar IR; the whole output must match.

ECMA-262 syntax plus common Python spellings. Constructs a finite automaton cannot express (lookaround,
backreferences, word boundaries) and inline flags are refused with a GrammarError naming the construct and position.
"""
from __future__ import annotations

import re

from .grammar import (EMPTY, Bytes, GrammarError, Node, Repeat, Seq, alt, codepoint_ranges,
                      complement_codepoints, iter_nodes, lit, seq)

MAX_REPEAT = 10_000  # a bound above this unrolls into an automaton too large to build per request

Ranges = list[tuple[int, int]]

# \d and \w are ASCII (ECMA without the `i`/`u` flags, and Python's re.ASCII); \s is ECMA WhiteSpace +
# LineTerminator, which includes the Unicode spaces below.
_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                  (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_CLASS_ESCAPES: dict[str, Ranges] = {
    "d": _DIGIT, "D": complement_codepoints(_DIGIT),
    "w": _WORD, "W": complement_codepoints(_WORD),
    "s": _SPACE, "S": complement_codepoints(_SPACE),
}
# `.` follows ECMA, not Python: it excludes all four line terminators (\n, \r, U+2028, U+2029), so a
# model constrained by `.*` cannot emit a bare carriage return either.
_DOT: Ranges = complement_codepoints([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)])
_CLASS_NODES: dict[str, Node] = {k: codepoint_ranges(v) for k, v in _CLASS_ESCAPES.items()}
_DOT_NODE = codepoint_ranges(_DOT)

_SIMPLE_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B}
_BRACE_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_INLINE_FLAGS = re.compile(r"\(\?[a-zA-Z]*(?:-[a-zA-Z]*)?[:)]")
_FINITE = "guided decoding needs a pattern a finite automaton can match"


def parse_regex(pattern: str, max_nodes: int | None = None) -> Node:
    """Compile `pattern` to a Node matching exactly the strings the pattern fully matches.

    `^` / `\\A` at the start and `$` / `\\z` / `\\Z` at the end of a top-level branch are accepted and
    dropped (the match is whole-output anyway); anywhere else they are refused. Lazy quantifiers
    match the same language as greedy ones. With `max_nodes`, parsing stops with a GrammarError as soon as it
    has made more IR nodes than that (a JSON Schema's budget), instead of finishing a 20,000-branch pattern first.
    """
    return _Parser(pattern, max_nodes).parse()


class _Parser:
    def __init__(self, src: str, max_nodes: int | None = None) -> None:
        self.src = src
        self.pos = 0
        self.max_nodes = max_nodes
        self.num_nodes = 0  # nodes made so far; shared constants (\\d, `.`) count nothing

    def charge(self, node: Node, count: int) -> Node:
        self.num_nodes += count
        if self.max_nodes is not None and self.num_nodes > self.max_nodes:
            raise self.fail(f"the pattern makes more than {self.max_nodes:,} grammar nodes")
        return node

    def fail(self, message: str, pos: int | None = None) -> GrammarError:
        at = self.pos if pos is None else pos
        # A long pattern is quoted by its start only: the message goes back in a 400, and echoing 190 KB helps no one.
        shown = repr(self.src) if len(self.src) <= 200 else f"{self.src[:200]!r}... ({len(self.src):,} characters)"
        return GrammarError(f"regex {shown}, position {at}: {message}")

    def refuse(self, construct: str, pos: int, why: str = _FINITE) -> GrammarError:
        return self.fail(f"{construct} is not supported ({why})", pos)

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.src[i] if i < len(self.src) else ""

    # ----- structure: alternation > sequence > quantified atom

    def parse(self) -> Node:
        node = self.alternation(0)
        if self.pos < len(self.src):  # alternation stops only at ')' or the end
            raise self.fail("unbalanced parenthesis: ')' has no matching '('")
        return node

    def alternation(self, depth: int) -> Node:
        branches = [self.sequence(depth)]
        while self.peek() == "|":
            self.pos += 1
            branches.append(self.sequence(depth))
        node = alt(*branches)
        return self.charge(node, 1) if len(branches) > 1 else node

    def sequence(self, depth: int) -> Node:
        items: list[Node] = []
        while self.pos < len(self.src) and self.peek() not in "|)":
            if self.quantifier_here():
                raise self.fail(f"quantifier {self.peek()!r} has nothing to repeat")
            atom = self.atom(depth, at_branch_start=not items)
            if atom is None:  # an anchor or a comment group: nothing to match, nothing to quantify
                continue
            items.append(self.quantified(atom))
        node = seq(*items)
        # Counts the literals the sequence holds and the Seq itself; other items were counted where they were
        # made. An estimate of the final size (a literal group may be counted twice), used only as a budget.
        if isinstance(node, Seq):
            return self.charge(node, 1 + sum(isinstance(item, Bytes) for item in node.items))
        return self.charge(node, 1) if isinstance(node, Bytes) and node.data else node

    def quantifier_here(self) -> bool:
        c = self.peek()
        return c in ("*", "+", "?") or (c == "{" and self.brace_quantifier() is not None)

    def brace_quantifier(self) -> re.Match[str] | None:
        m = _BRACE_QUANTIFIER.match(self.src, self.pos)
        # `{`, `{}` and `{,}` are literal text (ECMA Annex B); `{,n}` is Python's spelling of {0,n}.
        if m is None or (not m.group(1) and not m.group(3)):
            return None
        return m

    def bound(self, digits: str, pos: int) -> int:
        if len(digits) > 6 or int(digits) > MAX_REPEAT:
            raise self.fail(f"repetition bound {digits} is above the limit of {MAX_REPEAT:,}", pos)
        return int(digits)

    def quantified(self, atom: Node) -> Node:
        start = self.pos
        c = self.peek()
        if c == "*":
            lo, hi = 0, None
        elif c == "+":
            lo, hi = 1, None
        elif c == "?":
            lo, hi = 0, 1
        elif (m := self.brace_quantifier() if c == "{" else None) is not None:
            lo = self.bound(m.group(1), start) if m.group(1) else 0
            if m.group(2) is None:
                hi = lo
            else:
                hi = self.bound(m.group(3), start) if m.group(3) else None
            if hi is not None and lo > hi:
                raise self.fail(f"quantifier {m.group(0)} has its minimum above its maximum", start)
            self.pos = m.end() - 1
        else:
            return atom
        self.pos += 1
        if self.peek() == "+":
            raise self.refuse(f"possessive quantifier {self.src[start:self.pos + 1]!r}", start,
                              "use the greedy form: guided decoding matches a language, not a search")
        if self.peek() == "?":  # lazy: the same set of full matches as greedy
            self.pos += 1
        if self.quantifier_here():
            raise self.fail(f"quantifier {self.peek()!r} follows another quantifier (multiple repeat)")
        node = _repeat(atom, lo, hi)
        return self.charge(node, 1) if isinstance(node, Repeat) else node

    def atom(self, depth: int, at_branch_start: bool) -> Node | None:
        c = self.peek()
        if c == "(":
            return self.group(depth)
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return _DOT_NODE
        if c == "\\":
            return self.escape(depth, at_branch_start)
        if c == "^":
            if depth == 0 and at_branch_start:
                self.pos += 1
                return None
            raise self.refuse("anchor '^' away from the start of the pattern", self.pos,
                              "the whole output is matched, so '^' may only open the pattern")
        if c == "$":
            if depth == 0 and self.peek(1) in ("", "|"):
                self.pos += 1
                return None
            raise self.refuse("anchor '$' away from the end of the pattern", self.pos,
                              "the whole output is matched, so '$' may only close the pattern")
        self.pos += 1
        return self.literal(ord(c), self.pos - 1)

    def literal(self, cp: int, pos: int) -> Node:
        if 0xD800 <= cp <= 0xDFFF:
            raise self.fail(f"lone surrogate U+{cp:04X} cannot be encoded as UTF-8", pos)
        return lit(chr(cp))

    def group(self, depth: int) -> Node | None:
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            head = self.src[self.pos:self.pos + 3]
            if head.startswith("?:"):
                self.pos += 2
            elif head in ("?<=", "?<!"):
                kind = "lookbehind" if head == "?<=" else "negative lookbehind"
                raise self.refuse(f"{kind} '({head}'", start)
            elif head.startswith("?="):
                raise self.refuse("lookahead '(?='", start)
            elif head.startswith("?!"):
                raise self.refuse("negative lookahead '(?!'", start)
            elif head == "?P=":
                raise self.refuse("backreference '(?P=name)'", start)
            elif head == "?P<" or head.startswith("?<"):
                self.pos += 3 if head == "?P<" else 2
                self.group_name(start)
            elif head.startswith("?#"):  # Python comment group
                close = self.src.find(")", self.pos)
                if close < 0:
                    raise self.fail("unbalanced parenthesis: comment '(?#' is never closed", start)
                self.pos = close + 1
                return None
            elif head.startswith("?>"):
                raise self.refuse("atomic group '(?>'", start)
            elif head.startswith("?("):
                raise self.refuse("conditional group '(?('", start)
            elif (m := _INLINE_FLAGS.match(self.src, start)) is not None:
                raise self.refuse(f"inline flag group {m.group(0)!r}", start,
                                  "flags such as case-insensitivity change every character; spell it out")
            else:
                raise self.refuse(f"group syntax {self.src[start:start + 3]!r}", start)
        node = self.alternation(depth + 1)
        if self.peek() != ")":
            raise self.fail("unbalanced parenthesis: '(' is never closed", start)
        self.pos += 1
        return node

    def group_name(self, start: int) -> None:
        close = self.src.find(">", self.pos)
        name = self.src[self.pos:close] if close >= 0 else ""
        if not name.isidentifier():
            raise self.fail("bad group name in named group", start)
        self.pos = close + 1

    # ----- escapes and classes

    def escape(self, depth: int, at_branch_start: bool) -> Node | None:
        start = self.pos
        e = self.peek(1)
        if e in _CLASS_NODES:
            self.pos += 2
            return _CLASS_NODES[e]
        if e in ("b", "B"):
            raise self.refuse(f"word boundary '\\{e}'", start)
        if e == "A" and depth == 0 and at_branch_start:
            self.pos += 2
            return None
        if e in ("z", "Z") and depth == 0 and self.peek(2) in ("", "|"):
            self.pos += 2
            return None
        if e in ("A", "z", "Z", "G"):
            raise self.refuse(f"anchor '\\{e}' away from the pattern's ends", start)
        return self.literal(self.escape_char(in_class=False), start)

    def escape_char(self, in_class: bool) -> int:
        """The code point of the escape at self.pos (which is a backslash); advances past it."""
        start = self.pos
        e = self.peek(1)
        self.pos += 2
        if e == "":
            raise self.fail("pattern ends with a lone backslash", start)
        if e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e]
        if e == "b" and in_class:  # [\b] is backspace in both ECMA and Python
            return 0x08
        if e == "0":
            if self.peek().isdigit():
                raise self.refuse("octal escape '\\0' followed by digits", start, "write \\xHH instead")
            return 0
        if e.isdigit():
            raise self.refuse(f"backreference '\\{e}'", start)
        if e == "k" and self.peek() == "<":
            raise self.refuse("named backreference '\\k<name>'", start)
        if e in ("p", "P"):
            raise self.refuse(f"Unicode property escape '\\{e}'", start, "write the character ranges instead")
        if e == "x":
            return self.hex_digits(2, start)
        if e == "U":
            return self.hex_digits(8, start)
        if e == "u":
            return self.unicode_escape(start)
        if e == "c" and self.peek().isascii() and self.peek().isalpha():
            self.pos += 1
            return ord(self.src[self.pos - 1]) % 32
        if e.isascii() and e.isalnum():
            raise self.fail(f"unknown escape '\\{e}'", start)
        return ord(e)  # an escaped metacharacter or any other symbol stands for itself

    def hex_digits(self, count: int, start: int) -> int:
        digits = self.src[self.pos:self.pos + count]
        if len(digits) != count or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise self.fail(f"escape needs {count} hex digits", start)
        self.pos += count
        cp = int(digits, 16)
        if cp > 0x10FFFF:
            raise self.fail(f"escape U+{cp:X} is above U+10FFFF", start)
        return cp

    def unicode_escape(self, start: int) -> int:
        if self.peek() == "{":  # \u{1F600}
            close = self.src.find("}", self.pos)
            digits = self.src[self.pos + 1:close] if close >= 0 else ""
            if not 1 <= len(digits) <= 6 or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.fail("escape '\\u{...}' needs 1 to 6 hex digits", start)
            self.pos = close + 1
            cp = int(digits, 16)
            if cp > 0x10FFFF:
                raise self.fail(f"escape U+{cp:X} is above U+10FFFF", start)
            return cp
        cp = self.hex_digits(4, start)
        # A JSON-escaped astral character arrives as a surrogate pair: join the halves.
        if 0xD800 <= cp <= 0xDBFF and self.src.startswith("\\u", self.pos):
            save = self.pos
            self.pos += 2
            low = self.hex_digits(4, save) if self.peek() != "{" else -1
            if 0xDC00 <= low <= 0xDFFF:
                return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
            self.pos = save
        return cp

    def class_item(self) -> tuple[int, int] | Ranges:
        """One class member: a code point as (cp, cp), or a list of ranges for \\d, \\w, \\s and their negations."""
        if self.peek() == "\\":
            e = self.peek(1)
            if e in _CLASS_ESCAPES:
                self.pos += 2
                return _CLASS_ESCAPES[e]
            if e == "B":
                raise self.refuse("'\\B' inside a character class", self.pos)
            start = self.pos
            cp = self.escape_char(in_class=True)
        else:
            start = self.pos
            cp = ord(self.peek())
            self.pos += 1
        if 0xD800 <= cp <= 0xDFFF:
            raise self.fail(f"lone surrogate U+{cp:04X} cannot be encoded as UTF-8", start)
        return (cp, cp)

    def char_class(self) -> Node:
        start = self.pos
        self.pos += 1
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges: Ranges = []
        first = True
        while True:
            if self.pos >= len(self.src):
                raise self.fail("unbalanced bracket: '[' is never closed", start)
            if self.peek() == "]" and not first:  # a ']' first is a literal, as in Python
                self.pos += 1
                break
            first = False
            item_pos = self.pos
            item = self.class_item()
            # A '-' between two characters makes a range; before ']' or after \d etc. it is a literal
            # (ECMA Annex B), which keeps email-ish classes like [\w-.] working.
            if isinstance(item, tuple) and self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.class_item()
                if not isinstance(hi, tuple):
                    raise self.fail("a character range cannot end in a class escape", item_pos)
                if item[0] > hi[0]:
                    raise self.fail(f"character range {self.src[item_pos:self.pos]!r} is out of order",
                                    item_pos)
                ranges.append((item[0], hi[0]))
            elif isinstance(item, tuple):
                ranges.append(item)
            else:
                ranges.extend(item)
        if negate:
            ranges = complement_codepoints(ranges)
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return lit(chr(ranges[0][0]))
        try:
            node = codepoint_ranges(ranges)
        except GrammarError:
            raise self.fail("character class matches no character", start) from None
        return self.charge(node, sum(1 for _ in iter_nodes(node)))


def _repeat(atom: Node, lo: int, hi: int | None) -> Node:
    if hi == 0 or atom == EMPTY:
        return EMPTY
    if lo == hi == 1:
        return atom
    if isinstance(atom, Bytes) and lo == hi and len(atom.data) * lo <= 256:
        return Bytes(atom.data * lo)  # short fixed repeats of text stay one literal
    return Repeat(atom, lo, hi)
