"""Grammar IR -> a byte-level NFA with rule calls, and the lazily determinised automaton over it.

The NFA is plain lists of ints (picklable, no torch), built once per grammar in the front process.
`Automaton` turns it into numbered configurations (sets of NFA threads with their return stacks)
on demand, one byte or special token at a time, so a recursive grammar is a pushdown automaton
whose reachable part is built only as far as outputs go.
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

from rawserve.engine.guided.grammar import (Alt, Bytes, ByteSet, Grammar, GrammarError, Node, Ref, Repeat, Seq,
                                            Token, iter_refs)

MAX_NFA_STATES = 250_000
MAX_STACK_DEPTH = 128  # nested calls of recursive rules (json_object depth, GBNF recursion)
# A rule used in more than one place is copied into each only when it is this small; bigger ones are called
# (one copy, a stack frame at run time). Copying chains of shared rules is how the NFA of a schema with
# optional properties went quadratic: 100 optional properties made 120,854 states.
INLINE_MAX_NODES = 64
DEAD = 0  # configuration id of the empty set: no thread survives


@dataclass(slots=True)
class CompiledGrammar:
    """A grammar's NFA. States are indices; every list below is indexed by state.

    byte_edges[s]: (lo, hi, target) byte ranges; token_edges[s]: (token_id, target);
    call_edges[s]: (rule, return_state); eps[s]: targets. A called rule r runs from rule_start[r] to
    rule_final[r]; the grammar accepts at rule_final[start_rule] with an empty stack.
    """
    key: str
    eps: list[list[int]]
    byte_edges: list[list[tuple[int, int, int]]]
    token_edges: list[list[tuple[int, int]]]
    call_edges: list[list[tuple[int, int]]]
    is_final: list[bool]
    rule_start: list[int]
    rule_final: list[int]
    start_rule: int
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
                 "start_rule": self.start_rule, "is_final": bytes(self.is_final)}
        for name, width in _EDGE_LISTS:
            offsets = array("i", [0])
            flat = array("i")
            for edges in getattr(self, name):
                for edge in edges:
                    if width == 1:
                        flat.append(edge)
                    else:
                        flat.extend(edge)
                offsets.append(len(flat))
            state[name] = (offsets, flat)
        self._packed = state
        return state

    def __setstate__(self, state: dict) -> None:
        self._packed = state
        self.key, self.rule_start, self.rule_final = state["key"], state["rule_start"], state["rule_final"]
        self.start_rule = state["start_rule"]
        self.is_final = list(map(bool, state["is_final"]))
        for name, width in _EDGE_LISTS:
            offsets, flat = state[name]
            setattr(self, name, _Rows(offsets.tolist(), flat.tolist(), width))


_EDGE_LISTS = (("eps", 1), ("byte_edges", 3), ("token_edges", 2), ("call_edges", 2))


def _has_edges(a: list | _Rows, b: list | _Rows) -> list[bool]:
    """Per state: any edge in a or b (from the offsets alone when the lists are flat)."""
    if isinstance(a, _Rows) and isinstance(b, _Rows):
        ao, bo = a.offsets, b.offsets
        return [x != y or u != w for x, y, u, w in zip(ao, ao[1:], bo, bo[1:])]
    return [bool(a[s] or b[s]) for s in range(len(a))]


class _Rows:
    """Per-state edge lists read from flat ints: rows[s] is state s's list (of ints, or of width-tuples)."""

    __slots__ = ("offsets", "flat", "width")

    def __init__(self, offsets: list[int], flat: list[int], width: int) -> None:
        self.offsets, self.flat, self.width = offsets, flat, width

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, s: int) -> list:
        a, b = self.offsets[s], self.offsets[s + 1]
        if self.width == 1:
            return self.flat[a:b]
        return list(zip(*[iter(self.flat[a:b])] * self.width))

    def __iter__(self):
        return (self[s] for s in range(len(self)))


def _cyclic_rules(grammar: Grammar) -> set[str]:
    """Rules that can reach themselves through references (they must be called, never copied)."""
    graph = {name: set(iter_refs(node)) for name, node in grammar.rules.items()}
    cyclic = set()
    for name in graph:
        seen: set[str] = set()
        stack = list(graph[name])
        while stack:
            r = stack.pop()
            if r == name:
                cyclic.add(name)
                break
            if r not in seen:
                seen.add(r)
                stack.extend(graph.get(r, ()))
    return cyclic


class _Builder:
    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.eps: list[list[int]] = []
        self.byte_edges: list[list[tuple[int, int, int]]] = []
        self.token_edges: list[list[tuple[int, int]]] = []
        self.call_edges: list[list[tuple[int, int]]] = []
        self.cyclic = _cyclic_rules(grammar)
        self.num_uses = Counter(r for node in grammar.rules.values() for r in iter_refs(node))
        self.sizes: dict[str, int] = {}
        self.rule_index: dict[str, int] = {}
        self.rule_start: list[int] = []
        self.rule_final: list[int] = []
        self.pending: list[str] = []

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
            name = node.name
            if name in self.cyclic or (self.num_uses[name] > 1 and self.size(node) > INLINE_MAX_NODES):
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
        for _ in range(node.max - node.min):  # optional copies, each may stop early
            self.eps[state].append(end)
            target = self.new()
            self.build(node.item, state, target)
            state = target
        self.eps[state].append(end)


def compile_grammar(grammar: Grammar, key: str) -> CompiledGrammar:
    """Build the NFA; GrammarError if it is malformed or too large. `key` names it in caches."""
    grammar.check()
    b = _Builder(grammar)
    start_rule = b.rule(grammar.start)
    while b.pending:
        name = b.pending.pop()
        index = b.rule_index[name]
        b.build(grammar.rules[name], b.rule_start[index], b.rule_final[index])
    is_final = [False] * len(b.eps)
    for f in b.rule_final:
        is_final[f] = True
    return CompiledGrammar(key, b.eps, b.byte_edges, b.token_edges, b.call_edges, is_final, b.rule_start,
                           b.rule_final, start_rule)


class Automaton:
    """The determinised view of one CompiledGrammar, built lazily and shared by all its requests.

    A thread is (nfa_state, stack_id); stacks are interned as (return_state, parent_id, depth), id 0
    the empty stack. A configuration is the set of threads after epsilon moves, calls and returns,
    keeping only threads that can consume a symbol, plus the accept marker; it is interned as an int.
    Calls in tail position push nothing, so right recursion does not grow the stack.

    `truncate` cuts stacks to their top frames over a MARK frame, whose state takes any byte: walking a
    token from the truncated configuration tells apart tokens decided by the top frames alone (the same
    for every deeper context, so one mask serves them all) from the few that pop below them.
    """

    def __init__(self, g: CompiledGrammar) -> None:
        self.g = g
        n = g.num_states
        self.mark = n  # a state past the NFA's: any byte, forever
        self.consuming = _has_edges(g.byte_edges, g.token_edges) + [True]
        self.accept_state = g.rule_final[g.start_rule]
        self._tail: dict[int, bool] = {}
        self.stacks: list[tuple[int, int, int]] = [(-1, -1, 0)]
        self._stack_ids: dict[tuple[int, int], int] = {}
        self.configs: list[frozenset[tuple[int, int]]] = [frozenset()]
        self._config_ids: dict[frozenset[tuple[int, int]], int] = {frozenset(): DEAD}
        self.next_byte: list[list[int]] = [[DEAD] * 256]  # -1: not computed yet
        self.next_token: list[dict[int, int]] = [{}]  # special token id -> configuration
        self.is_accepting: list[bool] = [False]
        self.is_complete: list[bool] = [False]  # accepting, and nothing more can follow
        # 0: dead; 1: a thread that never popped into a MARK frame is alive; 2: only MARK threads
        self.kind: list[int] = [0]
        self._truncated: dict[int, int] = {}
        self._mark_stack = self._push(self.mark, 0)
        self.start = self._intern(self._closure([(g.rule_start[g.start_rule], 0)]))

    @property
    def num_configs(self) -> int:
        return len(self.configs)

    def is_tail(self, s: int) -> bool:
        """Whether only epsilon moves lead on from s, and they reach a rule's final state: a call returning
        there may as well return straight to its caller's caller. Worked out on first use: only call
        return states are ever asked, and a pass over every state cost the core's step 50 ms on a big NFA."""
        tail = self._tail.get(s)
        if tail is not None:
            return tail
        g = self.g
        seen = {s}
        stack = [s]
        ok, reaches_final = True, False
        while stack:
            t = stack.pop()
            if g.byte_edges[t] or g.token_edges[t] or g.call_edges[t]:
                ok = False
                break
            if g.is_final[t]:
                reaches_final = True
            for u in g.eps[t]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        self._tail[s] = tail = ok and reaches_final
        return tail

    def _push(self, ret: int, parent: int) -> int:
        key = (ret, parent)
        sid = self._stack_ids.get(key)
        if sid is None:
            sid = len(self.stacks)
            self.stacks.append((ret, parent, self.stacks[parent][2] + 1))
            self._stack_ids[key] = sid
        return sid

    def _closure(self, threads: list[tuple[int, int]]) -> frozenset[tuple[int, int]]:
        g = self.g
        eps, calls, is_final, consuming, is_tail = g.eps, g.call_edges, g.is_final, self.consuming, self.is_tail
        mark = self.mark
        out = set()
        seen = set()
        work = list(threads)
        while work:
            thread = work.pop()
            if thread in seen:
                continue
            seen.add(thread)
            s, sid = thread
            if s == mark:
                out.add(thread)
                continue
            if consuming[s]:
                out.add(thread)
            for t in eps[s]:
                work.append((t, sid))
            for rule, ret in calls[s]:
                if is_tail(ret):
                    work.append((g.rule_start[rule], sid))
                elif self.stacks[sid][2] < MAX_STACK_DEPTH:
                    work.append((g.rule_start[rule], self._push(ret, sid)))
            if is_final[s]:
                if sid == 0:  # only tail calls lead here from the start rule: its end is reached
                    out.add((self.accept_state, 0))
                else:
                    ret, parent, _ = self.stacks[sid]
                    work.append((ret, parent))
        return frozenset(out)

    def _intern(self, threads: frozenset[tuple[int, int]]) -> int:
        cid = self._config_ids.get(threads)
        if cid is not None:
            return cid
        cid = len(self.configs)
        self._config_ids[threads] = cid
        self.configs.append(threads)
        self.next_byte.append([-1] * 256)
        self.next_token.append({})
        accepting = (self.accept_state, 0) in threads
        self.is_accepting.append(accepting)
        self.is_complete.append(accepting and len(threads) == 1)
        mark = self.mark
        self.kind.append(0 if not threads else 1 if any(s != mark for s, _ in threads) else 2)
        return cid

    def truncate(self, cid: int, depth: int) -> int:
        """The configuration with every stack cut to its top `depth` frames over a MARK frame (cid
        itself when no stack is deeper). Near the depth cap nothing is cut: there a push the cut
        configuration allows may be one the real one refuses."""
        cut = self._truncated.get(cid)
        if cut is not None:
            return cut
        threads = self.configs[cid]
        stacks = self.stacks
        if all(stacks[sid][2] <= depth for _, sid in threads) or any(
                stacks[sid][2] > MAX_STACK_DEPTH - 64 for _, sid in threads):
            cut = cid
        else:
            new = set()
            for s, sid in threads:
                frames = []
                while sid and len(frames) < depth:
                    ret, sid, _ = stacks[sid]
                    frames.append(ret)
                base = self._mark_stack if sid else 0
                for ret in reversed(frames):
                    base = self._push(ret, base)
                new.add((s, base))
            cut = self._intern(frozenset(new))
        self._truncated[cid] = cut
        return cut

    def step_byte(self, cid: int, byte: int) -> int:
        nxt = self.next_byte[cid][byte]
        return nxt if nxt >= 0 else self.expand(cid)[byte]

    def expand(self, cid: int) -> list[int]:
        """Build all 256 byte transitions of a configuration at once: bytes that no edge boundary
        separates behave alike, so each run of them costs one closure."""
        row = self.next_byte[cid]
        if cid == DEAD or row[0] >= 0:
            return row
        byte_edges, mark, any_byte = self.g.byte_edges, self.mark, ((0, 255, self.mark),)
        edges = [(lo, hi, t, sid) for s, sid in self.configs[cid]
                 for lo, hi, t in (byte_edges[s] if s != mark else any_byte)]
        cuts = sorted({0, 256, *(lo for lo, _, _, _ in edges), *(hi + 1 for _, hi, _, _ in edges)})
        row = [DEAD] * 256
        for begin, end in zip(cuts, cuts[1:]):
            moved = [(t, sid) for lo, hi, t, sid in edges if lo <= begin <= hi]
            if moved:
                nxt = self._intern(self._closure(moved))
                row[begin:end] = [nxt] * (end - begin)
        self.next_byte[cid] = row
        return row

    def step_bytes(self, cid: int, data: bytes) -> int:
        next_byte = self.next_byte
        for byte in data:
            nxt = next_byte[cid][byte]
            cid = nxt if nxt >= 0 else self.step_byte(cid, byte)
            if cid == DEAD:
                return DEAD
        return cid

    def allowed_tokens(self, cid: int) -> dict[int, int]:
        """Special tokens this configuration can take now -> the configuration after each."""
        cache = self.next_token[cid]
        if cache or cid == DEAD:
            return cache
        moves: dict[int, list[tuple[int, int]]] = {}
        token_edges = self.g.token_edges
        for s, sid in self.configs[cid]:
            if s == self.mark:
                continue
            for token_id, t in token_edges[s]:
                moves.setdefault(token_id, []).append((t, sid))
        for token_id, threads in moves.items():
            cache[token_id] = self._intern(self._closure(threads))
        return cache

    def step_token(self, cid: int, token_id: int) -> int:
        return self.allowed_tokens(cid).get(token_id, DEAD)

    def matches(self, symbols: bytes | tuple[int, ...], token_base: int = 256) -> bool:
        """Whether the whole input is accepted (tests; symbols >= token_base are special tokens)."""
        cid = self.start
        for sym in symbols:
            cid = self.step_byte(cid, sym) if sym < token_base else self.step_token(cid, sym - token_base)
            if cid == DEAD:
                return False
        return self.is_accepting[cid]
