"""Token masks: one grammar's automaton walked over the vocabulary trie, cached per configuration, and
applied to logits rows; plus each request's place in its grammar.

Core side. Only rows of constrained requests are touched; a mask is computed once per configuration
(a few ms for a wide one) and reused by every request of the same grammar.
"""
from __future__ import annotations

import gc
import sys
import time
from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import logging

import torch

from rawserve.engine.guided.automaton import DEAD, Automaton
from rawserve.engine.guided.counted_tail import CountedTail, InsideUpTo, counted_tokens
from rawserve.engine.guided.lexemes import LexemeWalk, StringLexeme, prepare_string_lexemes, string_lexer
from rawserve.engine.guided.mask_worker import MaskWorker
from rawserve.engine.guided.nfa import CompiledGrammar
from rawserve.engine.guided.plain_walk import PlainWalk
from rawserve.engine.guided.token_mask import SHORT_MAX_IDS, TokenMask, apply_rows, id_tensor, to_device
from rawserve.engine.guided.vocab import VocabIndex

log = logging.getLogger("rawserve.engine.guided")

# A configuration that more first bytes than this can continue is walked densely (every trie node at once).
DENSE_WALK_FIRST_BYTES = 24
# Per grammar: past this many configurations (about 4 KB each with their transition rows) an adversarial
# grammar stops growing, and its requests end. Real ones stay far below: 4,660 for a long 20-property output.
MAX_CONFIGS = 50_000
# Per grammar, the walks and masks kept; past this they are dropped and rebuilt as reached (a wide mask is
# up to 600 KB, and an adversarial grammar can reach thousands of configurations).
MAX_CACHE_BYTES = 64 << 20
# A narrow configuration is walked in Python, node by node, until this many trie edges have been looked at;
# past it (a narrow start that opens onto a wide subtree) the tensor walk takes over.
PY_WALK_BUDGET = 40_000
# A trie node with at most this many children steps its configuration by those bytes alone (Automaton.step_some),
# not its whole row.
PY_WALK_STEP_SOME_MAX = 8
# Stack frames a mask's base walk keeps: tokens that close more nested rules than this (e.g. `}}]}`)
# are checked one by one against the whole stack.
TRUNCATE_DEPTH = 3
# A mask of at most this many walked ids is made as an id list directly (no [V] bool).
SPARSE_MASK_MAX_IDS = 4096
# A walk of at most this many ids (with the undecided ones allowed) is made into its mask in Python.
SPARSE_PY_MAX_IDS = 1024
# _walk's plain count for a configuration inside the string lexeme: its mask is the lexeme's inside set, plus
# the walked tokens (lexemes.LexemeWalk).
IN_STRING_LEXEME = -2
QUOTE = 0x22


class GrammarRuntime:
    """One compiled grammar on one vocabulary: its automaton, a dense (configuration, byte) table the
    trie walk reads, and the masks built so far. Shared by every request of that grammar."""

    def __init__(self, compiled: CompiledGrammar, vocab: VocabIndex, device: torch.device | str = "cpu") -> None:
        self.key = compiled.key
        self.automaton = Automaton(compiled)
        self.vocab = vocab
        self.device = torch.device(device)
        self._is_cpu = self.device.type == "cpu"
        self._table = torch.full((64 * 256,), -1, dtype=torch.int64)  # next config per cid * 256 + byte
        self._table[:256] = DEAD
        self._kind = torch.zeros(64, dtype=torch.int8)  # Automaton.kind per configuration, as the walk reads it
        self._num_kinds = 0
        self._masks: dict[int, TokenMask] = {}  # per configuration
        self._walks: dict[int, tuple] = {}  # per truncated configuration: what _walk returned, its ids as arrays
        self._plain = PlainWalk(self.automaton, vocab)  # walks of configurations plain characters move alike
        self._lexeme = LexemeWalk(self.automaton, vocab)  # configurations inside a JSON string body
        self._tail = CountedTail(self._lexeme)  # a counted string's last places: the lexeme's tokens by count
        # per (cut configuration, ids checked one by one, special ids, accepting), or cut << 1 | accepting
        self._shared: dict[tuple | int, TokenMask] = {}
        self._shared_masks = vocab.shared_masks  # equal masks are one object, across grammars too
        # the device in its keys as a string, not a torch.device object
        self._device_key = str(self.device)
        # configuration << 32 | token id -> the configuration after it: an int key, not a young tuple per token
        self._token_next: dict[int, int] = {}
        self.num_masks_built = 0
        self.num_walks = {"lexeme": 0, "plain": 0, "python": 0, "tensor": 0}  # which walk built each mask's base
        self.mask_build_s = 0.0
        self.mask_build_cpu_s = 0.0  # the building thread's CPU time: what a shared box's scheduler leaves out
        self._cache_bytes = 0  # what the walks and masks hold, apart from the plain walks'

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes + self._plain.cache_bytes + self._lexeme.cache_bytes + self._tail.cache_bytes

    @property
    def start(self) -> int:
        return self.automaton.start

    def advance(self, cid: int, token_id: int) -> int:
        """The configuration after `token_id` (DEAD if the grammar does not allow it)."""
        key = cid << 32 | token_id if 0 <= token_id < 1 << 32 else (cid, token_id)
        nxt = self._token_next.get(key)
        if nxt is None:
            a = self.automaton
            if a.num_configs > MAX_CONFIGS:
                nxt = DEAD
            elif token_id in a.allowed_tokens(cid):
                nxt = a.allowed_tokens(cid)[token_id]
            else:
                data = self.vocab.token_bytes[token_id] if 0 <= token_id < len(self.vocab.token_bytes) else b""
                if not data or token_id in self.vocab.special_set:
                    nxt = DEAD
                else:  # inside a counted string, by shifting (lexemes.LexemeWalk.advance_counted)
                    nxt = self._lexeme.advance_counted(cid, data)
                    if nxt is None:
                        nxt = a.step_bytes(cid, data)
            self._token_next[key] = nxt
            self._cache_bytes += 100  # the dict entry
        return nxt

    def mask(self, cid: int) -> TokenMask:
        """The configuration's mask. Its stacks cut to their top frames give the base walk, shared by
        every configuration that differs only deeper down; the few tokens that pop below the cut are
        then checked one by one against the whole configuration."""
        mask = self._masks.get(cid)
        if mask is not None:
            return mask
        # One thread: a mask is hundreds of small tensor ops, and on a busy machine every intra-op
        # barrier waits for the slowest thread (a 40 ms walk took 1 s with two threads under load).
        threads = torch.get_num_threads()
        if threads == 1:  # already one (bench.guided's --mask-threads): the two sets cost ~4 us a mask, caches cold
            return self._build(cid)
        torch.set_num_threads(1)
        try:
            return self._build(cid)
        finally:
            torch.set_num_threads(threads)

    def has_mask(self, cid: int) -> bool:
        return cid in self._masks

    def build(self, cid: int) -> TokenMask:
        """mask() without touching torch's thread count: for the helper thread, where set_num_threads would
        change the forward's threads too (it is process-wide)."""
        mask = self._masks.get(cid)
        return mask if mask is not None else self._build(cid)

    def _build(self, cid: int) -> TokenMask:
        began, began_cpu = time.perf_counter(), time.thread_time()
        if self.cache_bytes > MAX_CACHE_BYTES:  # caches only: what is dropped is rebuilt when reached again
            self._masks.clear()
            self._walks.clear()
            self._plain.clear()
            self._lexeme.clear()
            self._tail.clear()
            self._shared.clear()
            self._token_next.clear()
            self._cache_bytes = 0
        a = self.automaton
        base = a.truncate(cid, TRUNCATE_DEPTH) if cid != DEAD else DEAD
        walked = self._walks.get(base)
        if walked is None:
            num_plain, certain, uncertain, lexeme = self._walk(base)
            # kept as int64 arrays (or a tensor), which the collector never tracks: a list is walked by every
            # collection, and a tuple of ints by the first young one that meets it (json_object's later passes kept
            # ~12k ids in tuples, a third of what their largest young collection walked, inside a mask)
            walked = self._walks[base] = (num_plain, certain if isinstance(certain, (array, torch.Tensor))
                                          else array("q", certain), array("q", uncertain), lexeme)
            self._cache_bytes += 8 * (len(walked[1]) + len(walked[2]))
        num_plain, certain, uncertain, lexeme = walked
        # a comprehension is a call: most masks have no undecided tokens and no special ones (DEAD's dict is empty)
        extra = [t for t in uncertain if self.advance(cid, t) != DEAD] if uncertain else []
        allowed = a.allowed_tokens(cid)
        specials = [t for t in allowed if 0 <= t < self.vocab.vocab_size] if allowed else []
        accepting = a.is_accepting[cid]
        # most masks check no token one by one and name no special one: an int key then, not a young tuple per mask
        key = base << 1 | accepting if not extra and not specials else (base, tuple(extra), tuple(specials), accepting)
        mask = self._shared.get(key)
        if mask is None:
            mask = self._make_mask(num_plain, certain, extra + specials, accepting, lexeme)
            self._shared[key] = mask
            self._cache_bytes += mask.nbytes
        self._masks[cid] = mask
        self.num_masks_built += 1
        self.mask_build_s += time.perf_counter() - began
        self.mask_build_cpu_s += time.thread_time() - began_cpu
        return mask

    def _sync(self, todo: list[int]) -> None:
        """Expand configurations `todo` into the table, growing it (and the kind array) as the automaton grew."""
        a = self.automaton
        rows = [a.expand(cid) if a.num_configs <= MAX_CONFIGS else [DEAD] * 256 for cid in todo]
        needed = a.num_configs
        if needed * 256 > self._table.numel():
            grown = torch.full((max(needed * 256, 2 * self._table.numel()),), -1, dtype=torch.int64)
            grown[:self._table.numel()] = self._table
            self._table = grown
        if needed > self._kind.numel():
            kind = torch.zeros(max(needed, 2 * self._kind.numel()), dtype=torch.int8)
            kind[:self._kind.numel()] = self._kind
            self._kind = kind
        if needed > self._num_kinds:
            self._kind[self._num_kinds:needed] = torch.tensor(a.kind[self._num_kinds:needed], dtype=torch.int8)
            self._num_kinds = needed
        if todo:
            self._table.view(-1, 256)[id_tensor(todo)] = id_tensor([c for row in rows for c in row]).view(-1, 256)

    def _lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """Next configurations for cid * 256 + byte keys, computing the unknown ones in Python."""
        if self.automaton.num_configs * 256 > self._table.numel():  # configurations made elsewhere
            self._sync([])
        nxt = self._table[keys]
        unknown = nxt < 0
        if bool(unknown.any()):
            self._sync(torch.unique(torch.div(keys[unknown], 256, rounding_mode="floor")).tolist())
            nxt = self._table[keys]
        return nxt

    def _walk_dense(self, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every trie node's configuration, level by level (a dead parent maps to DEAD through the
        table's row 0): a handful of tensor ops per level whatever the width. -> allowed token ids."""
        v = self.vocab
        offsets = v.level_offsets
        states = torch.zeros(v.num_nodes, dtype=torch.int64)
        states[0] = cid
        for d in range(1, len(offsets) - 1):
            lo, hi = offsets[d], offsets[d + 1]
            parent_states = states.index_select(0, v.flat_parent[lo:hi])
            nxt = self._lookup(parent_states * 256 + v.flat_byte[lo:hi])
            states[lo:hi] = nxt
            if d >= 4 and not bool(nxt.any()):  # nothing deeper can be alive
                break
        self._sync([])
        kinds = self._kind[states]
        tokens = v.flat_token
        return tokens[(kinds == 1) & (tokens >= 0)], tokens[(kinds == 2) & (tokens >= 0)]

    def _walk_sparse(self, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the children of alive nodes, level by level: cheap when few prefixes survive (literal
        keys, digits, enums), where the dense walk would touch every node."""
        v = self.vocab
        ends, end_states = [], []
        idx = torch.zeros(1, dtype=torch.int64)  # the root
        states = torch.tensor([cid], dtype=torch.int64)
        if cid != DEAD:
            for d in range(len(v.node_byte) - 1):
                counts = v.child_count[d].index_select(0, idx)
                total = int(counts.sum())
                if total == 0:
                    break
                starts = v.child_start[d].index_select(0, idx)
                # child j of the k-th alive node: starts[k] + j, laid out run after run
                run_begin = torch.cumsum(counts, 0) - counts
                children = torch.repeat_interleave(starts - run_begin, counts) + torch.arange(total)
                parent_states = torch.repeat_interleave(states, counts)
                keys = parent_states * 256 + v.node_byte[d + 1].index_select(0, children)
                nxt = self._lookup(keys)
                alive = nxt != DEAD
                idx = children[alive]
                states = nxt[alive]
                tokens = v.node_token[d + 1].index_select(0, idx)
                has_token = tokens >= 0
                ends.append(tokens[has_token])
                end_states.append(states[has_token])
                if idx.numel() == 0:
                    break
        if not ends:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty
        self._sync([])
        tokens, kinds = torch.cat(ends), self._kind[torch.cat(end_states)]
        return tokens[kinds == 1], tokens[kinds == 2]

    def _walk(self, cid: int) -> tuple[int, torch.Tensor | list[int], list[int], StringLexeme | InsideUpTo | None]:
        """(n: every token of 1..n plain characters is certainly allowed, -1 for none; more tokens it certainly
        allows; tokens that pop into a MARK frame: undecided; the string lexeme whose inside set is allowed too,
        or None). One inside
        a JSON string takes the lexeme's sets; one that plain characters move alike takes its plain tokens by
        count and walks the tails alone; other narrow ones walk in Python, and the rest walk the trie with
        tensors (densely when wide)."""
        if cid == DEAD:
            return -1, torch.zeros(0, dtype=torch.int64), [], None
        a = self.automaton
        # The bytes cid's edges cover bound those it takes. Most configurations' (a key's, a number's, an enum's)
        # cover no string lexer state's alive bytes: then cid is inside no string, counted or not (both ask
        # that), and is known narrow without building its row, which its walk leaves unbuilt too (_walk_py).
        covered = a.edge_bytes(cid)
        if string_lexer().may_pair(covered):
            # inside a JSON string (at a character boundary, or within a character or an escape): the lexeme's
            # inside set, shared by every grammar, and only the close tokens walked
            lexeme = self._lexeme.walk(cid)
            if lexeme is None:  # or a counted string's last places: its tokens of at most the characters left
                lexeme = self._tail.mask_sets(cid)
            if lexeme is not None:
                self.num_walks["lexeme"] += 1
                return IN_STRING_LEXEME, lexeme[1], lexeme[2], lexeme[0]
        # wide: more first bytes live than a Python walk takes on (an unbuilt row whose edges cover no more than
        # that is narrow as it stands: its live bytes are among them)
        wide = (a.next_byte[cid][0] >= 0 or covered.bit_count() > DENSE_WALK_FIRST_BYTES) and \
            256 - a.expand(cid).count(DEAD) > DENSE_WALK_FIRST_BYTES
        if wide:
            plain = self._plain.walk(cid)
            if plain is not None:
                self.num_walks["plain"] += 1
                return (*plain, None)
        else:
            walked = self._walk_py(cid)
            if walked is not None:
                self.num_walks["python"] += 1
                return -1, walked[0], walked[1], None  # arrays: most are a few ids, made into a mask in Python
        self.num_walks["tensor"] += 1
        walk = self._walk_dense if wide else self._walk_sparse
        certain, uncertain = walk(cid)
        return -1, certain, uncertain.tolist(), None

    def _walk_py(self, cid: int) -> tuple[array, array] | None:
        """The sparse walk in Python, node by node: for a narrow configuration (a key, digits, an enum) a
        handful of alive nodes, where each tensor op of the level walk costs more than the whole of it.
        None past PY_WALK_BUDGET edges."""
        a = self.automaton
        node_byte, first_child, num_children, node_token = self.vocab.py_arrays()
        next_byte, expand, step_some, kind = a.next_byte, a.expand, a.step_some, a.kind
        alive_runs, edge_runs, edge_bytes = a.alive_runs, a.edge_runs, a.edge_bytes
        lone_thread, lone_edges, state_covers, lone_config = a.lone_thread, a.lone_edges, a.state_covers, a.lone_config
        may_pair = string_lexer().may_pair
        below_quote, below_tail = self._lexeme.walk_below, self._tail.walk_below
        # int64 arrays: a string's kept close sets (below_quote) are copied in whole, and _build keeps them so
        certain = array("q")
        uncertain = array("q")
        budget = PY_WALK_BUDGET
        work: list[tuple[int, int]] = []  # (node, configuration)
        # (node, stack, the state's lone_edges): a configuration of one thread on a state with lone_edges, stepped by
        # those edges and never interned while it leads to such threads. Most configurations a narrow walk passes
        # through are so (a key's letters, past the byte that told it apart), and never a request's: with step_bytes's
        # alike, nested20's first pass interns ~870 configurations, not 1,307, and takes ~0.9x the CPU (its masks
        # between logits rows). The edges travel with the thread: read once per state the walk reaches.
        threads: list[tuple[int, int, tuple[tuple[int, int, int], ...]]] = []
        thread = lone_thread(cid)
        if thread is None:
            work.append((0, cid))
        else:
            threads.append((0, *thread[1:]))
        while work or threads:
            if threads:
                node, sid, edges = threads.pop()
                begin = first_child[node]
                end = begin + num_children[node]
                budget -= end - begin
                if budget < 0:
                    return None
                stepped = []  # (child, its configuration)
                for lo, hi, t in edges:
                    first = bisect_left(node_byte, lo, begin, end)
                    last = bisect_left(node_byte, hi + 1, first, end)
                    if first == last:
                        continue
                    next_edges = lone_edges(t)
                    if next_edges is None:  # t's closure moves on
                        nxt = lone_config(t, sid)
                        stepped += [(j, nxt) for j in range(first, last)]
                        continue
                    for j in range(first, last):
                        # an opening quote goes the configurations' way (below_quote reads it) unless t's edges cover
                        # no string lexer state's alive bytes, which both below_quote and below_tail then refuse
                        if node_byte[j] == QUOTE and num_children[j] and may_pair(state_covers(t)):
                            stepped.append((j, lone_config(t, sid)))
                            continue
                        token = node_token[j]
                        if token >= 0:  # a thread on a state that consumes: alive, and not a MARK frame's
                            certain.append(token)
                        if num_children[j]:
                            threads.append((j, sid, next_edges))
            else:
                node, c = work.pop()
                row = next_byte[c]
                begin = first_child[node]
                end = begin + num_children[node]
                if end - begin > PY_WALK_STEP_SOME_MAX:
                    # a wide node (the root, `"`, a space: up to 256 children) read in the bytes c takes alone, found
                    # by bisection (VocabIndex lays a node's children out in byte order): 98% of the children a
                    # narrow walk looked at were dead. An unexpanded c is read in the runs its edges cover and
                    # stepped by the bytes of the children there alone: its row stays unbuilt.
                    runs = edge_runs(c) if row[0] < 0 else None
                    if runs is not None and edge_bytes(c).bit_count() > DENSE_WALK_FIRST_BYTES:
                        runs = None  # wide: one row costs less than stepping byte by byte
                        row = expand(c)
                    children = [j for lo, hi in (alive_runs(c) if runs is None else runs)
                                for j in range(bisect_left(node_byte, lo, begin, end),
                                               bisect_left(node_byte, hi, begin, end))]
                    if row[0] < 0:
                        row = step_some(c, [node_byte[j] for j in children])
                else:
                    if row[0] < 0:
                        # inside a token few bytes go on, and most configurations there are never a request's:
                        # stepped by those alone, json_object's first pass interned 11% fewer configurations
                        row = step_some(c, node_byte[begin:end])
                    children = range(begin, end)
                budget -= end - begin
                if budget < 0:
                    return None
                stepped = [(j, row[node_byte[j]]) for j in children]
            for j, nxt in stepped:
                if nxt == DEAD:
                    continue
                token = node_token[j]
                if token >= 0:
                    (certain if kind[nxt] == 1 else uncertain).append(token)
                # an opening quote into a string body: the tokens below it from the lexeme's sets, shared by every
                # grammar, rather than a walk through the string's configurations (both refuse a configuration whose
                # edges cover no lexer state's alive bytes, as a key's after its opening quote: asked here first)
                if num_children[j] and not (node_byte[j] == QUOTE and may_pair(edge_bytes(nxt)) and (
                        below_quote(j, nxt, certain, uncertain) or below_tail(j, nxt, certain, uncertain))):
                    thread = lone_thread(nxt)
                    if thread is None:
                        work.append((j, nxt))
                    else:
                        threads.append((j, *thread[1:]))
        return certain, uncertain

    def _placed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids on the logits' device: on the CPU as they are (a no-op .to() went through the dispatcher, ~5 us a new
        mask with caches cold); to a GPU without waiting for its queued forward (token_mask.to_device), since the
        helper thread builds masks while the forward runs."""
        return ids if self._is_cpu else to_device(ids, self.device)

    def _make_mask(self, num_plain: int, certain: torch.Tensor | Sequence[int], more: list[int], accepting: bool,
                   lexeme: StringLexeme | InsideUpTo | None = None) -> TokenMask:
        if num_plain == IN_STRING_LEXEME:
            return self._lexeme_mask(lexeme, certain, more, accepting)
        if isinstance(certain, (list, tuple, array)):
            if len(certain) + len(more) <= SPARSE_PY_MAX_IDS:
                return self._list_mask(certain, more, accepting)
            certain = id_tensor(certain)
        return self._tensor_mask(num_plain, certain, more, accepting)

    def _list_mask(self, certain: Sequence[int], more: list[int], accepting: bool) -> TokenMask:
        """A narrow mask in Python and one tensor (the cat, isin and unique of _tensor_mask cost 50-100 us a mask,
        most of a key's or a digit's), or the equal one another configuration or grammar made
        (VocabIndex.shared_masks). Keyed by the ids as a frozenset, equal whatever order the walk found them in: a
        string value's start allows ~380 ids, and sorting them into a tuple cost ~60 us a mask where the set costs
        ~20. The set is the larger key (~30-90 bytes an id, a tuple's 8; counted as such against the shared masks'
        bound) and a container the garbage collector tracks, one per distinct mask."""
        allowed = frozenset(certain).union(more) if more else frozenset(certain)
        key = ("ids", self._device_key, accepting, allowed)
        mask = self._shared_masks.get(key)
        if mask is not None:
            return mask
        dups = self.vocab.dups_of()
        ids = sorted({*allowed, *(d for t in allowed if t in dups for d in dups[t])} if dups else allowed)
        if self._is_cpu and len(ids) <= SHORT_MAX_IDS:
            mask = TokenMask.short(ids, accepting)
        else:
            mask = TokenMask(True, self._placed(id_tensor(ids)), len(ids), accepting)
        return self._shared_masks.put(key, mask, sys.getsizeof(allowed))

    def _lexeme_mask(self, lexeme: StringLexeme | InsideUpTo, certain: Sequence[int], more: list[int],
                     accepting: bool) -> TokenMask:
        """A string lexeme's inside set with the walked ids allowed too (they carry their duplicates): one per
        lexeme and walked set whatever the configuration or grammar (VocabIndex.shared_masks): a string's places,
        and every schema's strings, walk the same few close sets."""
        allowed = frozenset(certain).union(more) if more else frozenset(certain)
        key = ("lexeme", self._device_key, accepting, lexeme.key, allowed)
        mask = self._shared_masks.get(key)
        if mask is None:  # the ids in any order: they are scattered into flags, or sorted by unique
            mask = self._shared_masks.put(key, self._lexeme_tensors(lexeme, id_tensor(list(allowed)), accepting),
                                          sys.getsizeof(allowed))
        return mask

    def _lexeme_tensors(self, lexeme: StringLexeme | InsideUpTo, allowed: torch.Tensor,
                        accepting: bool) -> TokenMask:
        v = self.vocab
        if not lexeme.is_ban_list:  # inside a character or an escape: few tokens, an allow list
            ids = torch.unique(torch.cat((lexeme.ids, allowed)))
            return TokenMask(True, self._placed(ids), int(ids.numel()), accepting)
        # the lexeme's ban list less what the walk allowed: no [V] pass (walked ids carry their duplicates)
        banned = lexeme.ids
        if allowed.numel():  # a [V] scatter and a gather: a third of what torch.isin cost
            flags = torch.zeros(v.vocab_size, dtype=torch.bool)
            flags[allowed] = True
            banned = banned[~flags.index_select(0, banned)]
        num_allowed = v.vocab_size - int(banned.numel())
        if num_allowed > v.vocab_size // 2:
            return TokenMask(False, self._placed(banned), num_allowed, accepting)
        keep = torch.ones(v.vocab_size, dtype=torch.bool)
        keep[banned] = False
        return TokenMask(True, self._placed(keep.nonzero().squeeze(1)), num_allowed, accepting)

    def _tensor_mask(self, num_plain: int, certain: torch.Tensor, more: list[int], accepting: bool) -> TokenMask:
        v = self.vocab
        if num_plain <= 0 and certain.numel() + len(more) <= SPARSE_MASK_MAX_IDS:
            # a narrow mask (a key, digits, punctuation: most of a schema's masks) as its id list alone, without
            # the four passes over a [V] bool that cost 0.2 ms a mask
            ids = torch.cat((certain, id_tensor(more))) if more else certain
            if v.dup_ids.numel() and ids.numel():
                ids = torch.cat((ids, v.dup_ids[torch.isin(v.dup_canon, ids)]))
            ids = torch.unique(ids)
            return TokenMask(True, self._placed(ids), int(ids.numel()), accepting)
        if num_plain > 0:
            allowed = v.plain_split().mask_upto(num_plain).clone()
        else:
            allowed = torch.zeros(v.vocab_size, dtype=torch.bool)
        allowed[certain] = True
        if more:
            allowed[id_tensor(more)] = True
        if v.dup_ids.numel():
            allowed[v.dup_ids] = allowed[v.dup_canon]
        num_allowed = int(allowed.sum())
        is_allow_list = num_allowed <= v.vocab_size // 2
        ids = (allowed if is_allow_list else ~allowed).nonzero().squeeze(1)
        return TokenMask(is_allow_list, self._placed(ids), num_allowed, accepting)


# From this many constrained rows a GPU step masks them all at once: apply_rows takes 10 torch ops for one row,
# where one row's own apply takes 3 or 4.
ROWS_AT_ONCE_MIN = 6


def apply_masks(logits: torch.Tensor, rows: list[tuple[int, GuidedState, list[int]]]) -> None:
    """Mask the constrained rows of a step's logits ([B, V], in place): (row, its state, its end ids). Every
    row's mask is had before any row is written, so a grammar that raises leaves the logits as they were.

    On a GPU, from ROWS_AT_ONCE_MIN rows, all at once (token_mask.apply_rows): 16 torch ops (not views) for 8 or
    32 rows of mixed masks, against 26 and 104 row by row, each a kernel launch the host pays for. On the CPU
    row by row, on one torch thread like the mask build: a short allow list is written through the row's memory,
    and the rest take 15-30 us a row alone, and 6-15 ms with two threads on a busy machine, where every intra-op
    barrier waits for the other thread; all rows at once there copy whole rows and took 1.4-3.5x as long (32 rows
    of 390 allowed ids: 17.8 against 5.2 ms).
    """
    masks = [(i, state.mask(), end_ids) for i, state, end_ids in rows]
    if not logits.is_cpu and len(masks) >= ROWS_AT_ONCE_MIN:
        apply_rows(logits, masks)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, mask, end_ids in masks:
            mask.apply(logits[i], end_ids)
    finally:
        torch.set_num_threads(threads)


class GuidedState:
    """One request's place in its grammar: a configuration id, advanced by each sampled token.

    Preemption recomputes the same tokens, so the state needs no rollback there. `failed` is a mask build on
    the helper thread that raised, (configuration, error): the step raises it in this request's row.
    """

    __slots__ = ("runtime", "config", "failed")

    def __init__(self, runtime: GrammarRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.start
        self.failed: tuple[int, Exception] | None = None

    def advance(self, token_id: int) -> None:
        self.config = self.runtime.advance(self.config, token_id)

    @property
    def is_complete(self) -> bool:
        """The output is a whole match and nothing may follow: the request should stop now."""
        return self.runtime.automaton.is_complete[self.config]

    @property
    def is_dead(self) -> bool:
        return self.config == DEAD

    @property
    def has_mask(self) -> bool:
        """Its mask now is built (or failed to build): the step can use it without building."""
        failed = self.failed
        return (failed is not None and failed[0] == self.config) or self.runtime.has_mask(self.config)

    def mask(self) -> TokenMask:
        failed = self.failed
        if failed is not None and failed[0] == self.config:
            raise failed[1]
        return self.runtime.mask(self.config)


def prepare_vocab(vocab: VocabIndex) -> None:
    """Build the vocabulary's plain split, Python trie arrays, string lexemes and their tokens by count
    (counted_tail), then freeze what is alive (gc.freeze).

    EngineCore froze the process at start, but the index is usually read later, at the first guided request:
    unfrozen, its lists (four of 333k ints, 8k dicts) made every full collection walk them, and a full
    collection in the core costs ~100 ms of one step on this box."""
    vocab.plain_split()
    vocab.py_arrays()
    prepare_string_lexemes(vocab)
    counted_tokens(vocab)
    gc.freeze()


class GuidedRegistry:
    """The core's grammars, shared across requests by key, least recently used dropped past `capacity`
    (requests still holding a dropped runtime keep it until they finish); and the helper thread that builds
    their masks ahead of need.

    Right after a row samples, its next mask is queued (`prefetch`; a new request's first at `state_for`), and
    the helper builds it while the next forward runs. A row whose mask is not ready when its logits are, after
    a short grace (`wait_built`), keeps them and samples in a later step (`is_ready` False;
    deferred.DeferredSamples): one cold mask never holds up the batch for longer than the grace. Drafted positions (speculative decoding) build theirs during the forward
    (`build_ahead`) and the step waits for what outlasts it.

    On a GPU the helper yields to the step's host code (`yields_to_step`; MaskWorker.hold_floor): it builds while the
    forward runs on the device and while the step waits for masks, not beside the step's launches and Python.
    """

    # None: yield where the forward runs on a CUDA device (its host code is then short launches and Python, which
    # the helper's Python would convoy, and the device's work leaves the host waiting); True / False: always / never
    # (tests run the yielding step on the CPU)
    YIELD_TO_STEP: bool | None = None

    def __init__(self, vocab: VocabIndex, device: torch.device | str = "cpu", capacity: int = 32) -> None:
        self.vocab = vocab
        self.device = device
        yields = self.YIELD_TO_STEP
        self.yields_to_step = torch.device(device).type == "cuda" if yields is None else yields
        self.capacity = capacity
        self._runtimes: OrderedDict[str, GrammarRuntime] = OrderedDict()
        # Its first job is the vocabulary's plain split and Python arrays (about a second), so no step waits for
        # them whole.
        self._worker = MaskWorker(lambda: prepare_vocab(vocab))
        self.ahead_wait_s = 0.0  # what steps waited for urgent masks still being built, in all
        self.ahead_wait_max_s = 0.0
        self.num_ahead = 0  # steps that built urgent masks
        self.num_sat_out = 0  # rows whose sample waited a step for their mask (row-steps)
        self.idle_wait_s = 0.0  # what steps with nothing else to run waited for the helper
        self.grace_wait_s = 0.0  # what steps waited for masks after their forward (wait_built), in all
        self.grace_wait_max_s = 0.0
        self._has_waiting_rows = False  # a row's sample waited this step

    def is_ready(self, state: GuidedState) -> bool:
        """May this row sample now? Yes when its mask is built and its grammar is not in the helper's hands;
        the runtime is then the step's until end_step. No queues its mask (if need be)."""
        runtime = state.runtime
        worker = self._worker
        if worker.try_claim(runtime):
            if state.has_mask:
                return True
            worker.enqueue(state, state.config)
        elif not worker.is_pending(state) and not state.has_mask:  # reading has_mask is safe: dict lookups
            worker.enqueue(state, state.config)
        self.num_sat_out += 1
        self._has_waiting_rows = True
        return False

    def wait_built(self, states: list[GuidedState], timeout_s: float) -> None:
        """Wait up to timeout_s for these states' masks, where some are not built yet (a bounded grace: the
        caller then defers what is still missing)."""
        worker = self._worker

        def is_done() -> bool:
            return all(s.has_mask and not worker.is_busy_with(s.runtime) for s in states)

        if not is_done():
            began = time.perf_counter()
            worker.wait_until(is_done, timeout_s)
            waited = time.perf_counter() - began
            self.grace_wait_s += waited
            self.grace_wait_max_s = max(self.grace_wait_max_s, waited)

    def prefetch(self, state: GuidedState) -> None:
        """`state` just advanced (its runtime is the step's): queue its next mask if not built, to start as the
        step ends."""
        if not state.has_mask:
            self._worker.enqueue(state, state.config)

    def forget(self, state: GuidedState) -> None:
        """Its request ended: its queued mask is not needed."""
        self._worker.forget(state)

    def release(self, states: Iterable[GuidedState]) -> None:
        """The step will not touch these states' grammars again (their rows sit it out): the helper may build on
        them now, while the step samples its other rows."""
        self._worker.release({state.runtime for state in states})

    def end_step(self) -> None:
        """The step is done with every grammar: the helper may build on all of them again."""
        self._worker.end_step()
        self._has_waiting_rows = False

    def hold_floor(self) -> None:
        """The step's host code runs: the helper starts no mask until release_floor, or a wait of the step's."""
        self._worker.hold_floor()

    def release_floor(self) -> None:
        self._worker.release_floor()

    @property
    def has_work(self) -> bool:
        """Masks are queued or being built (a hint)."""
        return self._worker.has_work

    def wait_for_masks(self, timeout_s: float = 0.05) -> None:
        """The step had nothing to run: if rows wait for their masks, wait (no spin) until the helper
        finishes one, or timeout_s, so the caller can take messages (aborts) and step again."""
        waiting = self._has_waiting_rows
        self.end_step()
        if waiting:
            self.idle_wait_s += self._worker.wait_progress(timeout_s)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the helper has nothing left to build (benches and tests)."""
        return self._worker.wait_idle(timeout_s)

    def mask_build_totals(self) -> tuple[int, float, float]:
        """(masks built, seconds, CPU seconds) over the grammars held (benches)."""
        runtimes = list(self._runtimes.values())
        return (sum(r.num_masks_built for r in runtimes), sum(r.mask_build_s for r in runtimes),
                sum(r.mask_build_cpu_s for r in runtimes))

    @property
    def num_masks_queued(self) -> int:
        return self._worker.num_queued

    @property
    def helper_cpu_s(self) -> float | None:
        """The mask helper thread's CPU seconds so far (benches; None where there is no per-thread clock)."""
        return self._worker.cpu_s

    def build_ahead(self, states: list[GuidedState]) -> bool:
        """Claim `states`' runtimes for this step (waiting for a mask the helper is building on one) and start
        building, on the helper thread, the masks they need now and do not have. False if none is missing. The
        caller must wait_ahead before it touches any of these grammars again."""
        worker = self._worker
        for state in states:
            worker.claim(state.runtime)
        todo = [s for s in states if not s.has_mask]
        if not todo:
            return False
        self.num_ahead += 1
        worker.start_urgent(todo)
        return True

    def wait_ahead(self, started: bool) -> None:
        if not started:
            return
        began = time.perf_counter()
        self._worker.wait_urgent()
        waited = time.perf_counter() - began
        self.ahead_wait_s += waited
        self.ahead_wait_max_s = max(self.ahead_wait_max_s, waited)

    def close(self) -> None:
        self._worker.close()

    def state_for(self, compiled: CompiledGrammar) -> GuidedState:
        runtime = self._runtimes.get(compiled.key)
        if runtime is None:
            runtime = GrammarRuntime(compiled, self.vocab, self.device)
            self._runtimes[compiled.key] = runtime
            while len(self._runtimes) > self.capacity:
                self._runtimes.popitem(last=False)
        else:
            self._runtimes.move_to_end(compiled.key)
        state = GuidedState(runtime)
        if not state.has_mask:  # its first mask, built while the request waits and its prompt runs
            self._worker.enqueue(state, state.config)
        return state
