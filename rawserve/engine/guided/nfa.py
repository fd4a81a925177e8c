"""Grammar IR -> a byte-level NFA with rule calls (`CompiledGrammar`), and its compact pickled form.

Plain lists of ints, no torch: built once per grammar in the compile worker, sent to the core inside
SamplingParams, and run there by `automaton.Automaton`.
"""
from __future__ import annotations

import gc
import struct
import threading
from array import array
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Iterator

from rawserve.engine.guided.gbnf import nullable
from rawserve.engine.guided.grammar import (Alt, Bytes, ByteSet, Grammar, GrammarError, Node, Ref, Repeat, Seq,
                                            Token, iter_refs)
from rawserve.engine.guided.nfa_rows import PackedRows, Virtual

MAX_NFA_STATES = 250_000
# A rule used in more than one place is copied into each only when it is this small; bigger ones are called
# (one copy, a stack frame at run time). Copying chains of shared rules is how the NFA of a schema with
# optional properties went quadratic: 100 optional properties made 120,854 states.
INLINE_MAX_NODES = 64
# A repeat run of at least this many optional copies has its middle ones left virtual (nfa_rows): built, a
# maxLength 200 string was 8,200 NFA states, most of nested20's compile, pickle and first collection after.
VIRTUAL_MIN_COPIES = 8


class _EveryRule:
    """Every rule name, for gbnf.nullable: a rule reference counts as possibly empty (no walk into rules)."""

    def __contains__(self, name: object) -> bool:
        return True


_EVERY_RULE = _EveryRule()
_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while an NFA is built (nests, from any thread).

    A build allocates tens of thousands of small lists, and the allocation thresholds it crossed ran full
    collections over every object of the process: nested20's compile took 140 ms of CPU with them and 18 ms
    without (bench.guided's process). Nothing it makes holds a cycle, so reference counting frees what it
    drops; the collector runs again from the next threshold after, by when a compile worker has sent the
    NFA and dropped it."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


@dataclass(slots=True)
class CompiledGrammar:
    """A grammar's NFA. States are indices; every list below is indexed by state.

    byte_edges[s]: (lo, hi, target) byte ranges; token_edges[s]: (token_id, target);
    call_edges[s]: (rule, return_state); eps[s]: targets. A called rule r runs from rule_start[r] to
    rule_final[r]; the grammar accepts at rule_final[start_rule] with an empty stack.

    repeats: (first, stride, count) per run of `count` optional copies of one repeated item (a maxLength
    string's characters), made alike: copy i's states are copy 0's plus i * stride, from `first` on, and the
    state at first + i * stride is where copy i ends. A thread there behaves as the one a copy later does
    until it nears the run's end, which is what lets the core share a mask's walks along the run.

    virtual: spans of a long run's middle copies that have no rows of their own (nfa_rows.Virtual): PackedRows
    makes such a row from the copy it repeats.

    compile_grammar's edge lists are nfa_rows.PackedRows (a row is a tuple) and is_final is bytes, as a pickle
    loads them in the core; one made by hand (tests) may hold plain lists, without virtual spans.
    """
    key: str
    eps: list[list[int]] | PackedRows
    byte_edges: list[list[tuple[int, int, int]]] | PackedRows
    token_edges: list[list[tuple[int, int]]] | PackedRows
    call_edges: list[list[tuple[int, int]]] | PackedRows
    is_final: list[bool] | bytes
    rule_start: list[int]
    rule_final: list[int]
    start_rule: int
    repeats: list[tuple[int, int, int]] = field(default_factory=list)
    virtual: list[Virtual] = field(default_factory=list)
    _packed: dict | None = field(default=None, repr=False, compare=False)

    @property
    def num_states(self) -> int:
        return len(self.eps)

    # Pickled flat: lists of small lists of tuples took 4 s to unpickle for a 120k-state NFA (in the core, in
    # its step). As int arrays they cross the pipe as bytes, and rows are sliced out only when read.
    def __getstate__(self) -> dict:
        if self._packed is None:  # made from lists (tests do): packed as compile_grammar packs its build
            rows = [[list(row) if width == 1 else list(chain.from_iterable(row)) for row in getattr(self, name)]
                    for name, width in _EDGE_LISTS]
            finals = [s for s, final in enumerate(self.is_final) if final]
            self._packed = _packed_state(self.key, rows, finals, self.rule_start, self.rule_final, self.start_rule,
                                         self.repeats, self.virtual)
        return self._packed

    def __setstate__(self, state: dict) -> None:
        self._packed = state
        self.key, self.rule_start, self.rule_final = state["key"], state["rule_start"], state["rule_final"]
        self.start_rule, self.repeats, self.virtual = state["start_rule"], state["repeats"], state["virtual"]
        n = state["num_states"]
        # bytes (0 or 1 per state): a list of 12k bools is a container the collections of the core's first masks
        # walked item by item
        is_final = bytearray(n)
        for s in state["finals"]:
            is_final[s] = 1
        self.is_final = bytes(is_final)
        spans = _spans(self.virtual)
        for name, width in _EDGE_LISTS:
            # the int arrays, not lists: a list of 50k ints is a container every collection walks while it is
            # young and every full one after, for as long as the core keeps the grammar
            packed = state[name]
            if packed is None:
                offsets, flat = array("H", bytes(2 * (n + 1))), array("H")
            else:
                offsets, flat = _spread(packed[0], spans, n), packed[1]
            setattr(self, name, PackedRows(offsets, flat, width, self.virtual))

    @classmethod
    def from_state(cls, state: dict) -> CompiledGrammar:
        """The grammar a pickle of `state` loads as (what compile_grammar returns: the core reads the same)."""
        compiled = cls.__new__(cls)
        compiled.__setstate__(state)
        return compiled


_EDGE_LISTS = (("eps", 1), ("byte_edges", 3), ("token_edges", 2), ("call_edges", 2))


def _spans(virtual: list[Virtual]) -> list[tuple[int, int]]:
    """The virtual spans' states as sorted [begin, end) ranges."""
    return sorted((first, first + count * stride) for first, stride, count, _, _, _ in virtual)


def _packed_state(key: str, rows: list[list], finals: list[int], rule_start: list[int], rule_final: list[int],
                  start_rule: int, repeats: list[tuple[int, int, int]], virtual: list[Virtual]) -> dict:
    """What a CompiledGrammar pickles as, from its edge lists with each state's edges as ints in a row (None in the
    virtual spans). Per edge list: the offsets of the states outside the virtual spans (11,420 of nested20's 12,772
    states are in them) and those rows' ints, 16-bit ones when the states are under 65,536, or None when the list
    has no edge at all (most grammars' token and call edges). Nor is is_final sent, only the states it marks. The
    offsets of every state, four lists of them, were most of nested20's 243 KB before, and a walk of its rows in
    Python most of the time it took to pickle: this one iterates in C and packs with struct, where array() parses
    each int it is given."""
    spans = _spans(virtual)
    n = len(rows[0])
    outside = [(0, n)] if not spans else [
        (begin, end) for begin, end in zip([0] + [end for _, end in spans], [begin for begin, _ in spans] + [n])]
    state = {"key": key, "num_states": n, "finals": finals, "rule_start": rule_start, "rule_final": rule_final,
             "start_rule": start_rule, "repeats": repeats, "virtual": virtual}
    small = n < 1 << 16  # states, bytes and rule indices fit 16 bits; a token id may not
    for (name, _), lists in zip(_EDGE_LISTS, rows):
        built = list(chain.from_iterable(lists[begin:end] for begin, end in outside))
        ints = tuple(chain.from_iterable(built))
        if not ints:
            state[name] = None
            continue
        offsets = tuple(accumulate(map(len, built), initial=0))
        state[name] = (_ints("H" if len(ints) < 1 << 16 else "i", offsets),
                       _ints("H" if small and name != "token_edges" else "i", ints))
    return state


def _ints(typecode: str, ints: tuple[int, ...]) -> array:
    return array(typecode, struct.pack(f"{len(ints)}{typecode}", *ints))


def _spread(offsets: array, spans: list[tuple[int, int]], n: int) -> array:
    """Packed offsets (the states outside the spans) -> one per state: a span's states repeat the offset of the
    state after it, as if their rows were empty (they are never read: PackedRows makes them from their
    templates)."""
    out = array(offsets.typecode)
    at = skipped = 0
    for begin, end in spans:
        k = begin - skipped
        out += offsets[at:k]
        out += array(offsets.typecode, offsets[k:k + 1]) * (end - begin)
        at, skipped = k, skipped + end - begin
    out += offsets[at:]
    assert len(out) == n + 1, "the packed offsets do not cover the grammar's states"
    return out


def _cyclic_rules(refs: dict[str, list[str]]) -> set[str]:
    """Rules that can reach themselves through references (`refs`: each rule's), so they must be called, never
    copied: the members of a strongly connected component with a cycle (Tarjan's, without recursion). A search from
    every rule took seconds for 20,000 chained rules."""
    graph = {name: list(dict.fromkeys(names)) for name, names in refs.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cyclic: set[str] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]  # (rule, next edge to look at)
        while work:
            name, i = work.pop()
            if i == 0:
                index[name] = low[name] = len(index)
                stack.append(name)
                on_stack.add(name)
            edges = graph.get(name, [])
            while i < len(edges):
                nxt = edges[i]
                i += 1
                if nxt not in graph:
                    continue
                if nxt not in index:
                    work.append((name, i))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[name] = min(low[name], index[nxt])
            else:
                if low[name] == index[name]:  # the root of a component: pop it
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == name:
                            break
                    if len(component) > 1 or name in graph[name]:
                        cyclic.update(component)
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[name])
    return cyclic


class _Builder:
    def __init__(self, grammar: Grammar, refs: dict[str, list[str]]) -> None:
        self.grammar = grammar
        # per state its edges' ints in a row (lo, hi, target, lo, ...), as they are packed: a list of tuples took a
        # second level of iteration to flatten
        self.eps: list[list[int]] = []
        self.byte_edges: list[list[int]] = []
        self.token_edges: list[list[int]] = []
        self.call_edges: list[list[int]] = []
        self.cyclic = _cyclic_rules(refs)
        self.num_uses = Counter(r for names in refs.values() for r in names)
        self.sizes: dict[str, int] = {}
        self.rule_index: dict[str, int] = {}
        self.rule_start: list[int] = []
        self.rule_final: list[int] = []
        self.pending: list[str] = []
        self.repeats: list[tuple[int, int, int]] = []
        self.virtual: list[Virtual] = []

    def new(self) -> int:
        if len(self.eps) >= MAX_NFA_STATES:
            raise GrammarError(f"the grammar is too large (over {MAX_NFA_STATES} automaton states); "
                               "lower repeat counts or lengths")
        self.eps.append([])
        self.byte_edges.append([])
        self.token_edges.append([])
        self.call_edges.append([])
        return len(self.eps) - 1

    def size(self, node: Node, depth: int = 0) -> int:
        """Node count with non-recursive references expanded (capped: only compared with a limit)."""
        if isinstance(node, Ref):
            if node.name in self.cyclic or depth > 64:
                return 1
            if node.name not in self.sizes:
                self.sizes[node.name] = self.size(self.grammar.rules[node.name], depth + 1)
            return self.sizes[node.name]
        if isinstance(node, (Seq, Alt)):
            return 1 + sum(self.size(n, depth) for n in node.items)
        if isinstance(node, Repeat):
            copies = max(node.min, 1) + (0 if node.max is None else max(0, node.max - node.min))
            return 1 + min(copies, 1 << 20) * self.size(node.item, depth)
        if isinstance(node, Bytes):
            return max(1, len(node.data))
        return 1

    def is_called(self, node: Ref) -> bool:
        """Whether a reference becomes a call edge (one shared copy of the rule) rather than an inlined copy."""
        name = node.name
        return name in self.cyclic or (self.num_uses[name] > 1 and self.size(node) > INLINE_MAX_NODES)

    def count_states(self) -> int:
        """The states build() will make, exactly, without making them: a grammar over the limit is refused in
        the time it takes to walk its IR, not after building a quarter of a million states (a second or
        more for `(a{1000}){1000}` or a 10^9 maxLength)."""
        memo: dict[int, int] = {}
        called: list[str] = [self.grammar.start]
        seen = {self.grammar.start}
        total = i = 0
        while i < len(called):  # each called rule: its start and final states, and its body once
            total += 2 + self._count(self.grammar.rules[called[i]], memo, called, seen)
            i += 1
        return total

    def _count(self, node: Node, memo: dict[int, int], called: list[str], seen: set[str]) -> int:
        """count_states' states of one node (called rules queued on `called`, counted once there). A method, not
        a recursive closure: a closure that calls itself is a cycle through its cell, and this one held the
        builder, so the whole unpacked NFA (12k states' lists for nested20) outlived the compile until a
        collection found it, walked meanwhile by every young and middle collection of that process (a compile
        worker; bench.guided's, where they were its first masks')."""
        key = id(node)
        hit = memo.get(key)
        if hit is not None:
            return hit
        kind = type(node)  # not isinstance: a build dispatches per node, and the calls added up
        if kind is Bytes:
            n = max(0, len(node.data) - 1)
        elif kind is ByteSet or kind is Token:
            n = 0
        elif kind is Seq:
            n = len(node.items) - 1 + sum(self._count(item, memo, called, seen) for item in node.items)
        elif kind is Alt:
            n = sum(self._count(item, memo, called, seen) for item in node.items)
        elif kind is Repeat:
            inner = self._count(node.item, memo, called, seen)
            n = node.min * (1 + inner)
            if node.max is None:
                n += 2 + inner
            elif node.max > node.min:
                n += (node.max - node.min) * (1 + inner)
        elif kind is Ref:
            if node.name not in self.grammar.rules:
                raise GrammarError(f"undefined rule {node.name!r}")
            if self.is_called(node):
                if node.name not in seen:
                    seen.add(node.name)
                    called.append(node.name)
                n = 0
            else:
                n = self._count(self.grammar.rules[node.name], memo, called, seen)
        else:
            raise TypeError(f"not a grammar node: {node!r}")
        memo[key] = n
        return n

    def rule(self, name: str) -> int:
        """The index of a called rule, compiled once (its body is built after the caller's)."""
        index = self.rule_index.get(name)
        if index is None:
            index = len(self.rule_start)
            self.rule_index[name] = index
            self.rule_start.append(self.new())
            self.rule_final.append(self.new())
            self.pending.append(name)
        return index

    def build(self, node: Node, start: int, end: int) -> None:
        """Connect start to end through `node`. Adds no edge into `start` nor out of `end`, so
        alternatives may share both; loops go through fresh states."""
        kind = type(node)  # as _count
        if kind is Bytes:
            data = node.data
            if not data:
                self.eps[start].append(end)
                return
            state = start
            for b in data[:-1]:
                target = self.new()
                self.byte_edges[state] += (b, b, target)
                state = target
            self.byte_edges[state] += (data[-1], data[-1], end)
        elif kind is ByteSet:
            row = self.byte_edges[start]
            for lo, hi in node.ranges:
                row += (lo, hi, end)
        elif kind is Seq:
            state = start
            items = node.items
            for item in items[:-1]:
                target = self.new()
                self.build(item, state, target)
                state = target
            self.build(items[-1], state, end)
        elif kind is Alt:  # branches share start and end: none adds an edge into one or out of the other
            for item in node.items:
                self.build(item, start, end)
        elif kind is Repeat:
            self._repeat(node, start, end)
        elif kind is Token:
            self.token_edges[start] += (node.token_id, end)
        elif kind is Ref:
            if node.name not in self.grammar.rules:
                raise GrammarError(f"undefined rule {node.name!r}")
            if self.is_called(node):
                self.call_edges[start] += (self.rule(node.name), end)
            else:
                self.build(self.grammar.rules[node.name], start, end)
        else:
            raise TypeError(f"not a grammar node: {node!r}")

    def _repeat(self, node: Repeat, start: int, end: int) -> None:
        if node.max is not None and node.max < node.min:
            raise GrammarError(f"a repeat's maximum ({node.max}) is below its minimum ({node.min})")
        state = start
        for _ in range(node.min):  # required copies
            target = self.new()
            self.build(node.item, state, target)
            state = target
        if node.max is None:  # then a loop
            loop_in, loop_out = self.new(), self.new()
            self.eps[state].append(loop_in)
            self.build(node.item, loop_in, loop_out)
            self.eps[loop_out].append(loop_in)
            self.eps[state].append(end)
            self.eps[loop_out].append(end)
            return
        first = len(self.eps)
        strides = set()
        count = node.max - node.min
        num_regions = len(self.repeats)
        copy = 0
        scratch = -1  # a virtual state given rows for the build of the last copy from it
        while copy < count:  # optional copies, each may stop early
            if (copy == 3 and count >= VIRTUAL_MIN_COPIES and len(strides) == 1 and len(self.repeats) == num_regions
                    and not nullable(node.item, _EVERY_RULE)):
                scratch = state = self._virtual_copies(first, strides.copy().pop(), count)
                copy = count - 1
            self.eps[state].append(end)
            target = self.new()
            self.build(node.item, state, target)
            strides.add(len(self.eps) - target)
            state = target
            copy += 1
        if scratch >= 0:  # its rows are its template's moved on, the same edges the build just gave it
            for rows in (self.eps, self.byte_edges, self.token_edges, self.call_edges):
                rows[scratch] = None
        self.eps[state].append(end)
        if count >= 3 and len(strides) == 1 and not nullable(node.item, _EVERY_RULE):
            self._add_region(first, strides.pop(), count)

    def _virtual_copies(self, first: int, stride: int, count: int) -> int:
        """Copies 2 .. count - 2 of a repeat run whose copies 0-2 are built (copy 2 only so that copy 1's end
        has its edges on): left virtual, as copy 1 moved on (nfa_rows.Virtual). -> the end of copy count - 2,
        given empty rows, from which the caller builds the last copy (whose end takes no byte)."""
        if first + count * stride > MAX_NFA_STATES:
            raise GrammarError(f"the grammar is too large (over {MAX_NFA_STATES} automaton states); "
                               "lower repeat counts or lengths")
        begin = first + 2 * stride
        num = (count - 3) * stride
        for rows in (self.eps, self.byte_edges, self.token_edges, self.call_edges):
            del rows[begin:]
            rows.extend([None] * num)
        self.virtual.append((begin, stride, count - 3, first + stride, first, first + count * stride))
        scratch = first + (count - 2) * stride
        for rows in (self.eps, self.byte_edges, self.token_edges, self.call_edges):
            rows[scratch] = []
        return scratch

    def _add_region(self, first: int, stride: int, count: int) -> None:
        """Record a run of optional copies made alike (see CompiledGrammar.repeats), of an item that is never
        empty (so a byte takes a thread at most one copy on). One inside another's range is kept and the outer
        one dropped: the inner ones (a maxLength string in an array's item) are the long runs, and a state
        belongs to one run at most."""
        last = first + stride * count
        if not any(f < last and f + st * n > first for f, st, n in self.repeats):
            self.repeats.append((first, stride, count))


def compile_grammar(grammar: Grammar, key: str) -> CompiledGrammar:
    """Build the NFA; GrammarError if it is malformed or too large. `key` names it in caches."""
    with gc_paused():
        return _compile(grammar, key)


def _compile(grammar: Grammar, key: str) -> CompiledGrammar:
    # each rule's references, read once (a walk of its whole body) for the check and the builder's two uses
    refs = {name: iter_refs(node) for name, node in grammar.rules.items()}
    grammar.check(refs)
    b = _Builder(grammar, refs)
    num_states = b.count_states()
    if num_states > MAX_NFA_STATES:
        raise GrammarError(f"the grammar is too large ({num_states:,} automaton states; the limit is "
                           f"{MAX_NFA_STATES:,}); lower repeat counts or lengths")
    start_rule = b.rule(grammar.start)
    while b.pending:
        name = b.pending.pop()
        index = b.rule_index[name]
        b.build(grammar.rules[name], b.rule_start[index], b.rule_final[index])
    assert len(b.eps) == num_states, "count_states() and build() disagree"
    # packed here, while the collector is paused: the builder's lists die with it, where kept they were ~6,000
    # young containers for the first collection after the pause to walk (nested20: ~1 ms), and the next ones
    state = _packed_state(key, [b.eps, b.byte_edges, b.token_edges, b.call_edges], b.rule_final, b.rule_start,
                          b.rule_final, start_rule, b.repeats, b.virtual)
    return CompiledGrammar.from_state(state)
