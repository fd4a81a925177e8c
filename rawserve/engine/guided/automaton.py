"""The lazily determinised view of a CompiledGrammar: numbered configurations (sets of NFA threads with
their return stacks), built on demand one byte or special token at a time, so a recursive grammar is a
pushdown automaton whose reachable part is built only as far as outputs go. Pure Python, no torch.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

from rawserve.engine.guided.nfa import CompiledGrammar
from rawserve.engine.guided.nfa_rows import edge_states, has_any_edge, has_edges, row_reader

MAX_STACK_DEPTH = 128  # nested calls of recursive rules (json_object depth, GBNF recursion)
DEAD = 0  # configuration id of the empty set: no thread survives
# Byte rows are tuples, the unexpanded one shared: a list of 256 per configuration is a container the garbage
# collector walks item by item in every collection it is young for (nested20's first pass interns ~2k), where a
# tuple of ints is untracked at its first collection.
UNEXPANDED = (-1,) * 256
DEAD_ROW = (DEAD,) * 256


def plain_flags(g: CompiledGrammar, consuming: bytes) -> bytearray:
    """Per state (and MARK, last): 1 where it consumes and has no epsilon move, call or rule end, else 2. All states
    at once, each flag a byte of a big int: worked out state by state on first use it was ~1,300 calls a later cold
    pass of nested20, each reading two edge lists' offsets (a virtual state's through its span)."""
    n = g.num_states
    ones = int.from_bytes(b"\x01" * n, "little")
    moves = int.from_bytes(edge_states(g.eps), "little") | int.from_bytes(edge_states(g.call_edges), "little")
    final = int.from_bytes(bytes(g.is_final), "little")
    plain = int.from_bytes(consuming[:n], "little") & ~(moves | final) & ones
    return bytearray((2 * ones - plain).to_bytes(n, "little")) + b"\x01"  # MARK: any byte, forever


def row_alive_runs(row: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The maximal byte runs [begin, end) where a row leads on (not DEAD), as expand records them."""
    runs: list[tuple[int, int]] = []
    for b, nxt in enumerate(row):
        if nxt != DEAD:
            if runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
    return tuple(runs)


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
        self._any_byte = ((0, 255, n),)  # MARK's byte edges
        # 1 per state with a byte or token edge (MARK too): bytes, not a list of bools, which the garbage collector
        # walks item by item (12k for nested20) in the collections a new grammar's first masks run
        self.consuming = bytes(has_edges(g.byte_edges, g.token_edges) + [True])
        # per state: 1 where a thread's closure is itself (it consumes, and has no epsilon move, call or rule end),
        # else 2. Most threads a byte moves are so (a string character's inner states, a key's letters): their closure
        # is made without the work loop, which a cold pass ran ~200 times a mask in a counted string's pairings
        self._plain = plain_flags(g, self.consuming)
        # C-level s -> row readers, made once: a closure, an expansion and a special-token step each made theirs per
        # call (7,600 in nested20's first pass)
        self._read_eps, self._read_calls = row_reader(g.eps), row_reader(g.call_edges)
        self._read_bytes, self._read_tokens = row_reader(g.byte_edges), row_reader(g.token_edges)
        self.accept_state = g.rule_final[g.start_rule]
        self._tail: dict[int, bool] = {}
        self.stacks: list[tuple[int, int, int]] = [(-1, -1, 0)]
        self._stack_ids: dict[tuple[int, int], int] = {}
        self.configs: list[frozenset[tuple[int, int]]] = [frozenset()]
        self._config_ids: dict[frozenset[tuple[int, int]], int] = {frozenset(): DEAD}
        self.next_byte: list[tuple[int, ...]] = [DEAD_ROW]  # UNEXPANDED: not computed yet
        self.next_token: list[dict[int, int] | None] = [{}]  # special token id -> configuration; None: not yet
        # A grammar without special tokens (a JSON schema's) answers every configuration with this one dict, never
        # written: working each out read every thread's token row, ~1.5 ms of nested20's first pass (caches cold).
        self._no_tokens: dict[int, int] | None = None if has_any_edge(g.token_edges) else {}
        self.is_accepting: list[bool] = [False]
        self.is_complete: list[bool] = [False]  # accepting, and nothing more can follow
        # 0: dead; 1: a thread that never popped into a MARK frame is alive; 2: only MARK threads
        self.kind: list[int] = [0]
        # per configuration: its thread when it has one, else None. A narrow walk steps a configuration of one thread
        # on a state with lone_edges by those edges, interning nothing it passes through (lone_config)
        self.lone: list[tuple[int, int] | None] = [None]
        self._lone_edges: dict[int, tuple[tuple[int, int, int], ...] | None] = {}
        # configuration << 8 | depth -> its cut: an int key, where a (configuration, depth) tuple was a young object
        self._truncated: dict[int, int] = {}
        self._regions = sorted(g.repeats)
        self._region_firsts = [first for first, _, _ in self._regions]
        self._shift_keys: dict[int, tuple[frozenset[tuple[int, int]], int]] = {}
        self._shift_low: dict[int, int] = {}  # a configuration's lowest copy in its one run
        self._alive: dict[int, tuple[tuple[int, int], ...]] = {}  # expanded configuration -> alive_runs
        self._partial: dict[int, dict[int, int]] = {}  # unexpanded configuration -> the bytes stepped so far
        self._spare: dict[tuple[int, int], int] = {}  # (configuration, run) -> spare_in, asked per trie node
        self._edge_bytes: dict[int, int] = {}  # configuration -> edge_bytes
        self._state_covers: dict[int, int] = {}  # state -> state_covers
        self._edge_runs: dict[int, tuple[tuple[int, int], ...]] = {}  # configuration -> edge_runs
        # the threads a byte moves (in edge order) -> the configuration of their closure, for every configuration's
        # steps (expand, step_some, run_steps): a third of a cold pass's closures were of threads another
        # configuration's byte had moved already (a key's next letter, reached from two configurations). One thread is
        # its own key (a pair of ints, never equal to a tuple of pairs), not a 1-tuple: most moves are of one, and
        # every key a cold pass keeps is one more object its young collections walk (a quarter of the tuples kept)
        self._moved: dict[tuple[int, int] | tuple[tuple[int, int], ...], int] = {}
        self._mark_stack = self._push(self.mark, 0)
        self.start = self._intern(self._closure([(g.rule_start[g.start_rule], 0)]))

    @property
    def num_configs(self) -> int:
        return len(self.configs)

    @property
    def mark_stack(self) -> int:
        """The stack of one MARK frame, that truncate puts under every cut stack."""
        return self._mark_stack

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
        plain = self._plain
        for s, _ in threads:
            if plain[s] != 1:
                break
        else:  # every thread only consumes: the closure is the threads
            return frozenset(threads)
        g = self.g
        eps, calls, is_final, consuming, is_tail = g.eps, g.call_edges, g.is_final, self.consuming, self.is_tail
        read_eps, read_calls = self._read_eps, self._read_calls
        out = set()
        seen = set()
        work = list(threads)
        while work:
            thread = work.pop()
            if thread in seen:
                continue
            seen.add(thread)
            s, sid = thread
            if plain[s] == 1:  # it only consumes (MARK: any byte, forever): nothing more to follow
                out.add(thread)
                continue
            if consuming[s]:
                out.add(thread)
            row = read_eps(s)
            for t in (eps[s] if row is None else row):
                work.append((t, sid))
            row = read_calls(s)
            for rule, ret in (calls[s] if row is None else row):
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
        self.next_byte.append(UNEXPANDED)
        self.next_token.append(self._no_tokens)
        accepting = (self.accept_state, 0) in threads
        self.is_accepting.append(accepting)
        self.is_complete.append(accepting and len(threads) == 1)
        mark = self.mark
        kind = 0
        for s, _ in threads:  # a loop, not any() over a generator: a new configuration's first thread decides it
            if s != mark:
                kind = 1
                break
            kind = 2
        self.kind.append(kind)
        self.lone.append(next(iter(threads)) if len(threads) == 1 else None)
        return cid

    def truncate(self, cid: int, depth: int) -> int:
        """The configuration with every stack cut to its top `depth` frames over a MARK frame (cid
        itself when no stack is deeper). Near the depth cap nothing is cut: there a push the cut
        configuration allows may be one the real one refuses."""
        depth = min(depth, MAX_STACK_DEPTH)  # no stack is deeper: the same cut (cid), and a key below 1 << 8
        key = cid << 8 | depth
        cut = self._truncated.get(key)
        if cut is not None:
            return cut
        threads = self.configs[cid]
        stacks = self.stacks
        deepest = 0  # a loop, not all() and any() over generators: asked of most masks' configurations, once each
        for _, sid in threads:
            if stacks[sid][2] > deepest:
                deepest = stacks[sid][2]
        if deepest <= depth or deepest > MAX_STACK_DEPTH - 64:
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
        self._truncated[key] = cut
        return cut

    def restack(self, cid: int, sid: int) -> int:
        """cid's threads all put on stack `sid` (interned): a cut configuration read at a real depth."""
        return self._intern(frozenset((s, sid) for s, _ in self.configs[cid]))

    def shift_key(self, cid: int) -> tuple[frozenset[tuple[int, int]], int]:
        """(threads, run): with threads in one repeat run (CompiledGrammar.repeats) the threads moved back so
        its lowest copy is copy 0, and that run's index; else the threads as they are and -1 (none in a run)
        or -2 (several runs). Configurations with equal keys in a run are shifts of each other along it: a
        thread in copy i steps as the one in copy i + 1 does, as long as neither is near the run's end (see
        spare_in)."""
        key = self._shift_keys.get(cid)
        if key is not None:
            return key
        threads = self.configs[cid]
        run, low = -1, 0
        for s, _ in threads:
            r = self._run_of(s)
            if r >= 0:
                first, stride, _ = self._regions[r]
                i = (s - first) // stride
                if run == -1:
                    run, low = r, i
                elif run != r:
                    run = -2
                    break
                else:
                    low = min(low, i)
        if run >= 0 and low:
            first, stride, _ = self._regions[run]
            threads = frozenset((s - low * stride, sid) if self._run_of(s) == run else (s, sid) for s, sid in threads)
        key = self._shift_keys[cid] = (threads, run)
        if run >= 0:
            self._shift_low[cid] = low
        return key

    def shift_low(self, cid: int) -> int:
        """The lowest copy of its one repeat run that cid's threads are in (shift_key's shift; 0 outside a run)."""
        self.shift_key(cid)
        return self._shift_low.get(cid, 0)

    def shift_next(self, prev: int, cid: int) -> int | None:
        """The configuration a string w leads to from cid, when w led from prev to cid and cid is prev one copy
        on along a repeat run: cid one more copy on, made without stepping (interned from its threads). None
        unless that holds, or when cid has under five copies to spare (w being one character, at most four
        bytes, each taking a thread at most one copy on)."""
        key, run = self.shift_key(cid)
        if run < 0 or self.shift_key(prev) != (key, run) or self._shift_low[cid] != self._shift_low[prev] + 1:
            return None
        if self.spare_in(cid, run) < 5:
            return None
        first, stride, count = self._regions[run]
        end = first + stride * count
        return self._intern(frozenset((s + stride, sid) if first <= s < end else (s, sid)
                                      for s, sid in self.configs[cid]))

    def shift_by(self, cid: int, run: int, copies: int) -> int | None:
        """cid with its threads in repeat run `run` moved `copies` copies on (interned, without stepping); None
        when one would leave the run."""
        first, stride, count = self._regions[run]
        end = first + stride * count
        moved = copies * stride
        threads = []
        for s, sid in self.configs[cid]:
            if first <= s < end:
                s += moved
                if s >= end:
                    return None
            threads.append((s, sid))
        return self._intern(frozenset(threads))

    def in_run(self, cid: int, run: int) -> bool:
        """Whether any of cid's threads is in repeat run `run`."""
        first, stride, count = self._regions[run]
        end = first + stride * count
        return any(first <= s < end for s, _ in self.configs[cid])

    def only_in_run(self, cid: int, run: int) -> bool:
        """Whether every one of cid's threads is in repeat run `run` (shift_by then moves them all)."""
        first, stride, count = self._regions[run]
        end = first + stride * count
        return all(first <= s < end for s, _ in self.configs[cid])

    def expand_shifted(self, prev: int, cid: int) -> tuple[int, ...]:
        """expand(cid), where cid is prev one copy on along a repeat run (as shift_next makes them) and prev is
        expanded: each of prev's next configurations one copy on, interned without closures. A byte takes a
        thread at most one copy on, so with five copies to spare the shifted threads stay inside the run, where
        copy i + 1 steps as copy i does. Otherwise, or when prev is not expanded yet, a plain expand."""
        row = self.next_byte[cid]
        if cid == DEAD or row[0] >= 0:
            return row
        base = self.next_byte[prev]
        key, run = self.shift_key(cid)
        if (base[0] < 0 or run < 0 or self.shift_key(prev) != (key, run)
                or self._shift_low[cid] != self._shift_low[prev] + 1 or self.spare_in(cid, run) < 5):
            return self.expand(cid)
        first, stride, count = self._regions[run]
        end = first + stride * count
        shifted: dict[int, int] = {DEAD: DEAD}
        row = []
        for nxt in base:
            hit = shifted.get(nxt)
            if hit is None:
                hit = shifted[nxt] = self._intern(frozenset(
                    (s + stride, sid) if first <= s < end else (s, sid) for s, sid in self.configs[nxt]))
            row.append(hit)
        if prev in self._alive:  # a shifted configuration is DEAD where its predecessor is
            self._alive[cid] = self._alive[prev]
        row = self.next_byte[cid] = tuple(row)
        return row

    def _run_of(self, s: int) -> int:
        r = bisect_right(self._region_firsts, s) - 1
        if r >= 0:
            first, stride, count = self._regions[r]
            if s < first + stride * count:
                return r
        return -1

    def spare_in(self, cid: int, run: int) -> int:
        """Copies of repeat run `run` that cid's threads may still take before its last two (a large number
        when none is in it), counted from the copy a byte may take each thread into: copy i's end (its state at
        first + i * stride) steps into copy i + 1, a state inside copy i no further than copy i's end. A thread
        with at least one to spare steps as its shift a copy on does: only the run's last copy's end takes no
        byte. Counting a state inside a copy as its end was one copy short: a run's last place but one has its
        pairing's states inside the last copy but one, and was paired on its own (a third of nested20's largest
        cold mask) where the kept pairing, shifted, proves it (LexemeWalk.counted_place)."""
        key = (cid, run)
        spare = self._spare.get(key)
        if spare is not None:
            return spare
        first, stride, count = self._regions[run]
        end = first + stride * count
        reach = -1
        for s, _ in self.configs[cid]:
            if first <= s < end:
                copy, offset = divmod(s - first, stride)
                reach = max(reach, copy + 1 if offset == 0 else copy)
        spare = count - 1 - reach if reach >= 0 else 1 << 30
        self._spare[key] = spare
        return spare

    def step_byte(self, cid: int, byte: int) -> int:
        nxt = self.next_byte[cid][byte]
        return nxt if nxt >= 0 else self.expand(cid)[byte]

    def expand(self, cid: int) -> tuple[int, ...]:
        """Build all 256 byte transitions of a configuration at once: bytes that no edge boundary
        separates behave alike, so each run of them costs one closure."""
        row = self.next_byte[cid]
        if cid == DEAD or row[0] >= 0:
            return row
        edges = self._edges(cid)
        cuts = sorted({0, 256, *(lo for row, _ in edges for lo, _, _ in row),
                       *(hi + 1 for row, _ in edges for _, hi, _ in row)})
        row = [DEAD] * 256
        # Byte runs that move the same threads share one closure (_moved): a string character's class is cut
        # into a dozen runs (around `"`, `\` and the UTF-8 lead bytes) that mostly move alike.
        closed = self._moved
        alive: list[tuple[int, int]] = []
        for begin, end in zip(cuts, cuts[1:]):
            moved = [(t, sid) for row, sid in edges for lo, hi, t in row if lo <= begin <= hi]
            if moved:
                key = moved[0] if len(moved) == 1 else tuple(moved)
                nxt = closed.get(key)
                if nxt is None:
                    nxt = closed[key] = self._intern(self._closure(moved))
                if nxt != DEAD:
                    row[begin:end] = [nxt] * (end - begin)
                    if alive and alive[-1][1] == begin:
                        alive[-1] = (alive[-1][0], end)
                    else:
                        alive.append((begin, end))
        self._alive[cid] = tuple(alive)
        row = self.next_byte[cid] = tuple(row)
        return row

    def alive_runs(self, cid: int) -> tuple[tuple[int, int], ...]:
        """The maximal byte runs [begin, end) of a configuration's row that lead on (not DEAD), recorded as expand
        made it: a narrow walk reads a wide trie node's children in these runs alone (most of the 256 at the root,
        or below `"` or a space, are dead for a key or a number), and the string lexer's states are found by them
        (lexemes.StringLexer.by_alive)."""
        runs = self._alive.get(cid)
        if runs is None:
            row = self.expand(cid)
            runs = self._alive.get(cid)
            if runs is None:  # DEAD, or a row made by expand_shifted
                runs = self._alive[cid] = row_alive_runs(row)
        return runs

    def run_steps(self, cid: int, runs: Sequence[tuple[int, int, int]]) -> list[int] | None:
        """Per run (lo, hi, _) of bytes (covering 0-255), where every byte of it leads from cid, when no byte edge of
        cid's threads begins or ends inside a run (so all its bytes move the same threads); None otherwise, or when
        cid is expanded or DEAD (read the row instead). cid's row is left unbuilt: a pairing with the string lexer
        reads 30 configurations inside a character per place of a counted string this way, and builds none of their
        256-entry rows."""
        if cid == DEAD or self.next_byte[cid][0] >= 0:
            return None
        edges = self._edges(cid)
        closed = self._moved
        out = []
        for lo, hi, _ in runs:
            moved = []
            for row, sid in edges:
                for e_lo, e_hi, t in row:
                    if e_lo <= lo and hi <= e_hi:
                        moved.append((t, sid))
                    elif e_lo <= hi and lo <= e_hi:
                        return None
            key = moved[0] if len(moved) == 1 else tuple(moved)
            nxt = closed.get(key)
            if nxt is None:
                nxt = closed[key] = self._intern(self._closure(moved)) if moved else DEAD
            out.append(nxt)
        return out

    def edge_bytes(self, cid: int) -> int:
        """The bytes some byte edge of cid's threads takes, as a bitmask (bit b: byte b): those its row may lead on
        from (a superset of the alive ones), read without building the row. Kept: a narrow configuration is asked
        by its refusals and its walk's width each."""
        covered = self._edge_bytes.get(cid)
        if covered is None:
            # its states', kept per state, with no edge list made for cid: most states recur across configurations
            # (a value's whitespace, a number's digits), and a configuration refused by its bytes needs none
            state_covers = self.state_covers
            covered = 0
            for s, _ in self.configs[cid]:
                covered |= state_covers(s)
            self._edge_bytes[cid] = covered
        return covered

    def state_covers(self, s: int) -> int:
        """The bytes some byte edge of state s takes, as a bitmask (MARK: every byte). Kept per state."""
        covered = self._state_covers.get(s)
        if covered is None:
            covered = 0
            if s == self.mark:
                covered = (1 << 256) - 1
            else:
                row = self._read_bytes(s)
                for lo, hi, _ in (self.g.byte_edges[s] if row is None else row):
                    covered |= (1 << (hi + 1)) - (1 << lo)
            self._state_covers[s] = covered
        return covered

    def edge_runs(self, cid: int) -> tuple[tuple[int, int], ...]:
        """The maximal byte runs [begin, end) that some byte edge of cid's threads takes: a superset of alive_runs,
        read without building the row. A narrow walk reads a wide trie node's children in these and steps cid by
        their bytes alone (step_some): a key's or a number's row, built, made 256 entries that nothing read. Kept,
        as a walk meets a configuration at every wide node below it."""
        runs = self._edge_runs.get(cid)
        if runs is None:
            merged: list[tuple[int, int]] = []
            for lo, hi in sorted([(lo, hi + 1) for row, _ in self._edges(cid) for lo, hi, _ in row]):
                if merged and lo <= merged[-1][1]:
                    if hi > merged[-1][1]:
                        merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            runs = self._edge_runs[cid] = tuple(merged)
        return runs

    def _edges(self, cid: int) -> list[tuple[tuple[tuple[int, int, int], ...], int]]:
        """(byte edges, stack id) per thread of cid with byte edges: the edges (lo, hi, target state) are its state's
        row, shared by every configuration on that state, so a new configuration makes one pair per thread, not a
        (lo, hi, target, stack) tuple per edge (json_object's first pass made ~1,500 such, a third of what its young
        collection walked). Made at each read, not kept: a narrow configuration's are read by its walk (edge_runs)
        and by each step_some, three to five times a mask, but kept they were ~1,000 tuples a json_object pass that
        lived to its young collection (a quarter of what that one walked, inside a mask), where made anew they die
        at once (a pass no slower within the box's noise: the rows they pair are read at C level)."""
        byte_edges, mark, any_byte = self.g.byte_edges, self.mark, self._any_byte
        read = self._read_bytes
        groups = []
        for s, sid in self.configs[cid]:
            if s == mark:
                row = any_byte
            else:
                # None, not a falsy row, sends the read to rows[s]: a state without byte edges has an empty row,
                # and `read(s) or rows[s]` sent every read of one to PackedRows.__getitem__
                row = read(s)
                if row is None:
                    row = byte_edges[s]
            if row:
                groups.append((row, sid))
        return groups

    def lone_edges(self, s: int) -> tuple[tuple[int, int, int], ...] | None:
        """s's byte edges (lo, hi, target), sorted and disjoint, when a thread on s alone is a configuration (s only
        consumes: no epsilon move, call or rule end) that every byte takes to one thread at most (no two edges share a
        byte): a key's letter, a digit, a string's character. None otherwise, MARK too."""
        edges = self._lone_edges.get(s, False)
        if edges is False:
            edges = None
            if s != self.mark and self._plain[s] == 1:
                row = self._read_bytes(s)
                if row is None:
                    row = self.g.byte_edges[s]
                if len(row) == 1:  # most (a key's letter): nothing to sort or compare, asked once per state walked
                    edges = tuple(row)
                else:
                    row = sorted(row)
                    if all(prev[1] < nxt[0] for prev, nxt in zip(row, row[1:])):
                        edges = tuple(row)
            self._lone_edges[s] = edges
        return edges

    def lone_thread(self, cid: int) -> tuple[int, int, tuple[tuple[int, int, int], ...]] | None:
        """(state, stack, that state's lone_edges) of cid's one thread when a walk or step_bytes steps it by those
        edges, else None."""
        thread = self.lone[cid]
        if thread is None:
            return None
        edges = self.lone_edges(thread[0])
        return None if edges is None else (*thread, edges)

    def lone_config(self, s: int, sid: int) -> int:
        """The configuration of thread (s, sid)'s closure, interned (kept in _moved, where one thread is its own
        key)."""
        thread = (s, sid)
        cid = self._moved.get(thread)
        if cid is None:
            cid = self._moved[thread] = self._intern(self._closure([thread]))
        return cid

    def step_some(self, cid: int, data: Iterable[int]) -> tuple[int, ...] | dict[int, int]:
        """cid's next configurations for the bytes of `data` alone (its whole row when expanded): a tail walk
        follows two or three bytes out of a configuration whose full row would intern ten successors
        (an escape's, the UTF-8 lead bytes'): half the configurations a maxLength string's first mask interned."""
        row = self.next_byte[cid]
        if cid == DEAD or row[0] >= 0:
            return row
        known = self._partial.get(cid)
        if known is None:
            known = self._partial[cid] = {}
        edges = None
        closed = self._moved
        for byte in data:
            if byte in known:
                continue
            if edges is None:
                edges, covered = self._edges(cid), self.edge_bytes(cid)
            if not covered >> byte & 1:  # no edge takes it: most of a narrow trie node's children for a key's letter
                known[byte] = DEAD
                continue
            moved = [(t, sid) for row, sid in edges for lo, hi, t in row if lo <= byte <= hi]
            key = moved[0] if len(moved) == 1 else tuple(moved)
            nxt = closed.get(key)
            if nxt is None:
                nxt = closed[key] = self._intern(self._closure(moved))
            known[byte] = nxt
        return known

    def step_bytes(self, cid: int, data: bytes) -> int:
        """Where `data` leads from cid, a byte at a time: a configuration not expanded yet is stepped by that byte
        alone (step_some), not its whole row. A sampled token inside a counted string that took the lexeme's
        sets passes places no walk expanded, and full rows made its advance cost 40x (34 ms of a 315-character
        body's first pass). A configuration of one thread with lone_edges is stepped by those, and what it leads to
        interned only where that is not such a thread again: a token that spells a key's letters interned a
        configuration per byte, most of nested20's first pass's, none of them a request's."""
        next_byte, lone_thread, lone_edges = self.next_byte, self.lone_thread, self.lone_edges
        s = -1  # with sid, the one thread cid stands for while s >= 0 (not interned)
        for byte in data:
            if s < 0:
                nxt = next_byte[cid][byte]
                if nxt >= 0:
                    cid = nxt
                    if cid == DEAD:
                        return DEAD
                    continue
                thread = lone_thread(cid)
                if thread is None:
                    cid = self.step_some(cid, (byte,))[byte]
                    if cid == DEAD:
                        return DEAD
                    continue
                s, sid, _ = thread
            for lo, hi, t in lone_edges(s):
                if lo <= byte <= hi:
                    break
            else:
                return DEAD
            if lone_edges(t) is not None:
                s = t
            else:
                s, cid = -1, self.lone_config(t, sid)
                if cid == DEAD:
                    return DEAD
        return cid if s < 0 else self.lone_config(s, sid)

    def allowed_tokens(self, cid: int) -> dict[int, int]:
        """Special tokens this configuration can take now -> the configuration after each (worked out once: None in
        next_token until then; an empty answer, most configurations', was worked out again at every ask, twice
        per mask and per advance)."""
        cache = self.next_token[cid]
        if cache is not None:
            return cache
        cache = self.next_token[cid] = {}
        moves: dict[int, list[tuple[int, int]]] = {}
        token_edges = self.g.token_edges
        read = self._read_tokens
        for s, sid in self.configs[cid]:
            if s == self.mark:
                continue
            row = read(s)  # most states have no token edges: their empty row read at C level, as _edges reads
            for token_id, t in (token_edges[s] if row is None else row):
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
