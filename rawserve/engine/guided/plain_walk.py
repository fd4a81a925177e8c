"""The walk of a configuration that plain characters move alike (a JSON string body, a place in a counted
string): its plain tokens taken by character count, and only the tails (the bytes after a token's plain run)
walked, each subtree once per shift key. Core side; reads the automaton and the vocabulary's plain split."""
from __future__ import annotations

import torch

from rawserve.engine.guided.automaton import DEAD, Automaton
from rawserve.engine.guided.token_mask import id_tensor
from rawserve.engine.guided.vocab import PLAIN_MAX_CHARS, VocabIndex

# UTF-8 of one plain character (vocab._PLAIN_CHAR) as an automaton: state -> (lo, hi, next state), 0 the
# boundary between characters. A configuration's plain step is read off its product with this.
_PLAIN_UTF8 = (
    ((0x20, 0x21, 0), (0x23, 0x5B, 0), (0x5D, 0x7F, 0), (0xC2, 0xDF, 1), (0xE0, 0xE0, 2), (0xE1, 0xEC, 3),
     (0xED, 0xED, 4), (0xEE, 0xEF, 3), (0xF0, 0xF0, 5), (0xF1, 0xF3, 6), (0xF4, 0xF4, 7)),
    ((0x80, 0xBF, 0),), ((0xA0, 0xBF, 1),), ((0x80, 0xBF, 1),), ((0x80, 0x9F, 1),), ((0x90, 0xBF, 3),),
    ((0x80, 0xBF, 3),), ((0x80, 0x8F, 3),))
_UNIFORM_NONE = -1  # a configuration that plain characters do not all move alike
_ASCII_PLAIN = frozenset(b for b in range(0x20, 0x80) if b not in (0x22, 0x5C))  # one-byte plain characters
# A tail subtree this big or bigger has its walk kept (per Automaton.shift_key of the configuration at its root);
# smaller ones cost less to walk again than to look up.
SUB_WALK_MEMO_NODES = 8


class PlainWalk:
    """One grammar's plain walks: each configuration's plain step and the kept tail-subtree walks (per
    subtree and shift key), shared by every mask of the grammar. cache_bytes counts the kept walks."""

    def __init__(self, automaton: Automaton, vocab: VocabIndex) -> None:
        self.automaton = automaton
        self.vocab = vocab
        self._plain_steps: dict[int, int] = {}  # configuration -> where every plain character leads
        # (tail subtree, shift key of the configuration at its root) -> plain count -> (certain, uncertain) tokens
        self._sub_walks: dict[tuple, dict[int, tuple[list[int], list[int]]]] = {}
        self.cache_bytes = 0

    def clear(self) -> None:
        """Drop the kept subtree walks (a cache: rebuilt as reached). Plain steps stay: they are a few ints
        per configuration, and the automaton's configurations stay too."""
        self._sub_walks.clear()
        self.cache_bytes = 0

    def _plain_step(self, cid: int) -> int:
        """The configuration every plain character leads to from `cid` (DEAD if none is allowed), or
        _UNIFORM_NONE when they do not all lead to one: read off the product with _PLAIN_UTF8."""
        hit = self._plain_steps.get(cid)
        if hit is not None:
            return hit
        a = self.automaton
        ends: set[int] = set()
        seen = {(cid, 0)}
        work = [(cid, 0)]
        result = None
        while work and result is None:
            c, u = work.pop()
            row = a.expand(c)
            for lo, hi, nu in _PLAIN_UTF8[u]:
                nxt = row[lo]
                if row[lo:hi + 1].count(nxt) != hi + 1 - lo:
                    result = _UNIFORM_NONE  # bytes of one class part ways: not a plain-character loop
                    break
                if nxt == DEAD or nu == 0:
                    ends.add(nxt)
                    if len(ends) > 1:
                        result = _UNIFORM_NONE
                        break
                elif (nxt, nu) not in seen:
                    seen.add((nxt, nu))
                    work.append((nxt, nu))
        if result is None:
            result = ends.pop() if ends else DEAD
        self._plain_steps[cid] = result
        return result

    def _tails_from(self, cid: int, n: int, certain: list[int], uncertain: list[int], prev: int = DEAD) -> None:
        """Add the tokens of n plain characters (every count when n < 0) whose tail the configuration `cid`
        takes, split by whether they end alive (certain) or only in MARK frames (uncertain).

        Each subtree under the root's first byte is walked once per (subtree, the configuration after that byte
        up to a shift along a repeat run, Automaton.shift_key) and kept by count. A counted string's D_n all
        close into one configuration with `"`, and are shifts of each other after an escape's `\\` or a
        character's first byte: one walk of each subtree serves all of them, and the places after, until the
        run nears its end. `prev`, D_{n-1} when there is one: cid's row is then made by shifting prev's
        (Automaton.expand_shifted), which spares the closures of its ten or so successors."""
        split = self.vocab.plain_split()
        a = self.automaton
        row = a.expand_shifted(prev, cid) if prev != DEAD else a.expand(cid)
        shift_key = a.shift_key
        memo = self._sub_walks
        for byte, child in (split.children[0].items() if n < 0 else split.roots_by_count[n]):
            nxt = row[byte]
            if nxt == DEAD:
                continue
            if split.subtree_size[child] < SUB_WALK_MEMO_NODES:
                self._walk_subtree(child, nxt, n, certain, uncertain)
                continue
            threads, run = shift_key(nxt)
            key = (child, threads, run)
            kept = memo.get(key)
            if kept is None:
                groups, low = self._walk_grouped(child, nxt, run)
                kept = memo[key] = (groups, low, a.spare_in(nxt, run) if run >= 0 else 0)
            groups, low, ref_spare = kept
            # Along a run the kept walk holds for this shift of its start only if no configuration of it,
            # shifted, would step from a copy with none to spare (see Automaton.spare_in).
            if run >= 0 and (low < 1 or a.spare_in(nxt, run) < ref_spare - low + 1):
                self._walk_subtree(child, nxt, n, certain, uncertain)
                continue
            if n >= 0:
                hit = groups.get(n)
                if hit is not None:
                    certain.extend(hit[0])
                    uncertain.extend(hit[1])
            else:
                for hit in groups.values():
                    certain.extend(hit[0])
                    uncertain.extend(hit[1])

    def _row(self, cid: int, kids: dict[int, int]) -> list[int] | dict[int, int]:
        """cid's next configurations for the bytes of `kids`: when all are one-byte plain characters and cid's
        plain step is known (a place in a counted string, made by shifting), that step, without expanding
        cid, whose 256 transitions a run of spaces a hundred long would otherwise build at every place; else
        the steps of those bytes alone (Automaton.step_some)."""
        nxt = self._plain_steps.get(cid)
        if nxt is not None and nxt != _UNIFORM_NONE and _ASCII_PLAIN.issuperset(kids):
            return dict.fromkeys(kids, nxt)
        return self.automaton.step_some(cid, kids)

    def _walk_grouped(self, node: int, cid: int, run: int) -> tuple[dict[int, tuple[list[int], list[int]]], int]:
        """The tail trie below `node` (itself included) from `cid`, the configuration at node: its tokens by
        plain-character count -> (certain, uncertain), and the fewest copies of repeat run `run` any
        configuration on the way had to spare. Kept by _tails_from: one walk serves every D_n whose
        configuration after the first byte is a shift of cid's."""
        a = self.automaton
        split = self.vocab.plain_split()
        children, tails = split.children, split.tails
        next_byte, kind, spare_in = a.next_byte, a.kind, a.spare_in
        groups: dict[int, tuple[list[int], list[int]]] = {}
        low = 1 << 30
        num_ids = 0
        work = [(node, cid)]
        while work:
            node, c = work.pop()
            if run >= 0:
                low = min(low, spare_in(c, run))
            found = tails[node]
            if found is not None:
                side = 0 if kind[c] == 1 else 1
                for n, ids in found.items():
                    group = groups.get(n)
                    if group is None:
                        group = groups[n] = ([], [])
                    group[side].extend(ids)
                    num_ids += len(ids)
            kids = children[node]
            if kids:
                row = next_byte[c]
                if row[0] < 0:
                    row = self._row(c, kids)
                for byte, child in kids.items():
                    nxt = row[byte]
                    if nxt != DEAD:
                        work.append((child, nxt))
        self.cache_bytes += 200 + 100 * len(groups) + 8 * num_ids
        return groups, low

    def _walk_subtree(self, node: int, cid: int, n: int, certain: list[int], uncertain: list[int]) -> None:
        """The tail trie below `node` (itself included) from `cid`, the configuration at node: its tokens of n
        plain characters (every count when n < 0), entering only subtrees that hold some."""
        a = self.automaton
        split = self.vocab.plain_split()
        children, tails, below = split.children, split.tails, split.counts_below
        all_tails = split.all_tails
        next_byte, kind = a.next_byte, a.kind
        bit = -1 if n < 0 else 1 << n
        work = [(node, cid)]
        while work:
            node, c = work.pop()
            if tails[node] is not None:
                ids = all_tails[node] if n < 0 else tails[node].get(n)
                if ids:
                    (certain if kind[c] == 1 else uncertain).extend(ids)
            kids = children[node]
            if kids:
                row = next_byte[c]
                if row[0] < 0:
                    row = self._row(c, kids)
                for byte, child in kids.items():
                    if below[child] & bit:
                        nxt = row[byte]
                        if nxt != DEAD:
                            work.append((child, nxt))

    def walk(self, cid: int) -> tuple[int, torch.Tensor, list[int]] | None:
        """The walk of a configuration that plain characters move alike (a string body, or one counted place
        of a maxLength string): D_n, the configuration after n plain characters, for n up to PLAIN_MAX_CHARS;
        then tokens of n plain characters alone by count, and each tail from its D_n. None if any D_n is not
        uniform or pops below the cut (the general walk then)."""
        a = self.automaton
        chain = [cid]
        while len(chain) <= PLAIN_MAX_CHARS:
            last = chain[-1]
            if last == DEAD:
                break
            nxt = self._next_plain(chain[-2], last) if len(chain) > 1 else self._plain_step(last)
            if nxt == _UNIFORM_NONE or a.kind[nxt] == 2:
                return None
            if nxt == last:  # a loop: every later D_n is this one
                break
            chain.append(nxt)
        # D_n = chain[min(n, len - 1)] after a loop or a full chain; after DEAD, D_n is DEAD from there on
        dies = chain[-1] == DEAD
        num_chars = len(chain) - 2 if dies else PLAIN_MAX_CHARS
        certain: list[int] = []
        uncertain: list[int] = []
        long_plain = self.vocab.plain_split().long_plain
        if long_plain and not dies:
            # first, so the tails' walks below step along the chain by its kept plain steps (_row)
            if len(chain) <= PLAIN_MAX_CHARS:  # a loop: D_n is its last configuration for every longer n
                last = chain[-1]
                for ids in long_plain.values():
                    (certain if a.kind[last] == 1 else uncertain).extend(ids)
            else:
                longer = self._extend_chain(chain, max(long_plain))
                if longer is None:
                    return None
                last = len(longer) - 1
                for length, ids in long_plain.items():
                    if length <= last:
                        d = longer[length]
                        if d != DEAD:
                            (certain if a.kind[d] == 1 else uncertain).extend(ids)
                    elif longer[last] != DEAD:  # the chain stopped short of a run's end: token by token
                        self._step_long(longer[last], last, ids, certain, uncertain)
        if len(chain) == 1:  # a loop from the start: every D_n is cid
            self._tails_from(cid, -1, certain, uncertain)
        else:
            for n in range(PLAIN_MAX_CHARS + 1):
                d = chain[min(n, len(chain) - 1)]
                if d == DEAD:
                    break
                self._tails_from(d, n, certain, uncertain, chain[min(n, len(chain) - 1) - 1] if n else DEAD)
        return num_chars, id_tensor(certain), uncertain

    def _extend_chain(self, chain: list[int], length: int) -> list[int] | None:
        """D_0..D_length (stopping at DEAD) from the full chain D_0..D_PLAIN_MAX_CHARS, None if some D_n is not
        uniform. Along a repeat run each D_n is D_{n-1} a copy on (Automaton.shift_next), made without
        stepping; either way each step is kept, so the next place of a counted string looks them up. Where a
        run nears its end the shift stops and so does the chain, short of `length`: a plain step there
        expands the configuration and its half-characters (a dozen closures each, 4 ms of the first place of a
        maxLength-80 string), where the few long tokens that reach past it step just their own bytes."""
        a = self.automaton
        out = list(chain)
        while len(out) <= length and out[-1] != DEAD:
            nxt = self._plain_steps.get(out[-1])
            if nxt is None:
                nxt = a.shift_next(out[-2], out[-1])
                if nxt is None:
                    if a.shift_key(out[-1])[1] >= 0:  # in a run, near its end
                        break
                    nxt = self._plain_step(out[-1])
                else:
                    self._plain_steps[out[-1]] = nxt
            if nxt == _UNIFORM_NONE or a.kind[nxt] == 2:
                return None
            out.append(nxt)
        return out

    def _step_long(self, cid: int, num_chars: int, ids: list[int], certain: list[int], uncertain: list[int]) -> None:
        """Long plain tokens `ids` whose first num_chars characters led to `cid`: each stepped on by its own
        remaining characters."""
        a = self.automaton
        token_bytes = self.vocab.token_bytes
        for token_id in ids:
            nxt = cid
            for byte in token_bytes[token_id].decode("utf-8")[num_chars:].encode("utf-8"):
                nxt = a.step_some(nxt, (byte,))[byte]  # not expand: a run of spaces needs one byte of each row
                if nxt == DEAD:
                    break
            if nxt != DEAD:
                (certain if a.kind[nxt] == 1 else uncertain).append(token_id)

    def _next_plain(self, prev: int, last: int) -> int:
        """_plain_step(last), where `last` is _plain_step(prev): by shifting when last is prev a copy on along
        a repeat run (Automaton.shift_next), which spares the product walk and the expansion of last and of
        its half-characters; kept either way."""
        nxt = self._plain_steps.get(last)
        if nxt is None:
            nxt = self.automaton.shift_next(prev, last)
            if nxt is None:
                return self._plain_step(last)
            self._plain_steps[last] = nxt
        return nxt
