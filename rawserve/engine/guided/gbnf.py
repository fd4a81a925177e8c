"""Compiles llama.cpp's GBNF grammar format into the grammar IR, and owns `check_grammar`, the checks every
front end's grammar must pass: defined rules, no left recursion, every rule able to finish.

Whitespace follows llama.cpp's parser (src/llama-grammar.cpp) so grammars written for it parse the same way.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from .grammar import (ANY_CHAR, EMPTY, Alt, Bytes, ByteSet, Grammar, GrammarError, Node, Ref, Repeat,
                      Seq, Token, alt, codepoint_ranges, complement_codepoints, lit, seq)

MAX_REPEAT = 10_000  # as in the regex front end; llama.cpp refuses min > 2000 and widens max > 2000 to unbounded

_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = {"t": 0x09, "r": 0x0D, "n": 0x0A, "\\": 0x5C, '"': 0x22, "[": 0x5B, "]": 0x5D, "-": 0x2D}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def parse_gbnf(text: str, token_id: Callable[[str], int | None] | None = None) -> Grammar:
    """Parse a GBNF grammar whose start rule is `root`; GrammarError names the line of any fault.

    `token_id` resolves a token reference such as `<think>`: it is called with the whole text, angle
    brackets included (as llama.cpp tokenizes it), and returns the id of the single token it spells,
    or None. `<[123]>` names an id directly and needs no resolver.
    """
    parser = _Parser(text, token_id)
    grammar = parser.parse()
    check_grammar(grammar, parser.rule_lines)
    return grammar


class _Parser:
    def __init__(self, src: str, token_id: Callable[[str], int | None] | None) -> None:
        self.src = src
        self.pos = 0
        self.token_id = token_id
        self.rules: dict[str, Node] = {}
        self.rule_lines: dict[str, int] = {}
        self.first_refs: dict[str, tuple[str, int]] = {}  # name -> (referring rule, position)
        self.rule = ""
        self._line_mark = (0, 1)  # (position, its line)

    def line(self, pos: int | None = None) -> int:
        # Counted on from the last position asked about: from the start each time, 20,000 rules took seconds.
        at = self.pos if pos is None else pos
        last_at, last_line = self._line_mark
        if at < last_at:
            last_at, last_line = 0, 1
        line = last_line + self.src.count("\n", last_at, at)
        self._line_mark = (at, line)
        return line

    def fail(self, message: str, pos: int | None = None) -> GrammarError:
        return GrammarError(f"grammar line {self.line(pos)}: {message}")

    def peek(self, offset: int = 0) -> str:
        i = self.pos + offset
        return self.src[i] if i < len(self.src) else ""

    def space(self, newline_ok: bool) -> None:
        """Skip blanks and comments; newlines only where llama.cpp allows them: between rules, after
        `::=` and `|`, and anywhere inside parentheses."""
        src, n = self.src, len(self.src)
        while self.pos < n:
            c = src[self.pos]
            if c == "#":
                while self.pos < n and src[self.pos] not in "\r\n":
                    self.pos += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                self.pos += 1
            else:
                break

    def name(self) -> str:
        start = self.pos
        while self.peek() in _WORD_CHARS:
            self.pos += 1
        if self.pos == start:
            found = repr(self.peek()) if self.peek() else "the end"
            raise self.fail(f"expecting a rule name, found {found}")
        return self.src[start:self.pos]

    # ----- rules

    def parse(self) -> Grammar:
        self.space(True)
        while self.pos < len(self.src):
            self.rule_definition()
        for name, (referrer, pos) in self.first_refs.items():
            if name not in self.rules:
                raise self.fail(f"rule {referrer!r} refers to undefined rule {name!r}", pos)
        if "root" not in self.rules:
            raise GrammarError("grammar has no 'root' rule; the start rule must be named root")
        return Grammar(self.rules, start="root", notes={"source": "gbnf"})

    def rule_definition(self) -> None:
        start = self.pos
        if self.peek() not in _WORD_CHARS and start > 0:
            raise self.fail(f"expecting a rule name, found {self.peek()!r} (a rule continues onto the next "
                            "line only after '|' or inside parentheses)")
        name = self.name()
        self.space(False)
        if not self.src.startswith("::=", self.pos):
            raise self.fail(f"expecting '::=' after rule name {name!r}")
        if name in self.rules:
            raise self.fail(f"rule {name!r} is defined twice (first on line {self.rule_lines[name]})", start)
        self.pos += 3
        self.rule = name
        self.rule_lines[name] = self.line(start)
        self.space(True)
        self.rules[name] = self.alternates(nested=False)
        # Outside parentheses a rule ends at the end of its line: whatever stopped the sequence must be
        # a newline (or the end), exactly as llama.cpp's parse_rule demands.
        c = self.peek()
        if c == "\r":
            self.pos += 2 if self.peek(1) == "\n" else 1
        elif c == "\n":
            self.pos += 1
        elif c == ")":
            raise self.fail(f"unbalanced ')' in rule {name!r}")
        elif c:
            raise self.fail(f"unexpected {c!r} in rule {name!r}")
        self.space(True)

    def alternates(self, nested: bool) -> Node:
        branches = [self.sequence(nested)]
        while self.peek() == "|":
            self.pos += 1
            self.space(True)  # a newline after '|' continues the rule, even outside parentheses
            branches.append(self.sequence(nested))
        return alt(*branches)

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while self.pos < len(self.src):
            c = self.peek()
            if c == '"':
                item = self.literal()
            elif c == "[":
                item = self.char_class()
            elif c in ("<", "!"):
                item = self.token()
            elif c in _WORD_CHARS:
                item = self.reference()
            elif c == "(":
                item = self.group()
            elif c == ".":
                self.pos += 1
                item = ANY_CHAR
            elif c in ("*", "+", "?", "{"):
                if not items:
                    raise self.fail(f"{c!r} has no preceding item to repeat in rule {self.rule!r}")
                items[-1] = self.repetition(items[-1], nested)
                continue
            else:
                break
            items.append(item)
            self.space(nested)
        return seq(*items)

    def repetition(self, item: Node, nested: bool) -> Node:
        start = self.pos
        c = self.peek()
        self.pos += 1
        self.space(nested)
        if c != "{":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            return _repeat(item, lo, hi)
        lo = self.integer(start)
        self.space(nested)
        hi: int | None = lo
        if self.peek() == ",":
            self.pos += 1
            self.space(nested)
            hi = self.integer(start) if self.peek().isdigit() else None
            self.space(nested)
        if self.peek() != "}":
            raise self.fail(f"expecting '}}' to close the repetition in rule {self.rule!r}")
        self.pos += 1
        self.space(nested)
        if hi is not None and lo > hi:
            raise self.fail(f"repetition {self.src[start:self.pos].strip()} in rule {self.rule!r} has its "
                            "minimum above its maximum", start)
        return _repeat(item, lo, hi)

    def integer(self, start: int) -> int:
        begin = self.pos
        while self.peek().isascii() and self.peek().isdigit():
            self.pos += 1
        digits = self.src[begin:self.pos]
        if not digits:
            raise self.fail(f"expecting an integer in the repetition in rule {self.rule!r}")
        if len(digits) > 6 or int(digits) > MAX_REPEAT:
            raise self.fail(f"repetition bound {digits} in rule {self.rule!r} is above the limit of "
                            f"{MAX_REPEAT:,}", start)
        return int(digits)

    # ----- items

    def reference(self) -> Node:
        pos = self.pos
        name = self.name()
        self.first_refs.setdefault(name, (self.rule, pos))
        return Ref(name)

    def group(self) -> Node:
        start = self.pos
        self.pos += 1
        self.space(True)
        node = self.alternates(nested=True)
        if self.peek() != ")":
            found = repr(self.peek()) if self.peek() else "the end"
            raise self.fail(f"expecting ')' to close the '(' opened on line {self.line(start)} in rule "
                            f"{self.rule!r}, found {found}")
        self.pos += 1
        return node

    def char(self) -> int:
        """One code point of a literal or class, escapes decoded; advances past it."""
        start = self.pos
        c = self.peek()
        if c != "\\":
            self.pos += 1
            cp = ord(c)
        elif (e := self.peek(1)) in _ESCAPES:
            self.pos += 2
            cp = _ESCAPES[e]
        elif e in _HEX_ESCAPES:
            size = _HEX_ESCAPES[e]
            digits = self.src[self.pos + 2:self.pos + 2 + size]
            if len(digits) != size or not set(digits) <= _HEX:
                raise self.fail(f"escape '\\{e}' needs {size} hex digits in rule {self.rule!r}", start)
            self.pos += 2 + size
            cp = int(digits, 16)
        else:
            raise self.fail(f"unknown escape '\\{e}' in rule {self.rule!r}", start)
        if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            raise self.fail(f"U+{cp:04X} in rule {self.rule!r} is not a character UTF-8 can encode", start)
        return cp

    def literal(self) -> Node:
        start = self.pos
        self.pos += 1
        chars: list[str] = []
        while self.peek() != '"':
            if not self.peek():
                raise self.fail(f"unterminated string in rule {self.rule!r}", start)
            chars.append(chr(self.char()))
        self.pos += 1
        return lit("".join(chars))

    def char_class(self) -> Node:
        start = self.pos
        self.pos += 1
        negate = self.peek() == "^"
        if negate:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.fail(f"unterminated character class in rule {self.rule!r}", start)
            item_pos = self.pos
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.peek(1) not in ("]", ""):  # `[a-]` ends in a literal '-'
                self.pos += 1
                hi = self.char()
                if lo > hi:
                    raise self.fail(f"character range {self.src[item_pos:self.pos]!r} in rule "
                                    f"{self.rule!r} is out of order", item_pos)
            ranges.append((lo, hi))
        self.pos += 1
        if not ranges:
            raise self.fail(f"empty character class {self.src[start:self.pos]!r} in rule {self.rule!r}", start)
        if negate:
            ranges = complement_codepoints(ranges)
        try:
            return codepoint_ranges(ranges)
        except GrammarError:
            raise self.fail(f"character class {self.src[start:self.pos]!r} in rule {self.rule!r} matches "
                            "no character", start) from None

    def token(self) -> Node:
        start = self.pos
        if self.peek() == "!":
            raise self.fail(f"negated token reference '!<...>' in rule {self.rule!r} is not supported "
                            "(the grammar IR matches tokens by id, not by exclusion)")
        close = self.src.find(">", self.pos)
        if close < 0:
            raise self.fail(f"unterminated token reference '<' in rule {self.rule!r}")
        text = self.src[start:close + 1]
        self.pos = close + 1
        inner = text[1:-1]
        if inner.startswith("["):
            digits = inner[1:-1] if inner.endswith("]") else ""
            if not (digits.isascii() and digits.isdigit()):
                raise self.fail(f"token id reference {text!r} in rule {self.rule!r} must be <[digits]>", start)
            return Token(int(digits))
        if self.token_id is None:
            raise self.fail(f"token reference {text} in rule {self.rule!r} needs a tokenizer to resolve it; "
                            "write <[id]> instead", start)
        tid = self.token_id(text)
        if tid is None:
            raise self.fail(f"unknown token {text} in rule {self.rule!r}: it is not a single token of "
                            "this model's vocabulary", start)
        return Token(tid)


def _repeat(item: Node, lo: int, hi: int | None) -> Node:
    if hi == 0 or item == EMPTY:
        return EMPTY
    if lo == hi == 1:
        return item
    return Repeat(item, lo, hi)


# ----- grammar-wide checks, shared by every front end


def check_grammar(grammar: Grammar, rule_lines: Mapping[str, int] | None = None) -> None:
    """Raise GrammarError unless every referenced rule is defined, no rule can reach itself without
    consuming a symbol (left recursion: a top-down matcher would loop), and every rule can finish.

    `rule_lines` (rule name -> source line) lets a text front end point at the line.
    """
    grammar.check()

    def where(name: str) -> str:
        line = rule_lines.get(name) if rule_lines else None
        return f"grammar line {line}: " if line is not None else "grammar: "

    cycle = _left_recursive_cycle(grammar, nullable_rules(grammar))
    if cycle:
        raise GrammarError(f"{where(cycle[0])}rule {cycle[0]!r} is left-recursive ({' -> '.join(cycle)} "
                           "consumes no input on the way); rewrite it with repetition, e.g. "
                           "`expr ::= term (\"+\" term)*`")
    productive = _least_fixed_point(grammar, "productive")
    stuck = [name for name in grammar.rules if name not in productive]
    if stuck:
        names = ", ".join(repr(n) for n in stuck)
        raise GrammarError(f"{where(stuck[0])}rule {stuck[0]!r} can never finish: every alternative leads "
                           f"back into a rule that never finishes ({names})")


def nullable(node: Node, nullable_names: set[str] | frozenset[str]) -> bool:
    """Whether `node` can match the empty input, given which rules can."""
    if isinstance(node, Bytes):
        return not node.data
    if isinstance(node, (ByteSet, Token)):
        return False
    if isinstance(node, Seq):
        return all(nullable(item, nullable_names) for item in node.items)
    if isinstance(node, Alt):
        return any(nullable(item, nullable_names) for item in node.items)
    if isinstance(node, Repeat):
        return node.min == 0 or nullable(node.item, nullable_names)
    return node.name in nullable_names


def nullable_rules(grammar: Grammar) -> frozenset[str]:
    """The rules that can match the empty input."""
    return frozenset(_least_fixed_point(grammar, "nullable"))


def _least_fixed_point(grammar: Grammar, kind: str) -> set[str]:
    """The rules that are `kind`: "nullable" (can match the empty input, as `nullable()` reads a node) or
    "productive" (can derive some finite input: a sequence when all its items can, an alternation when one can,
    a repeat when it may stop at zero). Found as a circuit (Horn propagation): each node a gate that fires once
    enough of its children have, linear in the grammar. Re-evaluating every rule until nothing changed took
    minutes for 20,000 chained rules.
    """
    is_nullable = kind == "nullable"
    need: dict[object, int] = {}  # gate (id of a node, or a rule name) -> children still to fire
    parents: dict[object, list[object]] = {}
    fired: list[object] = []

    def gate(key: object, children: list[object], count: int) -> None:
        need[key] = count
        for child in children:
            parents.setdefault(child, []).append(key)
        if count == 0:
            fired.append(key)

    stack: list[Node] = []
    for name, body in grammar.rules.items():
        gate(name, [id(body)], 1)
        stack.append(body)
    while stack:
        node = stack.pop()
        key = id(node)
        if key in need:
            continue
        if isinstance(node, Bytes):
            gate(key, [], 1 if is_nullable and node.data else 0)
        elif isinstance(node, (ByteSet, Token)):
            gate(key, [], 1 if is_nullable else 0)
        elif isinstance(node, Seq):
            gate(key, [id(item) for item in node.items], len(node.items))
            stack.extend(node.items)
        elif isinstance(node, Alt):
            gate(key, [id(item) for item in node.items], 1)
            stack.extend(node.items)
        elif isinstance(node, Repeat):
            done = node.min == 0 or (not is_nullable and node.max == 0)
            gate(key, [id(node.item)], 0 if done else 1)
            stack.append(node.item)
        else:  # Ref: fires with its rule
            gate(key, [node.name], 1)
    found: set[str] = set()
    while fired:
        key = fired.pop()
        if isinstance(key, str):
            found.add(key)
        for parent in parents.get(key, ()):
            need[parent] -= 1
            if need[parent] == 0:
                fired.append(parent)
    return found


def _left_refs(node: Node, nullable_names: frozenset[str]) -> list[str]:
    """Rules `node` can enter before consuming anything."""
    if isinstance(node, Ref):
        return [node.name]
    if isinstance(node, Seq):
        out: list[str] = []
        for item in node.items:
            out += _left_refs(item, nullable_names)
            if not nullable(item, nullable_names):
                break
        return out
    if isinstance(node, Alt):
        return [name for item in node.items for name in _left_refs(item, nullable_names)]
    if isinstance(node, Repeat):
        return _left_refs(node.item, nullable_names) if node.max != 0 else []
    return []


def _left_recursive_cycle(grammar: Grammar, nullable_names: frozenset[str]) -> list[str]:
    """A cycle `a -> ... -> a` in the left-corner graph, or [] when there is none."""
    edges = {name: list(dict.fromkeys(_left_refs(node, nullable_names))) for name, node in grammar.rules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in grammar.rules:
        if root in state:
            continue
        path: list[str] = [root]
        todo: list[list[str]] = [list(reversed(edges[root]))]
        state[root] = 1
        while todo:
            if not todo[-1]:
                state[path.pop()] = 2
                todo.pop()
                continue
            nxt = todo[-1].pop()
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(list(reversed(edges[nxt])))
    return []

