"""The JSON string lexeme's token sets, built once per vocabulary and lexer state and shared by every grammar: the
tokens that stay inside a string body, and a trie of what follows a token's closing quote. Core side.

A grammar configuration proven to move as the lexer does from one of its states (`LexemeWalk.match`, a pairing of
its rows with the lexer's) takes that state's inside set whole and walks only the close trie, from the
configuration after the quote. A place of a counted (maxLength) string does too while it has room for every
token (`LexemeWalk._match_counted`).
"""
from __future__ import annotations

import threading
from array import array

import torch

from rawserve.engine.guided.automaton import DEAD, Automaton, row_alive_runs
from rawserve.engine.guided.grammar import Grammar, Repeat, lit, seq
from rawserve.engine.guided.json_strings import CHAR
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.token_mask import id_tensor

# Held while a vocabulary's shared sets are built (the lexer, each StringLexeme, counted_tail.CountedTokens), so
# the helper thread and a request's first mask never build one twice.
BUILD_LOCK = threading.Lock()
# What the sets read below opening quotes inside tokens (StringLexeme.anchored) may hold, per vocabulary; a few
# KB each for `"` and ` "` on Qwen3's vocabulary.
MAX_ANCHORED_BYTES = 16 << 20
# A copy of a counted run steps as the one a copy on does while it has this many copies to spare
# (Automaton.shift_next: a character is at most four bytes, each taking a thread at most one copy on).
SHIFT_SPARE = 5
# prepare_string_lexemes reads the sets below every opening quote within a token's first this many bytes, at start:
# 129 nodes, 2 ms of CPU and ~60 KB on Qwen3's vocabulary, which a first request's narrow walk paid before (its
# `"` and ` "` alone 0.6 ms, twice with counted strings).
OPENING_QUOTE_MAX_DEPTH = 4
# StringLexer.may_pair's answers kept, at most (one per distinct set of bytes a configuration's edges cover).
MAX_KEPT_COVERS = 4096


class StringLexer:
    """The body of a JSON string as rawserve's compilers spell it (json_strings.CHAR, repeated, then the closing
    `"`), as a fully expanded Automaton (37 states): `start` is a character boundary, `close` the state after the
    closing quote, `segments[state]` its row as runs (lo, hi, next) of bytes that move alike, and `by_alive` the
    states (not close) by which bytes they take, as maximal alive runs (what Automaton.alive_runs reads off a
    configuration's expansion, with no pass over its 256 entries); `start_alive` the bytes the start takes, as a
    bitmask (bit b: byte b), which a configuration's edges must cover for it to pair with the start."""

    def __init__(self) -> None:
        a = Automaton(compile_grammar(Grammar({"root": seq(Repeat(CHAR, 0, None), lit('"'))}), "lexeme:json-string"))
        self.automaton = a
        self.start = a.start
        todo, seen = [a.start], {a.start}
        while todo:
            for nxt in a.expand(todo.pop()):
                if nxt != DEAD and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        self.num_states = a.num_configs
        closes = [c for c in range(1, a.num_configs) if a.is_complete[c]]
        assert len(closes) == 1, "the closing quote ends the lexeme in one state"
        self.close = closes[0]
        self.close_bytes = [b for b in range(256) if a.next_byte[a.start][b] == self.close]
        self.rows = [a.next_byte[c] if c != DEAD else [DEAD] * 256 for c in range(a.num_configs)]
        self.segments: list[list[tuple[int, int, int]]] = []
        self.by_alive: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for c, row in enumerate(self.rows):
            runs, lo = [], 0
            for b in range(1, 257):
                if b == 256 or row[b] != row[lo]:
                    runs.append((lo, b - 1, row[lo]))
                    lo = b
            self.segments.append(runs)
            if c not in (DEAD, self.close):
                self.by_alive.setdefault(row_alive_runs(row), []).append(c)
        # each alive set of by_alive as a bitmask (bit b: byte b): LexemeWalk.match's refusal before a row is built
        self.alive_masks = tuple(sum((1 << end) - (1 << begin) for begin, end in key) for key in self.by_alive)
        self.start_alive = sum((1 << end) - (1 << begin) for begin, end in row_alive_runs(self.rows[self.start]))
        self._may_pair: dict[int, bool] = {}
        # [states * 256] next state per state * 256 + byte, for the vocabulary's dense walk
        self.table = torch.tensor([nxt for row in self.rows for nxt in row], dtype=torch.int64)

    def may_pair(self, covered: int) -> bool:
        """Whether a configuration whose edges cover the bytes `covered` (a bitmask, Automaton.edge_bytes) may move
        as some state of the lexer does: only if they cover one state's alive bytes whole. Kept per bitmask (a
        schema's keys and numbers ask the same few, each a pass over the lexer's 13 alive sets)."""
        hit = self._may_pair.get(covered)
        if hit is None:
            if len(self._may_pair) >= MAX_KEPT_COVERS:  # the process's lexer: bounded whatever the grammars
                self._may_pair.clear()
            hit = self._may_pair[covered] = any(mask & ~covered == 0 for mask in self.alive_masks)
        return hit


def _row_moves(row: list[int], segments: list[tuple[int, int, int]]) -> list[tuple[int, int]] | None:
    """(next configuration, next lexer state) for each run of a lexer state's row (`segments`) that stays alive,
    read off a configuration's `row`; None where the row does not move as the lexer's does (a run whose bytes lead
    apart, or one alive on one side and dead on the other)."""
    moves = []
    for lo, hi, nxt_state in segments:
        nxt = row[lo]
        if (hi > lo and row[lo:hi + 1].count(nxt) != hi + 1 - lo) or (nxt == DEAD) != (nxt_state == DEAD):
            return None
        if nxt != DEAD:
            moves.append((nxt, nxt_state))
    return moves


def _config_moves(a: Automaton, cid: int, state: int) -> list[tuple[int, int]] | None:
    """_row_moves of cid's row along lexer state `state`'s runs, read run by run without building the row where
    cid's edges allow (Automaton.run_steps)."""
    segments = string_lexer().segments[state]
    nexts = a.run_steps(cid, segments)
    if nexts is None:
        return _row_moves(a.expand(cid), segments)
    moves = []
    for nxt, (_, _, nxt_state) in zip(nexts, segments):
        if (nxt == DEAD) != (nxt_state == DEAD):
            return None
        if nxt != DEAD:
            moves.append((nxt, nxt_state))
    return moves


_LEXER: StringLexer | None = None


def pairing_cut(a: Automaton, cid: int) -> tuple[int, int]:
    """(the stack all of cid's threads share, -1 if they do not; the configuration LexemeWalk.match pairs with the
    lexer in cid's stead): cid cut to no frames over a MARK frame (Automaton.truncate(cid, 0)) when its threads share a
    stack, which every string of a rule shares at any depth; else, and at the top level (the empty stack), cid itself,
    whose pairing is kept by its NFA states (proof_key) as the rule's deeper strings' cuts are."""
    threads = a.configs[cid]
    stacks = {sid for _, sid in threads}
    if len(stacks) != 1:
        return -1, cid
    stack = next(iter(stacks))
    return stack, (a.truncate(cid, 0) if stack else cid)


def proof_key(a: Automaton, cut: int) -> int | tuple[int, ...]:
    """What LexemeWalk keeps a pairing of a cut under (pairing_cut: its threads on one stack, the MARK stack's or the
    top level's empty one): the threads' NFA states, the same for a top-level string and the rule's deeper ones. One
    thread's (most places inside a character or an escape) is its state, an int, not a frozenset: the collector
    tracks every frozenset, and the young collections walk those kept."""
    threads = a.configs[cut]
    if len(threads) == 1:
        return next(iter(threads))[0]
    return tuple(sorted([s for s, _ in threads]))


def string_lexer() -> StringLexer:
    """The process's StringLexer (it depends on no vocabulary), made on first use."""
    global _LEXER
    if _LEXER is None:
        with BUILD_LOCK:
            if _LEXER is None:
                _LEXER = StringLexer()
    return _LEXER


class StringLexeme:
    """One vocabulary's tokens against the string lexer from one of its states: the tokens that stay inside the
    string, as the shorter of their sorted ids (`ids`, `is_ban_list` False) or the sorted ids of every other token
    (specials, padding, tokens that close or break the string; `is_ban_list` True), and the close trie: per token
    that closes the string, the bytes after its closing quote (`close_children[node]` byte -> node,
    `close_tokens[node]` the ids whose rest ends there; node 0 is the quote itself). Duplicate tokens are in both
    under their own ids. From the start state (a character boundary) every trie node is read at once with tensors
    (30 ms); from the others (inside a character or an escape) few first bytes live, and a Python walk reads the
    few nodes that do."""

    def __init__(self, vocab, state: int) -> None:
        lexer = self.lexer = string_lexer()
        self.state = state
        if state == lexer.start:
            inside, closing = self._read_dense(vocab)
        else:
            inside, closing = self._read_sparse(vocab)
        dups = vocab.dups_of()
        allowed = torch.zeros(vocab.vocab_size, dtype=torch.bool)
        allowed[inside] = True
        if vocab.dup_ids.numel():
            allowed[vocab.dup_ids] = allowed[vocab.dup_canon]
        self.num_inside = int(allowed.sum())
        # from a character boundary almost every token stays inside; from within a character or an escape few do
        self.is_ban_list = self.num_inside > vocab.vocab_size // 2
        self.ids = ((~allowed) if self.is_ban_list else allowed).nonzero().squeeze(1)
        self.close_children: list[dict[int, int]] = [{}]
        self.close_tokens: list[list[int]] = [[]]
        token_bytes = vocab.token_bytes
        for token_id, depth in closing:
            at = 0
            for byte in token_bytes[token_id][depth:]:
                nxt = self.close_children[at].get(byte)
                if nxt is None:
                    nxt = self.close_children[at][byte] = len(self.close_children)
                    self.close_children.append({})
                    self.close_tokens.append([])
                at = nxt
            self.close_tokens[at].append(token_id)
            self.close_tokens[at].extend(dups.get(token_id, ()))
        self.nbytes = self.ids.numel() * 8 + 120 * len(self.close_children) + 8 * len(closing)
        # the most characters a token (or its rest after an opening quote) begins: a byte begins one at most
        self.max_chars = max(map(len, token_bytes), default=0)
        self._vocab = vocab
        self._subtrees: dict[int, tuple[list[int], list[int], list[dict[int, int]], list[list[int]], dict[int, int]]]
        self._subtrees = {}
        self.anchored_bytes = 0

    @property
    def key(self) -> tuple[str, int]:
        """What names these sets in a shared mask's key (shared_masks): the lexer state."""
        return ("state", self.state)

    def _read_dense(self, vocab) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(inside canonical ids, (token, bytes up to and with its closing quote) per closing token), every trie
        node's lexer state level by level."""
        lexer = self.lexer
        offsets = vocab.level_offsets
        states = torch.zeros(vocab.num_nodes, dtype=torch.int64)
        closed_at = torch.full((vocab.num_nodes,), -1, dtype=torch.int64)  # the node whose byte closed the string
        states[0] = self.state
        for d in range(1, len(offsets) - 1):
            lo, hi = offsets[d], offsets[d + 1]
            parents = vocab.flat_parent[lo:hi]
            states[lo:hi] = lexer.table[states.index_select(0, parents) * 256 + vocab.flat_byte[lo:hi]]
            closed_at[lo:hi] = torch.where(states[lo:hi] == lexer.close, torch.arange(lo, hi),
                                           closed_at.index_select(0, parents))
        tokens = vocab.flat_token
        is_token = tokens >= 0
        inside = tokens[is_token & (states != DEAD) & (states != lexer.close)]
        closing = is_token & (closed_at >= 0)
        close_nodes = closed_at[closing]
        # a node's depth is its level, and the closing node's depth is how many bytes precede the rest
        depths = torch.searchsorted(torch.tensor(offsets, dtype=torch.int64), close_nodes, right=True) - 1
        return inside, list(zip(tokens[closing].tolist(), depths.tolist()))

    def _read_sparse(self, vocab) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """As _read_dense, by a Python walk of the nodes the lexer keeps alive."""
        node_byte, first_child, num_children, node_token = vocab.py_arrays()
        rows, close = self.lexer.rows, self.lexer.close
        inside: list[int] = []
        closing: list[tuple[int, int]] = []
        work = [(j, self.state, 1) for j in range(first_child[0], first_child[0] + num_children[0])]
        while work:
            j, state, depth = work.pop()
            state = rows[state][node_byte[j]]
            if state == DEAD:
                continue
            if state == close:
                below = [(j, depth)]
                while below:  # every token from here on closes after `depth` bytes
                    k, _ = below.pop()
                    if node_token[k] >= 0:
                        closing.append((node_token[k], depth))
                    below.extend((m, depth) for m in range(first_child[k], first_child[k] + num_children[k]))
                continue
            if node_token[j] >= 0:
                inside.append(node_token[j])
            work.extend((k, state, depth + 1) for k in range(first_child[j], first_child[j] + num_children[j]))
        return id_tensor(inside), closing

    def anchored(self, node: int) -> tuple[list[int], list[dict[int, int]], list[list[int]]] | None:
        """For the tokens below trie node `node` (a token's bytes up to an opening quote, say `"` or ` "`), read
        from this lexeme's state at node: (the canonical ids that stay inside the string, and their close trie as
        (children, tokens) like close_children/close_tokens). See subtree."""
        hit = self.subtree(node)
        return None if hit is None else (hit[0], hit[2], hit[3])

    def subtree(self, node: int) -> tuple[list[int], list[int], list[dict[int, int]], list[list[int]],
                                          dict[int, int]] | None:
        """subtree_sets below trie node `node` from this lexeme's state: built on first use (or ahead, for the
        opening quotes tokens begin with: prepare_string_lexemes) and kept, up to MAX_ANCHORED_BYTES for all
        anchors (None past it: the caller walks the subtree itself). The start state's serve counted_tail too."""
        hit = self._subtrees.get(node)
        if hit is not None or self.anchored_bytes > MAX_ANCHORED_BYTES:
            return hit
        hit = self._subtrees[node] = subtree_sets(self._vocab, self.lexer, self.state, node)
        inside, counts, children, tokens, close_count = hit
        self.anchored_bytes += (16 * len(inside) + 120 * len(children) + 8 * sum(map(len, tokens))
                                + 100 * len(close_count))
        return hit


def subtree_sets(vocab, lexer, state: int, node: int) -> tuple[list[int], list[int], list[dict[int, int]],
                                                              list[list[int]], dict[int, int]]:
    """The tokens below trie node `node`, read from lexer state `state` there, by a Python walk of the subtree:
    (the ids that stay inside the string, the characters each begins, the close trie's children and tokens as
    StringLexeme.close_children/close_tokens, and per close token the characters before its closing quote).
    A character is counted where the walk leaves the lexer's start, so the counts mean something from the start."""
    node_byte, first_child, num_children, node_token = vocab.py_arrays()
    rows, start, close = lexer.rows, lexer.start, lexer.close
    inside: list[int] = []
    counts: list[int] = []
    children: list[dict[int, int]] = [{}]
    tokens: list[list[int]] = [[]]
    close_count: dict[int, int] = {}
    work = [(j, state, 0) for j in range(first_child[node], first_child[node] + num_children[node])]
    closed: list[tuple[int, int, int]] = []  # (trie node, close-trie node, characters before the quote)
    while work:
        j, state, begun = work.pop()
        if state == start:
            begun += 1
        state = rows[state][node_byte[j]]
        if state == DEAD:
            continue
        if state == close:
            if node_token[j] >= 0:
                tokens[0].append(node_token[j])
                close_count[node_token[j]] = begun - 1
            closed.extend((k, 0, begun - 1) for k in range(first_child[j], first_child[j] + num_children[j]))
            continue
        if node_token[j] >= 0:
            inside.append(node_token[j])
            counts.append(begun)
        work.extend((k, state, begun) for k in range(first_child[j], first_child[j] + num_children[j]))
    while closed:
        j, at, begun = closed.pop()
        byte = node_byte[j]
        nxt = children[at].get(byte)
        if nxt is None:
            nxt = children[at][byte] = len(children)
            children.append({})
            tokens.append([])
        if node_token[j] >= 0:
            tokens[nxt].append(node_token[j])
            close_count[node_token[j]] = begun
        closed.extend((k, nxt, begun) for k in range(first_child[j], first_child[j] + num_children[j]))
    return inside, counts, children, tokens, close_count


def string_lexeme(vocab, state: int | None = None) -> StringLexeme:
    """The vocabulary's StringLexeme from lexer state `state` (the start when None), built by whichever thread
    asks first (all of them by the registry's helper at start, prepare_string_lexemes) and kept."""
    lexer = string_lexer()  # before the lock, which its own first build takes
    if state is None:
        state = lexer.start
    lexemes = getattr(vocab, "_string_lexemes", None)
    lexeme = lexemes.get(state) if lexemes is not None else None
    if lexeme is not None:
        return lexeme
    with BUILD_LOCK:
        lexemes = getattr(vocab, "_string_lexemes", None)
        if lexemes is None:
            lexemes = vocab._string_lexemes = {}
        lexeme = lexemes.get(state)
        if lexeme is None:
            lexeme = lexemes[state] = StringLexeme(vocab, state)
    return lexeme


def prepare_string_lexemes(vocab) -> int:
    """Build the vocabulary's StringLexeme from every lexer state -> the bytes they hold. About 0.25 s of CPU and
    540 KB for Qwen3's vocabulary (36 states: the start's ban list is 5k ids, the others' sets a few thousand at
    most); built ahead, so no request's first mask inside a character or an escape pays for its state's. Then the
    start's sets below the opening quotes tokens begin with (opening_quotes), which a first request's narrow walk
    would read otherwise."""
    lexer = string_lexer()
    nbytes = sum(string_lexeme(vocab, state).nbytes for state in range(1, lexer.num_states) if state != lexer.close)
    start = string_lexeme(vocab)
    for node in opening_quotes(vocab):
        start.subtree(node)
    return nbytes + start.anchored_bytes


def opening_quotes(vocab, max_depth: int = OPENING_QUOTE_MAX_DEPTH) -> list[int]:
    """The trie nodes of a `"` within a token's first `max_depth` bytes that longer tokens go on from (`"`, ` "`,
    `:"`, `("`, `", "`...): where a narrow walk meets a string's opening quote and takes the subtree's sets."""
    node_byte, first_child, num_children, _ = vocab.py_arrays()
    found: list[int] = []
    level = [0]
    for _ in range(max_depth):
        level = [j for node in level for j in range(first_child[node], first_child[node] + num_children[node])]
        found += [j for j in level if node_byte[j] == 0x22 and num_children[j]]
    return found


class LexemeWalk:
    """One grammar's use of the string lexeme: which configurations match it, from which lexer state (kept,
    refusals too) and, for those, the close trie walked from where the quote leads (kept)."""

    def __init__(self, automaton: Automaton, vocab) -> None:
        self.automaton = automaton
        self.vocab = vocab
        # configuration -> (lexer state, the configuration after its string's closing quote), None: no match
        self._matched: dict[int, tuple[int, int] | None] = {}
        # a cut configuration's NFA states (proof_key: its MARK stack, or the top level's empty one, left out) and a
        # lexer state -> a configuration paired with the lexer's start (on either stack), None: no match
        self._proven: dict[tuple[int | tuple[int, ...], int], int | None] = {}
        # close walks: per (lexer state, configuration after the quote), or per (trie node of an opening quote,
        # that configuration) for the anchored sets
        self._closes: dict[tuple[int, int], tuple[array, array]] = {}
        self.cache_bytes = 0
        self.num_proven = 0  # pairings run, apart from the ones kept
        self.num_paired = 0  # ... and of those, the ones that took
        # counted strings: a place's shift key -> (its lowest copy, the fewest copies any configuration of its
        # pairing had to spare, the configuration after the quote), for places proven to move as the lexer's start
        # does with the next character leading one copy on
        self._counted: dict[tuple, tuple[int, int, int]] = {}
        self.num_counted = 0  # configurations matched as a place of a counted string
        self.num_counted_inside = 0  # ... and inside a character or an escape there (_match_inside_counted)
        self.num_counted_proven = 0  # the pairings that took
        self._counted_run: dict[int, int] = {}  # a counted place matched with room -> its run
        # a run's first place -> the pairing of the string's first place (before the run) that led into it: (that
        # place's moves from the lexer's start, lexer state -> configuration paired, the configuration after the
        # quote), which proves the run's first place but its own row (_pair_shifted)
        self._led_into: dict[int, tuple[list[tuple[int, int]], dict[int, int], int]] = {}
        self.num_pairings_shifted = 0  # run's first places proven so
        self.num_below = 0  # subtrees below an opening quote taken from the anchored sets

    def clear(self) -> None:
        self._closes.clear()
        self.cache_bytes = 0

    def match(self, cid: int, inside: bool = True) -> tuple[int, int] | None:
        """(lexer state, the configuration a closing quote leads to) when cid moves, byte for byte, as the string
        lexer does from that state (same bytes alive, runs alike, every configuration inside kind 1, the quote
        closing into that one configuration); else None. Each lexer state pairs with one configuration, so a
        counted string (a new configuration per place) is refused at its second place, then taken by
        _match_counted where it has room for every token.

        When all of cid's threads share one stack, the pairing is proven once for cid cut to no frames
        (pairing_cut), which every string of that rule shares at any depth, provided no configuration inside
        pushes or pops (each keeps the one MARK stack): cid's own configurations inside are then those with the
        MARK frame read as cid's stack (Automaton.restack), and only the quote's step is cid's own. A top-level
        string (the empty stack) is proven on its own configurations so, and kept for the rule's deeper ones. With
        `inside` False a pairing inside a character (_match_inside_counted) is not looked for."""
        if cid in self._matched:
            return self._matched[cid]
        a = self.automaton
        lexer = string_lexer()
        stack, cut = pairing_cut(a, cid)
        # The cut's row, not cid's: the cut is shared by the strings of its rule at every depth and expanded
        # once, where cid's own row would intern a dozen configurations per string (what a walk below an opening
        # quote asks) that nothing else reads. A pairing proven on the cut holds for cid's bytes but the quote,
        # which is stepped from cid's own configuration below.
        # Most configurations asked (a number's, a key's, an enum's, a value's first byte) cannot match: their edges
        # cover no lexer state's alive bytes, which every byte a configuration takes is among. Refused from the edges,
        # their rows stay unbuilt where a narrow walk steps a few bytes (a cut's row nothing else reads, or one
        # reached below an opening quote): nested20's first pass interns 1,622 configurations, not 1,663 (its CPU
        # the same within the box's noise).
        if a.next_byte[cut][0] < 0 and not lexer.may_pair(a.edge_bytes(cut)):
            self._matched[cid] = None
            return None
        # A counted string's place whose shift a kept pairing proves is taken by _match_counted without its row: the
        # lexer's start alone has its alive bytes, and it fails the start's own pairing below (a character leads a
        # copy on), so that is where it would end. Its row interned ten or so configurations (one per class of
        # bytes) that nothing else reads, most of each such place's first mask (nested20's names and gift message).
        if a.shift_key(cid) in self._counted:
            close = self._match_counted(cid)
            if close is not None:
                self.num_counted += 1
                result = self._matched[cid] = (lexer.start, close)
                return result
        row = a.expand(cut)
        result = None
        alike = lexer.by_alive.get(a.alive_runs(cut), ())
        if stack >= 0 and len(alike) > 1:  # a state a kept pairing proved for the cut first (_match)
            proven, states = self._proven, proof_key(a, cut)
            alike = sorted(alike, key=lambda state: proven.get((states, state)) is None)
        # A place of a counted string (in a repeat run) never pairs so: a character leads it a copy on, where the
        # pairing wants the place itself. Inside a 4-byte emoji nested20's gift message failed 14 such pairings.
        for state in (() if a.shift_key(cid)[1] >= 0 else alike):
            if not self._moves_like(cut, row, state):
                continue
            if stack < 0 or (stack and cut == cid):  # threads on several stacks, or no stack cut: cid's own
                proven = self._match(cid, state, False)
                if proven is not None:
                    result = (state, proven[1])
            else:
                # kept by the cut's states: a top-level string and the rule's deeper ones (on stacks, cut to MARK's)
                # are proven once for both (json_object paired its key and value rules at the top level and again
                # below, 25 configurations each)
                key = (proof_key(a, cut), state)
                if key not in self._proven:
                    proven = self._match(cut, state, True)
                    self._proven[key] = None if proven is None else proven[0]
                boundary = self._proven[key]
                if boundary is not None:
                    quote = lexer.close_bytes
                    closes = a.step_some(a.restack(boundary, stack), quote)
                    if all(closes[b] == closes[quote[0]] for b in quote):
                        result = (state, closes[quote[0]])
            if result is not None:
                break
        if result is None and lexer.start in alike:
            close = self._match_counted(cid)
            if close is not None:
                result = (lexer.start, close)
                self.num_counted += 1
        elif result is None:
            # a character's end asks (_match_inside_counted): only a pairing with the start serves it; not kept, as
            # cid's own ask may still pair inside a character
            if not inside:
                return None
            for state in alike:
                close = self._match_inside_counted(cid, state)
                if close is not None:
                    result = (state, close)
                    self.num_counted_inside += 1
                    break
        self._matched[cid] = result
        return result

    def _match_inside_counted(self, cid: int, state: int) -> int | None:
        """The configuration after the closing quote when cid is inside a character or an escape (lexer state
        `state`, not the start) of a counted string's place that the lexeme takes (match: with room for every token):
        the character's rest leads, run of bytes by run, as the lexer's does to one configuration at the next
        character boundary, matched there. Else None. A token from cid ends its character, then moves as from that
        boundary, so its mask is the lexeme's from `state`. Why: inside a 4-byte emoji, nested20's gift message
        (maxLength 200) refused every pairing and took the wide plain walk, two of each round's largest cold masks."""
        lexer = string_lexer()
        walked = self._pair(cid, state, (lexer.start, lexer.close))  # an escape's quote leads to the start
        if walked is None or lexer.close in walked[1] or lexer.start not in walked[1]:
            return None
        # not inside a character again: a chain of such pairings (`[\x80-\xbf]{3000}`) would recurse once a byte
        matched = self.match(walked[1][lexer.start], inside=False)
        return matched[1] if matched is not None and matched[0] == lexer.start else None

    def _match_counted(self, cid: int) -> int | None:
        """The configuration after the closing quote, when cid is a place of a counted string (maxLength: a run
        of alike copies of one character, CompiledGrammar.repeats) with room for every token: then each token
        moves from cid as from the lexer's start, and its mask is the lexeme's, uncounted. Else None.

        Proven on one place: its pairing with the lexer (pair_counted) where a character leads one copy on and
        the quote to one configuration outside the run; every place with the same shift key steps as that one,
        a copy apart, while its configurations have SHIFT_SPARE copies to spare (Automaton.shift_next), so a
        place whose pairing spares SHIFT_SPARE + the vocabulary's longest token (a byte begins at most one
        character) moves as the lexer does through any token. The string's first place (its threads before the
        run) is proven by its own pairing, into the second place proven so."""
        a = self.automaton
        room = SHIFT_SPARE + string_lexeme(self.vocab).max_chars
        run = a.shift_key(cid)[1]
        if run >= 0:
            # a pairing spares no more than its place does: the near end of a run is refused without one
            if a.spare_in(cid, run) < room:
                return None
            proven = self.counted_place(cid, run)
            if isinstance(proven, tuple):
                if proven[0] < room:
                    return None
                self._counted_run[cid] = run
                return proven[1]
        elif run == -1:  # the string's first place, before the run, if a character (`a`) leads into one
            second = a.expand(cid)[0x61]
            nxt_run = a.shift_key(second)[1]
            if nxt_run < 0 or a.spare_in(second, nxt_run) < room:
                return None
            proven = self.pair_counted(cid)
        else:
            return None
        if proven is None:
            return None
        step, close = proven[0], proven[1]  # a place whose pairing leads into the next place, proven so
        run = a.shift_key(step)[1]
        proven = self.counted_place(step, run) if run >= 0 else None
        if not isinstance(proven, tuple) or proven[0] < room or proven[1] != close:
            return None
        return close

    def advance_counted(self, cid: int, data: bytes) -> int | None:
        """Where a token that stays inside the string (its bytes `data`) leads from cid, a counted place matched
        with room (_match_counted): the place as many copies on as the token has characters, made by shifting,
        without stepping its bytes through configurations no walk expanded. None for any other configuration,
        or a token that closes the string or ends inside a character."""
        run = self._counted_run.get(cid)
        if run is None:
            return None
        lexer = string_lexer()
        rows, start = lexer.rows, lexer.start
        state, num_chars = start, 0
        for byte in data:
            state = rows[state][byte]
            if state == start:
                num_chars += 1
            elif state == DEAD or state == lexer.close:
                return None
        if state != start:
            return None
        return self.automaton.shift_by(cid, run, num_chars)

    def counted_place(self, cid: int, run: int) -> tuple[int, int] | list[int] | None:
        """(the fewest copies its pairing spares, the configuration after the quote) for a place that moves as
        the lexer's start with a character leading to itself one copy on, proven on it or on a place with its
        shift key. [the configuration a character leads to, the one after the quote] when cid pairs with the
        lexer's start but a character leads elsewhere (the string's first place); None if cid does not pair.
        counted_tail.CountedTail.left steps along a chain of places with it."""
        a = self.automaton
        key = a.shift_key(cid)
        low = a.shift_low(cid)
        kept = self._counted.get(key)
        if kept is None:
            led = self._led_into.pop(cid, None)
            shifted = None if led is None else self._pair_shifted(cid, run, *led)
            if shifted is not None:
                step, close, spare = shifted
            else:
                paired = self.pair_counted(cid)
                if paired is None:
                    return None
                step, close, configs = paired
                if step != a.shift_by(cid, run, 1):
                    return [step, close]
                spare = min(a.spare_in(g, run) for g in configs)
            if spare < SHIFT_SPARE or a.in_run(close, run):
                return None
            kept = self._counted[key] = (low, spare, close)
        low0, spare0, close = kept
        return spare0 - (low - low0), close

    def pair_counted(self, cid: int) -> tuple[int, int, list[int]] | None:
        """cid paired with the lexer's start as _match pairs them, but for a character's end, which may lead to
        one other configuration (the next place): (that configuration, the one after the closing quote, the
        configurations paired), or None. counted_tail pairs a run's last places and a string's first with it."""
        self.num_counted_proven += 1
        lexer = string_lexer()
        a = self.automaton
        walked = self._pair(cid, lexer.start, (lexer.start, lexer.close))  # a character ends: every one at one place
        if walked is None:
            return None
        paired, reached, first_moves = walked
        step, close = reached.get(lexer.start, DEAD), reached.get(lexer.close, DEAD)
        if close == DEAD or step == DEAD or a.kind[step] != 1:
            return None
        if a.shift_key(cid)[1] == -1 and a.shift_key(step)[1] >= 0:  # a string's first place, into its run
            self._led_into[step] = (first_moves, paired, close)
        return step, close, list(paired.values())

    def _pair_shifted(self, cid: int, run: int, first_moves: list[tuple[int, int]], paired: dict[int, int],
                      close: int) -> tuple[int, int, int] | None:
        """(the configuration a character leads to, the one after the quote, the fewest copies the pairing spares)
        for cid, a run's first place that the pairing of the string's first place (before the run: its moves from
        the lexer's start `first_moves`, its configurations by lexer state `paired`) led into, or None (pair it
        then). That pairing's configurations inside a character are in copy 0, each a copy before cid's own (a
        character ends at its copy's end, where cid is): with every thread in the run and a copy to spare once
        moved on, each steps as its shift a copy on (Automaton.spare_in), so cid's pairing is first's moved a
        copy on, but for cid's own row, which is read (the first place's is the run's entry, outside it) and must
        lead where the first place's moved on does. nested20's largest cold mask paired both."""
        a = self.automaton
        lexer = string_lexer()
        step = a.shift_by(cid, run, 1)
        if step is None or a.kind[cid] != 1:
            return None
        spare = a.spare_in(cid, run)
        for state, g in paired.items():
            if state == lexer.start:  # the first place itself
                continue
            if not a.only_in_run(g, run):
                return None
            spare = min(spare, a.spare_in(g, run) - 1)
        if spare < 1:
            return None
        moves = _config_moves(a, cid, lexer.start)
        if moves is None or len(moves) != len(first_moves):
            return None
        for (nxt, nxt_state), (was, was_state) in zip(moves, first_moves):
            if nxt_state != was_state:
                return None
            if nxt_state == lexer.close:
                if nxt != close:
                    return None
            elif nxt_state == lexer.start:  # a one-byte character: the first place's into cid, cid's one on
                if was != cid or nxt != step:
                    return None
            elif nxt != a.shift_by(was, run, 1):  # into a character: that configuration a copy on
                return None
        self.num_pairings_shifted += 1
        return step, close, spare

    @staticmethod
    def _moves_like(cid: int, row: list[int], state: int) -> bool:
        """Whether cid's row moves as the lexer state's does at its first byte (runs alike, the same bytes alive,
        back to cid where the state loops to itself): the cheap refusal, before a configuration is cut and its cut
        expanded. A counted string's place fails the last: a plain character leads to the next place."""
        for lo, hi, nxt_state in string_lexer().segments[state]:
            nxt = row[lo]
            if (nxt == DEAD) != (nxt_state == DEAD) or (hi > lo and row[lo:hi + 1].count(nxt) != hi + 1 - lo):
                return False
            if nxt_state == state and nxt != cid:
                return False
        return True

    def _match(self, cid: int, first: int, is_cut: bool) -> tuple[int, int] | None:
        """The pairing of cid with lexer state `first` (see match) -> (the configuration paired with the lexer's
        start, the one after the closing quote); with is_cut, also every configuration inside has its threads on
        the MARK stack alone, in states other than MARK."""
        self.num_proven += 1
        lexer = string_lexer()
        walked = self._pair(cid, first, (lexer.close,), is_cut)  # only the start closes, into one configuration
        if walked is None:
            return None
        boundary, close = walked[0].get(lexer.start), walked[1].get(lexer.close)
        if boundary is None or close is None:
            return None
        self.num_paired += 1
        if is_cut:
            # Every configuration paired inside is a cut too (on the same stack), and its own pairing from its lexer
            # state would walk a part of this one, to the same configuration at the start: kept as proven. A place
            # inside a character or an escape (a token that splits `ë`, or ends on `\`) is then matched without
            # walking the pairing again, after a failed one for each other state with its bytes alive (json_object:
            # ~18 failed and 2 whole pairings, a round).
            a, proven = self.automaton, self._proven
            for state, g in walked[0].items():
                proven.setdefault((proof_key(a, g), state), boundary)
        return boundary, close

    def _pair(self, cid: int, first: int, exits: tuple[int, ...], is_cut: bool = False
              ) -> tuple[dict[int, int], dict[int, int], list[tuple[int, int]]] | None:
        """cid's configurations walked beside the string lexer from its state `first`, run of bytes by run: each lexer
        state reached pairs with one configuration, of kind 1, that moves as it does. The states of `exits` are not
        walked on from (but as `first`): each is reached into one configuration. -> (lexer state -> the configuration
        paired, exit state -> the one it leads to, cid's own moves), or None where the configurations do not move
        so. With is_cut, every configuration inside has its threads on cid's one stack alone (MARK's, or the empty
        one at the top level), none popping (into MARK, or the top level's end), too. What every pairing (_match,
        pair_counted, _match_inside_counted) walks; each lexer state pairs once, so the work is bounded by the
        lexer's 36 states."""
        a = self.automaton
        kind = a.kind
        mark, accept, configs = a.mark, a.accept_state, a.configs
        home = next(iter(configs[cid]))[1]  # with is_cut: the MARK stack, or the empty one at the top level
        paired = {first: cid}
        reached: dict[int, int] = {}
        work = [(cid, first)]
        first_moves: list[tuple[int, int]] | None = None
        while work:
            g, state = work.pop()
            if kind[g] != 1:
                return None
            # What reading the MARK frame (or the empty stack) as any stack rests on: no thread pops (into a MARK
            # thread, or the top level's accepting one) or pushes. A MARK thread takes every byte, so the rows refuse
            # it anyway; a push inside would be sound too below the depth cap: both are kept out cheaply.
            if is_cut and any(s == mark or s == accept or sid != home for s, sid in configs[g]):
                return None
            moves = _config_moves(a, g, state)
            if moves is None:
                return None
            if first_moves is None:
                first_moves = moves
            for nxt, nxt_state in moves:
                if nxt_state in exits:
                    if reached.setdefault(nxt_state, nxt) != nxt:
                        return None
                    continue
                known = paired.get(nxt_state)
                if known is None:
                    paired[nxt_state] = nxt
                    work.append((nxt, nxt_state))
                elif known != nxt:
                    return None
        return paired, reached, first_moves

    def walk(self, cid: int) -> tuple[StringLexeme, list[int], list[int]] | None:
        """(the lexeme, certain, uncertain) for a configuration that matches it: the tokens beyond its inside set
        are those whose rest after the closing quote the configuration after it takes (ending alive,
        or only in MARK frames). None when cid does not match."""
        matched = self.match(cid)
        if matched is None:
            return None
        lexeme = string_lexeme(self.vocab, matched[0])
        certain, uncertain = self.close_walk(*matched)
        return lexeme, certain, uncertain

    def close_walk(self, state: int, close: int) -> tuple[array, array]:
        """(certain, uncertain): the tokens of lexer state `state`'s close trie whose rest after the closing quote
        `close`, the configuration there, takes (kept per the two)."""
        key = (state, close)
        kept = self._closes.get(key)
        if kept is None:
            lexeme = string_lexeme(self.vocab, state)
            kept = self._closes[key] = self.walk_close(close, lexeme.close_children, lexeme.close_tokens)
            self.cache_bytes += 200 + 8 * (len(kept[0]) + len(kept[1]))
        return kept

    def walk_below(self, node: int, cid: int, certain: array, uncertain: array) -> bool:
        """Add the tokens below trie node `node` that configuration cid (reached at node) allows, when cid matches
        the lexeme at a character boundary: the anchored inside set, and its close trie walked from where the
        quote leads (kept per node and that configuration). False, adding nothing, when it does not match (or
        past the anchors' cap)."""
        matched = self.match(cid)
        if matched is None or matched[0] != string_lexer().start:
            return False
        key = (-1 - node, matched[1])  # apart from walk's (lexer state, configuration) keys
        kept = self._closes.get(key)
        if kept is None:
            anchored = string_lexeme(self.vocab).anchored(node)
            if anchored is None:
                return False
            inside, children, found = anchored
            walked = self.walk_close(matched[1], children, found)
            kept = self._closes[key] = (array("q", inside) + walked[0], walked[1])
            self.cache_bytes += 200 + 8 * (len(kept[0]) + len(kept[1]))
        certain.extend(kept[0])
        uncertain.extend(kept[1])
        self.num_below += 1
        return True

    def walk_close(self, close: int, children: list[dict[int, int]],
                   found: list[list[int]]) -> tuple[array, array]:
        """The close trie's tokens that `close`, the configuration after the quote, takes: (certain, uncertain).
        Also counted_tail's, over the anchored sets filtered by count."""
        a = self.automaton
        next_byte, kind = a.next_byte, a.kind
        # int64 arrays, kept (_closes) where the collector never walks them: a walk copies them into its own whole
        certain = array("q")
        uncertain = array("q")
        work = [(0, close)]
        while work:
            node, c = work.pop()
            if found[node]:
                (certain if kind[c] == 1 else uncertain).extend(found[node])
            kids = children[node]
            if kids:
                row = next_byte[c]
                if row[0] < 0:
                    row = a.step_some(c, kids)
                for byte, child in kids.items():
                    nxt = row[byte]
                    if nxt != DEAD:
                        work.append((child, nxt))
        return certain, uncertain
