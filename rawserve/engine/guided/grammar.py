"""The grammar IR every front end (regex, JSON Schema, GBNF, tool calls) compiles to, and its byte rules.

A grammar is a set of named rules over bytes and special-token ids. Pure Python: no torch, no
tokenizer, so the API layer can build and check grammars in the front process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TOKEN_BASE = 256  # in a symbol sequence, a special token id t is the symbol TOKEN_BASE + t
MAX_UNICODE = 0x10FFFF


class GrammarError(ValueError):
    """A grammar, regex or schema that cannot be compiled; the message says what and where. `param` names
    the request field at fault when it is narrower than the one the grammar came from (a tool's parameters)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # it crosses from the compile worker with its param
        return (GrammarError, (str(self), self.param))


@dataclass(frozen=True, slots=True)
class Bytes:
    """A literal byte string (empty: matches nothing, i.e. epsilon)."""
    data: bytes


@dataclass(frozen=True, slots=True)
class ByteSet:
    """One byte from inclusive ranges, sorted and disjoint; never empty."""
    ranges: tuple[tuple[int, int], ...]


class _CachedHash:
    """A composite node hashes its children once: alt() dedupes branches by hash, and grammars are built bottom
    up, so without the cache every level of nesting hashed the whole tree below it again (quadratic)."""

    __slots__ = ()

    def __hash__(self) -> int:
        cached = self._hash
        if cached is None:
            cached = hash((type(self).__name__, *(getattr(self, f) for f in self.__match_args__)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __reduce__(self):  # pickled without the cache: a string's hash differs from process to process
        return (type(self), tuple(getattr(self, f) for f in self.__match_args__))


@dataclass(frozen=True, slots=True)
class Seq(_CachedHash):
    items: tuple[Node, ...]
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    __hash__ = _CachedHash.__hash__  # dataclass(frozen=True) would otherwise put its own, uncached one here


@dataclass(frozen=True, slots=True)
class Alt(_CachedHash):
    items: tuple[Node, ...]
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    __hash__ = _CachedHash.__hash__


@dataclass(frozen=True, slots=True)
class Repeat(_CachedHash):
    item: Node
    min: int = 0
    max: int | None = None  # None: unbounded
    _hash: int | None = field(default=None, init=False, repr=False, compare=False)

    __hash__ = _CachedHash.__hash__


@dataclass(frozen=True, slots=True)
class Ref:
    """The rule `name` of the enclosing Grammar (recursion allowed, left recursion refused)."""
    name: str


@dataclass(frozen=True, slots=True)
class Token:
    """One special or added token, matched by id: such tokens have no bytes a grammar could spell."""
    token_id: int


Node = Bytes | ByteSet | Seq | Alt | Repeat | Ref | Token

EMPTY = Bytes(b"")


@dataclass(slots=True)
class Grammar:
    rules: dict[str, Node]
    start: str = "root"
    # Bytes allowed between structural tokens are the front end's business; this records what it chose.
    notes: dict[str, str] = field(default_factory=dict)

    def check(self, refs: dict[str, list[str]] | None = None) -> None:
        """Raise GrammarError for an undefined rule or a missing start rule. `refs`: each rule's iter_refs, when the
        caller has them (the NFA builder reads them too)."""
        if self.start not in self.rules:
            raise GrammarError(f"the grammar has no start rule {self.start!r}")
        for name, node in self.rules.items():
            for ref in iter_refs(node) if refs is None else refs[name]:
                if ref not in self.rules:
                    raise GrammarError(f"rule {name!r} refers to undefined rule {ref!r}")


def iter_nodes(node: Node):
    """Every node under `node` (itself included); rule references are not followed."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, (Seq, Alt)):
            stack.extend(n.items)
        elif isinstance(n, Repeat):
            stack.append(n.item)


def iter_refs(node: Node) -> list[str]:
    """The rule names a node refers to, in iter_nodes' order (its walk inlined: through the generator it was most of
    the NFA build's checks, for a grammar's every node)."""
    names = []
    stack = [node]
    while stack:
        n = stack.pop()
        kind = type(n)
        if kind is Seq or kind is Alt:
            stack.extend(n.items)
        elif kind is Repeat:
            stack.append(n.item)
        elif kind is Ref:
            names.append(n.name)
    return names


def iter_tokens(node: Node):
    """The special-token ids a node names."""
    return (n.token_id for n in iter_nodes(node) if isinstance(n, Token))


# ----- constructors that simplify as they build


def seq(*items: Node) -> Node:
    """The items in a row, flattened, literals next to each other joined. Every Seq is made here, so its items are
    flat already: none is a Seq or an empty literal, and no two literals are adjacent. An item that is a Seq can
    only join a neighbour by a literal at either end, and its middle is copied whole: copying it item by item was
    the top of a schema's IR profile, its objects nested in members nested in objects."""
    flat: list[Node] = []
    run: list[Bytes] = []  # adjacent literals, joined once: merging them pairwise was quadratic in a long literal
    for item in items:
        kind = type(item)
        if kind is Bytes:
            if item.data:
                run.append(item)
            continue
        parts = item.items if kind is Seq else (item,)
        if type(parts[0]) is Bytes:  # then parts[1] is not a literal
            run.append(parts[0])
            parts = parts[1:]
        if run:
            flat.append(run[0] if len(run) == 1 else Bytes(b"".join(b.data for b in run)))
            run = []
        if type(parts[-1]) is Bytes:
            flat.extend(parts[:-1])
            run.append(parts[-1])
        else:
            flat.extend(parts)
    if run:
        flat.append(run[0] if len(run) == 1 else Bytes(b"".join(b.data for b in run)))
    if not flat:
        return EMPTY
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items: Node) -> Node:
    """Branches flattened and deduplicated, first occurrence first. By hash: the pairwise scan this replaced
    took 48 s for a 20,000-branch pattern."""
    flat: dict[Node, None] = {}
    for item in items:
        for part in (item.items if isinstance(item, Alt) else (item,)):
            flat[part] = None
    if not flat:
        raise GrammarError("an alternation needs at least one branch")
    return next(iter(flat)) if len(flat) == 1 else Alt(tuple(flat))


def lit(text: str | bytes) -> Bytes:
    return Bytes(text.encode("utf-8") if isinstance(text, str) else text)


def byte_set(ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> ByteSet:
    """Normalise (sort, merge) byte ranges; GrammarError when empty."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if not 0 <= lo <= hi <= 255:
            raise GrammarError(f"byte range {lo}-{hi} is outside 0-255")
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if not merged:
        raise GrammarError("an empty character class matches nothing")
    return ByteSet(tuple((lo, hi) for lo, hi in merged))


def optional(node: Node) -> Node:
    return Repeat(node, 0, 1)


# ----- Unicode code point ranges as UTF-8 byte sequences

_UTF8_LIMITS = ((0, 0x7F, 1), (0x80, 0x7FF, 2), (0x800, 0xFFFF, 3), (0x10000, MAX_UNICODE, 4))


def _encode(cp: int, length: int) -> list[int]:
    if length == 1:
        return [cp]
    out = []
    for _ in range(length - 1):
        out.append(0x80 | (cp & 0x3F))
        cp >>= 6
    lead = {2: 0xC0, 3: 0xE0, 4: 0xF0}[length]
    out.append(lead | cp)
    return out[::-1]


def _split_same_length(lo: int, hi: int, length: int) -> list[list[tuple[int, int]]]:
    """Code points lo..hi that all encode in `length` bytes -> byte-range sequences (as RE2/Rust do)."""
    if length == 1:
        return [[(lo, hi)]]
    for i in range(1, length):
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                return (_split_same_length(lo, (lo | mask), length)
                        + _split_same_length((lo | mask) + 1, hi, length))
            if (hi & mask) != mask:
                return (_split_same_length(lo, (hi & ~mask) - 1, length)
                        + _split_same_length(hi & ~mask, hi, length))
    a, b = _encode(lo, length), _encode(hi, length)
    return [[(x, y) for x, y in zip(a, b)]]


def codepoint_ranges(ranges: list[tuple[int, int]]) -> Node:
    """Any one character whose code point is in the given inclusive ranges, as UTF-8 bytes.

    Surrogates (U+D800-U+DFFF) are never valid UTF-8 and are left out.
    """
    pieces: list[Node] = []
    cleaned: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if lo > hi:
            continue
        if lo <= 0xDFFF and hi >= 0xD800:  # cut the surrogate hole out
            if lo < 0xD800:
                cleaned.append((lo, 0xD7FF))
            if hi > 0xDFFF:
                cleaned.append((0xE000, hi))
        else:
            cleaned.append((lo, hi))
    for lo, hi in cleaned:
        for first, last, length in _UTF8_LIMITS:
            a, b = max(lo, first), min(hi, last)
            if a > b:
                continue
            for ranges_seq in _split_same_length(a, b, length):
                pieces.append(seq(*[byte_set([r]) for r in ranges_seq]))
    if not pieces:
        raise GrammarError("an empty character class matches nothing")
    # One-byte pieces merge into one ByteSet, so ASCII classes stay a single node.
    singles = [p for p in pieces if isinstance(p, ByteSet)]
    rest = [p for p in pieces if not isinstance(p, ByteSet)]
    if len(singles) > 1:
        singles = [byte_set([r for p in singles for r in p.ranges])]
    return alt(*singles, *rest)


def complement_codepoints(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The code points 0..U+10FFFF not in `ranges` (surrogates are dropped later, by codepoint_ranges)."""
    out = []
    nxt = 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt <= MAX_UNICODE:
        out.append((nxt, MAX_UNICODE))
    return out


ANY_CHAR = codepoint_ranges([(0, MAX_UNICODE)])


# ----- a slow reference matcher, for tests and for checking a front end without the automaton


def symbols(text: str | bytes) -> tuple[int, ...]:
    return tuple(text.encode("utf-8") if isinstance(text, str) else text)


def accepts(grammar: Grammar, data: str | bytes | tuple[int, ...]) -> bool:
    """Whether the whole input matches the start rule. Input: text, bytes, or symbols where
    TOKEN_BASE + id stands for a special token. Exponential-free but slow: tests only."""
    syms = data if isinstance(data, tuple) else symbols(data)
    memo: dict[tuple[int, int], frozenset[int]] = {}
    active: set[tuple[str, int]] = set()
    rule_memo: dict[tuple[str, int], frozenset[int]] = {}

    def ends(node: Node, i: int) -> frozenset[int]:
        key = (id(node), i)
        hit = memo.get(key)
        if hit is not None:
            return hit
        result: frozenset[int]
        if isinstance(node, Bytes):
            n = len(node.data)
            result = frozenset((i + n,)) if syms[i:i + n] == tuple(node.data) else frozenset()
        elif isinstance(node, ByteSet):
            ok = i < len(syms) and syms[i] < 256 and any(lo <= syms[i] <= hi for lo, hi in node.ranges)
            result = frozenset((i + 1,)) if ok else frozenset()
        elif isinstance(node, Token):
            ok = i < len(syms) and syms[i] == TOKEN_BASE + node.token_id
            result = frozenset((i + 1,)) if ok else frozenset()
        elif isinstance(node, Seq):
            positions = frozenset((i,))
            for item in node.items:
                positions = frozenset(e for p in positions for e in ends(item, p))
                if not positions:
                    break
            result = positions
        elif isinstance(node, Alt):
            result = frozenset(e for item in node.items for e in ends(item, i))
        elif isinstance(node, Repeat):
            found: set[int] = set()
            frontier = {i}
            seen_at_min: set[int] = set()
            count = 0
            while frontier and (node.max is None or count <= node.max):
                if count >= node.min:
                    new = frontier - seen_at_min
                    if not new and node.max is None:
                        break
                    found |= frontier
                    seen_at_min |= frontier
                    frontier = new
                if node.max is not None and count == node.max:
                    break
                frontier = {e for p in frontier for e in ends(node.item, p)}
                count += 1
            result = frozenset(found)
        elif isinstance(node, Ref):
            rkey = (node.name, i)
            if rkey in rule_memo:
                return rule_memo[rkey]
            if rkey in active:  # left recursion: no new match along this path
                return frozenset()
            active.add(rkey)
            result = ends(grammar.rules[node.name], i)
            active.discard(rkey)
            rule_memo[rkey] = result
            return result
        else:
            raise TypeError(f"not a grammar node: {node!r}")
        memo[key] = result
        return result

    grammar.check()
    return len(syms) in ends(Ref(grammar.start), 0)
