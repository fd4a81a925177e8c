"""An incremental JSON validator: consumes text as it streams and knows how far it is valid.

It records where each member of the top-level object starts and ends, so a tool-call parser can
stream the raw text of one member's value. Strict JSON (RFC 8259); no third-party parser.
"""
from __future__ import annotations

import re

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*')
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"

# States
(_VALUE, _OBJ_OPEN, _OBJ_KEY, _COLON, _AFTER, _ARR_OPEN, _STRING, _ESCAPE, _UHEX, _LITERAL,
 _N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP) = range(18)
# Number states in which the number may end.
_NUMBER_ENDS = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP})
_NUMBER_STATES = frozenset({_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP})


class JsonSyntaxError(ValueError):
    """The text stops being a prefix of valid JSON at `pos` (an offset into everything fed)."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(f"{message} at offset {pos}")
        self.pos = pos


class Member:
    """One member of the top-level object: offsets of its raw key and value (-1: not seen yet)."""

    __slots__ = ("key_start", "key_end", "value_start", "value_end")

    def __init__(self, key_start: int, key_end: int) -> None:
        self.key_start, self.key_end = key_start, key_end
        self.value_start = self.value_end = -1


class JsonScanner:
    """Validate one JSON value fed in pieces.

    `feed(text)` consumes up to the end of the value and returns how many characters it used; it
    raises JsonSyntaxError at the first character that cannot continue valid JSON. `pos` is the
    number of characters consumed in total, `done` whether the value is complete, `first` the
    value's first character, `members` the top-level object's members seen so far.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.done = False
        self.first = ""
        self.members: list[Member] = []
        self._stack: list[str] = []
        self._state = _VALUE
        self._in_key = False
        self._key_start = -1
        self._hex_left = 0
        self._literal = ""

    def feed(self, text: str) -> int:
        i, n = 0, len(text)
        base = self.pos
        try:
            while i < n and not self.done:
                i = self._step(text, i, base)
        except JsonSyntaxError as error:
            self.pos = error.pos
            raise
        self.pos = base + i
        return i

    def _step(self, text: str, i: int, base: int) -> int:
        """Consume from text[i]; return the next index. Strings are consumed a run at a time."""
        state = self._state
        c = text[i]
        if state == _STRING:
            j = _STRING_RUN.match(text, i).end()
            if j == len(text):
                return j
            c = text[j]
            if c == '"':
                self._end_string(base + j)
            elif c == "\\":
                self._state = _ESCAPE
            else:
                raise JsonSyntaxError("control character in string", base + j)
            return j + 1
        if state == _ESCAPE:
            if c not in _ESCAPES:
                raise JsonSyntaxError(f"bad escape \\{c}", base + i)
            if c == "u":
                self._state, self._hex_left = _UHEX, 4
            else:
                self._state = _STRING
            return i + 1
        if state == _UHEX:
            if c not in _HEX:
                raise JsonSyntaxError("bad \\u escape", base + i)
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _STRING
            return i + 1
        if state in _NUMBER_STATES:
            return self._number(c, i, base)
        if state == _LITERAL:
            if c != self._literal[0]:
                raise JsonSyntaxError(f"unexpected {c!r}", base + i)
            self._literal = self._literal[1:]
            if not self._literal:
                self._complete(base + i + 1)
            return i + 1
        if c in _WS:
            return i + 1
        if state == _VALUE or (state == _ARR_OPEN and c != "]"):
            self._start_value(c, base + i)
        elif state == _ARR_OPEN or (state == _OBJ_OPEN and c == "}"):
            self._stack.pop()
            self._complete(base + i + 1)
        elif state in (_OBJ_OPEN, _OBJ_KEY):
            if c != '"':
                raise JsonSyntaxError(f"expected a key, got {c!r}", base + i)
            self._state, self._in_key, self._key_start = _STRING, True, base + i
        elif state == _COLON:
            if c != ":":
                raise JsonSyntaxError(f"expected ':', got {c!r}", base + i)
            self._state = _VALUE
        else:  # _AFTER: inside a container, after a value
            top = self._stack[-1]
            if c == ",":
                self._state = _OBJ_KEY if top == "{" else _VALUE
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self._stack.pop()
                self._complete(base + i + 1)
            else:
                raise JsonSyntaxError(f"expected ',' or a closing bracket, got {c!r}", base + i)
        return i + 1

    def _start_value(self, c: str, at: int) -> None:
        if not self.first:
            self.first = c
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.members[-1].value_start = at
        if c == "{":
            self._stack.append("{")
            self._state = _OBJ_OPEN
        elif c == "[":
            self._stack.append("[")
            self._state = _ARR_OPEN
        elif c == '"':
            self._state, self._in_key = _STRING, False
        elif c == "-":
            self._state = _N_MINUS
        elif c == "0":
            self._state = _N_ZERO
        elif c in _DIGITS:
            self._state = _N_INT
        elif c in "tfn":
            self._state, self._literal = _LITERAL, {"t": "rue", "f": "alse", "n": "ull"}[c]
        else:
            raise JsonSyntaxError(f"expected a value, got {c!r}", at)

    def _end_string(self, at: int) -> None:
        if self._in_key:
            if len(self._stack) == 1:
                self.members.append(Member(self._key_start, at + 1))
            self._state = _COLON
        else:
            self._complete(at + 1)

    def _complete(self, end: int) -> None:
        """A value ended just before `end`."""
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.members[-1].value_end = end
        self._state = _AFTER

    def _number(self, c: str, i: int, base: int) -> int:
        state = self._state
        digit = c in _DIGITS
        if state == _N_MINUS and digit:
            self._state = _N_ZERO if c == "0" else _N_INT
        elif state == _N_INT and digit or state == _N_FRAC and digit or state == _N_EXP and digit:
            pass
        elif state in (_N_ZERO, _N_INT) and c == ".":
            self._state = _N_DOT
        elif state in (_N_ZERO, _N_INT, _N_FRAC) and c in "eE":
            self._state = _N_E
        elif state == _N_DOT and digit:
            self._state = _N_FRAC
        elif state == _N_E and c in "+-":
            self._state = _N_ESIGN
        elif state in (_N_E, _N_ESIGN) and digit:
            self._state = _N_EXP
        elif state in _NUMBER_ENDS:
            # The number ended at the previous character; c belongs to what follows it.
            if not self._stack:
                self.done = True
                return i
            self._complete(base + i)
            return i
        else:
            raise JsonSyntaxError(f"bad number at {c!r}", base + i)
        return i + 1

    def finish(self) -> bool:
        """At the end of input: a bare top-level number is complete now. Returns done."""
        if not self.done and not self._stack and self._state in _NUMBER_ENDS:
            self.done = True
        return self.done
