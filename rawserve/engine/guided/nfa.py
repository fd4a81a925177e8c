"""Grammar IR -> a byte-level NFA with rule calls (`CompiledGrammar`), and its compact pickled form.

Plain lists of ints, no torch: built once per grammar in the compile worker, sent to the core inside
SamplingParams, and run there by `automaton.Automaton`.
"""
from __future__ import annotations

import gc
import threading
from array import array
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from rawserve.engine.guided.gbnf import nullable
from rawserve.engine.guided.grammar import (Alt, Bytes, ByteSet, Grammar, GrammarError, Node, Ref, Repeat, Seq,
                                            Token, iter_refs)
from rawserve.engine.guided.nfa_rows import ListRows, PackedRows, Virtual

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

    virtual: spans of a long run's middle copies that have no rows of their own (nfa_rows.Virtual): the edge
    lists are then nfa_rows.ListRows, or PackedRows once pickled, which make such a row from the copy it repeats.
    """
    key: str
    eps: list[list[int]]
    byte_edges: list[list[tuple[int, int, int]]]
    token_edges: list[list[tuple[int, int]]]
    call_edges: list[list[tuple[int, int]]]
    is_final: list[bool] | bytes  # bytes once unpickled
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
        if self._packed is not None:  # unpickled here: send on what came in, without walking the edges again
            return self._packed
        state = {"key": self.key, "rule_start": self.rule_start, "rule_final": self.rule_final,
                 "start_rule": self.start_rule, "is_final": bytes(self.is_final), "repeats": self.repeats,
                 "virtual": self.virtual}
        # A virtual span's states have no rows (None), nothing written: their offsets are repeated whole, not
        # walked state by state (11,420 of nested20's 12,772 states, most of its pickling time).
        spans = sorted((first, first + count * stride) for first, stride, count, _, _, _ in self.virtual)
        for name, width in _EDGE_LISTS:
            offsets = array("i", [0])
            flat = array("i")
            rows = getattr(self, name)
            rows = rows.rows if isinstance(rows, ListRows) else rows
            at = 0
            for begin, end in [*spans, (len(rows), len(rows))]:
                for edges in rows[at:begin]:
                    if width == 1:
                        flat.extend(edges)
                    else:
                        for edge in edges:
                            flat.extend(edge)
                    offsets.append(len(flat))
                offsets.extend(array("i", [len(flat)]) * (end - begin))
                at = end
            state[name] = (offsets, flat)
        self._packed = state
        return state

    def __setstate__(self, state: dict) -> None:
        self._packed = state
        self.key, self.rule_start, self.rule_final = state["key"], state["rule_start"], state["rule_final"]
        self.start_rule = state["start_rule"]
        self.repeats = state.get("repeats", [])
        self.virtual = state.get("virtual", [])
        # the bytes as they came (0 or 1 per state): a list of 12k bools is a container the collections of the
        # core's first masks walked item by item
        self.is_final = state["is_final"]
        for name, width in _EDGE_LISTS:
            # the int arrays as they came, not lists: a list of 50k ints is a container every collection walks
            # while it is young and every full one after, for as long as the core keeps the grammar
            offsets, flat = state[name]
            setattr(self, name, PackedRows(offsets, flat, width, self.virtual))


_EDGE_LISTS = (("eps", 1), ("byte_edges", 3), ("token_edges", 2), ("call_edges", 2))


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
    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.eps: list[list[int]] = []
        self.byte_edges: list[list[tuple[int, int, int]]] = []
        self.token_edges: list[list[tuple[int, int]]] = []
        self.call_edges: list[list[tuple[int, int]]] = []
        # each rule's references, read once (a walk of its whole body) for both uses
        refs = {name: list(iter_refs(node)) for name, node in grammar.rules.items()}
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
        if isinstance(node, Bytes):
            n = max(0, len(node.data) - 1)
        elif isinstance(node, (ByteSet, Token)):
            n = 0
        elif isinstance(node, Seq):
            n = len(node.items) - 1 + sum(self._count(item, memo, called, seen) for item in node.items)
        elif isinstance(node, Alt):
            n = sum(self._count(item, memo, called, seen) for item in node.items)
        elif isinstance(node, Repeat):
            inner = self._count(node.item, memo, called, seen)
            n = node.min * (1 + inner)
            if node.max is None:
                n += 2 + inner
            elif node.max > node.min:
                n += (node.max - node.min) * (1 + inner)
        elif isinstance(node, Ref):
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
        if isinstance(node, Bytes):
            data = node.data
            if not data:
                self.eps[start].append(end)
                return
            state = start
            for i, b in enumerate(data):
                target = end if i == len(data) - 1 else self.new()
                self.byte_edges[state].append((b, b, target))
                state = target
        elif isinstance(node, ByteSet):
            for lo, hi in node.ranges:
                self.byte_edges[start].append((lo, hi, end))
        elif isinstance(node, Token):
            self.token_edges[start].append((node.token_id, end))
        elif isinstance(node, Seq):
            state = start
            for i, item in enumerate(node.items):
                target = end if i == len(node.items) - 1 else self.new()
                self.build(item, state, target)
                state = target
        elif isinstance(node, Alt):  # branches share start and end: none adds an edge into one or out of the other
            for item in node.items:
                self.build(item, start, end)
        elif isinstance(node, Repeat):
            self._repeat(node, start, end)
        elif isinstance(node, Ref):
            if node.name not in self.grammar.rules:
                raise GrammarError(f"undefined rule {node.name!r}")
            if self.is_called(node):
                self.call_edges[start].append((self.rule(node.name), end))
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
    grammar.check()
    b = _Builder(grammar)
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
    is_final = [False] * len(b.eps)
    for f in b.rule_final:
        is_final[f] = True
    rows = [b.eps, b.byte_edges, b.token_edges, b.call_edges]
    if b.virtual:
        rows = [ListRows(r, width, b.virtual) for r, (_, width) in zip(rows, _EDGE_LISTS)]
    return CompiledGrammar(key, *rows, is_final, b.rule_start, b.rule_final, start_rule, b.repeats, b.virtual)
