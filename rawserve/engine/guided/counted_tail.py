"""A counted (maxLength) string's last places, where fewer characters are left than the longest token has: the
string lexeme's tokens indexed by how many characters they begin, so a place with r left takes those of at most r
as one slice, and the chain of places to the run's end proven against the lexer once. Core side.
"""
from __future__ import annotations

from array import array

import torch

from rawserve.engine.guided.automaton import DEAD
from rawserve.engine.guided.lexemes import BUILD_LOCK, SHIFT_SPARE, LexemeWalk, string_lexeme, \
    string_lexer, subtree_sets

# _SHIFTED_PAIRING: a place's pairing holds for its shifts along the run while every configuration paired keeps
# one copy to spare. A byte takes a thread at most one copy on, and only the run's last copy differs from the
# others shifted (its end takes no byte), so a configuration with a copy to spare has its row made of its
# unshifted one's moved on a copy, and a pairing is read off rows alone. (Automaton.shift_next asks SHIFT_SPARE
# because it shifts a whole character's steps at once.)
# Places of one chain paired one by one, at most: a run's last two (no copy to spare), a string's first place, and
# every place of a run too short for a kept pairing (under SHIFT_SPARE copies). A minLength's required places pair
# one by one too, and past this they keep their walks rather than one mask paying for them all.
MAX_PAIRED = 2 * SHIFT_SPARE + 2


class CountedTokens:
    """One vocabulary's tokens read from the string lexer's start, by characters begun: `inside_by_count` the
    ids that stay inside the string, duplicates with them, ordered by how many characters they begin (a token
    that ends inside a character or an escape has begun it), `counts` those counts in the same order; and per
    token that closes the string, the characters before its closing quote (`close_count[token]`, -1 for the
    others)."""

    def __init__(self, vocab) -> None:
        lexer = string_lexer()
        table, start, close = lexer.table, lexer.start, lexer.close
        offsets = vocab.level_offsets
        states = torch.zeros(vocab.num_nodes, dtype=torch.int64)
        begun = torch.zeros(vocab.num_nodes, dtype=torch.int64)  # characters begun along the node's bytes
        before_quote = torch.full((vocab.num_nodes,), -1, dtype=torch.int64)  # begun before the closing quote
        states[0] = start
        for d in range(1, len(offsets) - 1):
            lo, hi = offsets[d], offsets[d + 1]
            parents = vocab.flat_parent[lo:hi]
            parent_states = states.index_select(0, parents)
            states[lo:hi] = table[parent_states * 256 + vocab.flat_byte[lo:hi]]
            # a byte read at a character boundary begins a character (the closing quote too: taken off below)
            begun[lo:hi] = begun.index_select(0, parents) + (parent_states == start).long()
            before_quote[lo:hi] = torch.where(states[lo:hi] == close, begun[lo:hi] - 1,
                                              before_quote.index_select(0, parents))
        tokens = vocab.flat_token
        is_token = tokens >= 0
        inside = is_token & (states != DEAD) & (states != close)
        count = torch.full((vocab.vocab_size,), -1, dtype=torch.int64)
        count[tokens[inside]] = begun[inside]
        closing = is_token & (before_quote >= 0)
        close_count = torch.full((vocab.vocab_size,), -1, dtype=torch.int64)
        close_count[tokens[closing]] = before_quote[closing]
        if vocab.dup_ids.numel():
            count[vocab.dup_ids] = count[vocab.dup_canon]
            close_count[vocab.dup_ids] = close_count[vocab.dup_canon]
        self._vocab = vocab
        ids = (count >= 0).nonzero().squeeze(1)
        order = torch.sort(count[ids], stable=True)
        self.inside_by_count = ids[order.indices]
        self.counts = order.values
        self.close_count: list[int] = close_count.tolist()
        self.vocab_size = vocab.vocab_size
        self.nbytes = 16 * int(ids.numel()) + 8 * vocab.vocab_size

    def inside_upto(self, vocab, left: int) -> InsideUpTo:
        """The inside tokens of at most `left` characters, as the shorter list (see InsideUpTo), made when read."""
        return InsideUpTo(self, vocab, left)

    def upto_ids(self, vocab, left: int) -> tuple[torch.Tensor, bool]:
        """(ids, is_ban_list) of inside_upto(vocab, left)."""
        k = int(torch.searchsorted(self.counts, left, right=True))
        if k > self.vocab_size // 2:
            # most tokens: the start's ban list (one, as it has at least these k inside) and the longer inside ones
            return torch.cat((string_lexeme(vocab).ids, self.inside_by_count[k:])), True
        return self.inside_by_count[:k], False

    def anchored(self, node: int) -> tuple[list[int], list[int], list[dict[int, int]], list[list[int]], dict[int, int]]:
        """For the tokens below trie node `node`, read from the lexer's start there: (the ids that stay inside
        the string, the characters each begins, the close trie's children and tokens as StringLexeme.anchored,
        and per close token the characters before its closing quote). The start lexeme's kept subtree walk
        (StringLexeme.subtree), or a walk of its own past that one's cap."""
        hit = string_lexeme(self._vocab).subtree(node)
        if hit is None:
            lexer = string_lexer()
            hit = subtree_sets(self._vocab, lexer, lexer.start, node)
        return hit


class InsideUpTo:
    """What a counted place with few characters left allows inside the string, shaped as a StringLexeme's sets
    for the mask: `ids` the allowed ids (is_ban_list False) or every other id (True), read on first use: a mask
    found in the shared ones (`key`: the characters left) needs neither."""

    __slots__ = ("_counted", "_vocab", "left", "_ids", "_is_ban_list")

    def __init__(self, counted: CountedTokens, vocab, left: int) -> None:
        self._counted, self._vocab, self.left = counted, vocab, left
        self._ids: torch.Tensor | None = None
        self._is_ban_list = False

    @property
    def key(self) -> tuple[str, int]:
        """What names these sets in a shared mask's key (shared_masks)."""
        return ("upto", self.left)

    def _read(self) -> None:
        if self._ids is None:
            self._ids, self._is_ban_list = self._counted.upto_ids(self._vocab, self.left)

    @property
    def ids(self) -> torch.Tensor:
        self._read()
        return self._ids

    @property
    def is_ban_list(self) -> bool:
        self._read()
        return self._is_ban_list


def counted_tokens(vocab) -> CountedTokens:
    """The vocabulary's CountedTokens, built by whichever thread asks first (prepare_string_lexemes at start)."""
    counted = getattr(vocab, "_counted_tokens", None)
    if counted is None:
        string_lexeme(vocab)  # before the lock, which its own first build takes
        with BUILD_LOCK:
            counted = getattr(vocab, "_counted_tokens", None)
            if counted is None:
                counted = vocab._counted_tokens = CountedTokens(vocab)
    return counted


class CountedTail:
    """One grammar's last places of counted strings: per place, how many characters are left and the
    configuration after the closing quote, when the chain of places to the run's end is proven to move as the
    lexer's start does (LexemeWalk's pairings), each character one place on, and the last place to take the
    closing quote alone. Kept per place, refusals too."""

    def __init__(self, walk: LexemeWalk) -> None:
        self.walk = walk  # the grammar's string lexeme use, whose pairings prove the places
        self._left: dict[int, tuple[int, int] | None] = {}  # place -> (characters left, after the quote)
        self.num_proven = 0  # places proven by their own pairing (the run's last few, and first places)
        self.num_walks = 0  # masks of places taken by count
        self.num_below = 0  # subtrees below an opening quote taken so
        self._closes: dict[tuple[int, int], tuple[array, array]] = {}  # (quote node, after it) -> walked
        self.cache_bytes = 0

    def clear(self) -> None:
        """Drop the kept close walks (a cache); the places' counts stay, a few ints each."""
        self._closes.clear()
        self.cache_bytes = 0

    def mask_sets(self, cid: int) -> tuple[InsideUpTo, list[int], list[int]] | None:
        """(the inside tokens, certain, uncertain) for a counted place with fewer characters left than the
        longest token (LexemeWalk.match refuses those): the inside tokens of at most that many characters, and
        the close trie's tokens of at most that many before their quote that the configuration after it takes.
        None for any other configuration."""
        found = self._place(cid)
        if found is None:
            return None
        left, close = found
        lexer = string_lexer()
        vocab = self.walk.vocab
        certain, uncertain = self.walk.close_walk(lexer.start, close)
        counted = counted_tokens(vocab)
        close_count = counted.close_count
        self.num_walks += 1
        return (counted.inside_upto(vocab, left),
                [t for t in certain if close_count[t] <= left],
                [t for t in uncertain if close_count[t] <= left])

    def walk_below(self, node: int, cid: int, certain: array, uncertain: array) -> bool:
        """Add the tokens below trie node `node` (an opening quote) that cid, reached there, allows when it is a
        counted place with few characters left (as mask_sets: by count, from the anchored sets). False, adding
        nothing, for any other configuration."""
        found = self._place(cid)
        if found is None:
            return False
        left, close = found
        inside, counts, children, tokens, close_count = counted_tokens(self.walk.vocab).anchored(node)
        key = (node, close)
        kept = self._closes.get(key)
        if kept is None:
            kept = self._closes[key] = self.walk.walk_close(close, children, tokens)
            self.cache_bytes += 200 + 8 * (len(kept[0]) + len(kept[1]))
        certain.extend([t for t, n in zip(inside, counts) if n <= left])
        certain.extend([t for t in kept[0] if close_count[t] <= left])
        uncertain.extend([t for t in kept[1] if close_count[t] <= left])
        self.num_below += 1
        return True

    def _place(self, cid: int) -> tuple[int, int] | None:
        """left(cid) for a configuration that takes a character as the lexer's start does, else None."""
        if cid in self._left:
            return self._left[cid]
        a = self.walk.automaton
        lexer = string_lexer()
        # refused from its edges when they cover not all the bytes the start takes (its row stays unbuilt: a key's,
        # a number's), else from its row's alive runs
        if a.kind[cid] != 1 or (a.next_byte[cid][0] < 0 and lexer.start_alive & ~a.edge_bytes(cid)) or (
                lexer.start not in lexer.by_alive.get(a.alive_runs(cid), ())):
            self._left[cid] = None
            return None
        return self.left(cid)

    def left(self, cid: int) -> tuple[int, int] | None:
        """(characters left, the configuration after the closing quote) for a counted place, else None.

        A place that pairs with the lexer's start (every byte moving as the lexer's do, characters ending at
        one next place, the quote at one configuration after it) passes a token that begins b characters to the
        place b on, and the last place takes only the quote: a token of at most r characters moves as the lexer
        does from a place r from the end, and one of more dies there. Places that a kept pairing proves a copy
        apart (LexemeWalk.counted_place, every configuration paired with a copy to spare: _SHIFTED_PAIRING) are
        stepped over by shifting; the last two, and a string's first place before its run, are paired one by one."""
        if cid in self._left:
            return self._left[cid]
        walk, a = self.walk, self.walk.automaton
        chain: list[tuple[int, int]] = []  # (place, characters to the next place along the chain)
        seen = {cid}
        result = None
        close = DEAD
        num_paired = 0
        at = cid
        while True:
            known = self._left.get(at, -1) if at != cid else -1
            if known != -1:
                if known is not None and close in (DEAD, known[1]):
                    result = known
                break
            run = a.shift_key(at)[1]
            proven = walk.counted_place(at, run) if run >= 0 else None
            if isinstance(proven, tuple) and proven[0] >= 1:
                if close not in (DEAD, proven[1]):
                    break
                close = proven[1]
                copies = proven[0]  # the places up to the last one the shift proves (_SHIFTED_PAIRING)
                nxt = a.shift_by(at, run, copies)
                if nxt is None:
                    break
                chain.append((at, copies))
                at = nxt
                if at in seen:
                    break
                seen.add(at)
                continue
            if run == -2 or num_paired == MAX_PAIRED:
                break
            num_paired += 1
            self.num_proven += 1
            paired = walk.pair_counted(at)
            if paired is not None:
                if close not in (DEAD, paired[1]):
                    break
                close = paired[1]
                chain.append((at, 1))
                at = paired[0]
                if at in seen:  # a string body with no bound: a character leads back to the place
                    break
                seen.add(at)
                continue
            if close != DEAD and self._is_last(at, close):
                result = (0, close)
            break
        if result is not None:
            self._left[at] = result
            left = result[0]
            for place, copies in reversed(chain):
                left += copies
                self._left[place] = (left, result[1])
            return self._left[cid]
        for place, _ in chain:
            self._left.setdefault(place, None)
        self._left[cid] = None
        return None

    def _is_last(self, cid: int, close: int) -> bool:
        """Whether cid takes the closing quote into `close` and no other byte."""
        a = self.walk.automaton
        if a.kind[cid] != 1:
            return False
        row = a.expand(cid)
        quote = set(string_lexer().close_bytes)
        return all((nxt == close) if b in quote else (nxt == DEAD) for b, nxt in enumerate(row))
