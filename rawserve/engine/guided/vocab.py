"""The vocabulary as a byte trie in level arrays, so one automaton state is walked over every token at once.

Built once per tokenizer (about a second for 150k tokens) and cached on disk by the tokenizer's hash.
Special and added tokens are left out of the trie: a grammar allows them only by naming their id.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import re
import threading
import time
from array import array

import torch

from rawserve.engine.guided.shared_masks import SharedMasks

log = logging.getLogger("rawserve.engine")
# The plain split and the Python arrays are built once, by whichever thread asks first (the registry's helper
# thread at start, or a step that cannot wait for it); the other waits rather than building them again.
_LAZY_LOCK = threading.Lock()

_FORMAT = 1  # bump when the cached layout changes
# A plain character: one whole UTF-8 character that a JSON string may hold unescaped (no `"`, `\\`, control or
# surrogate). Most of a vocabulary is made of them, and a string body takes every one alike.
_PLAIN_CHAR = (rb"[\x20\x21\x23-\x5b\x5d-\x7f]|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]"
               rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}"
               rb"|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2}")
# Plain characters a token's prefix is cut to (longer ones keep the rest as their tail): a chain of counted
# configurations (maxLength) is followed this far, and almost every token is shorter.
PLAIN_MAX_CHARS = 16


class VocabIndex:
    """Level d of the trie holds the nodes of depth d (prefix length d); level 0 is the root alone.

    Nodes of a level are in byte order, so the children of a node are one contiguous run of the next
    level: child_start[d][i] .. child_start[d][i] + child_count[d][i]. node_token[d][i] is the token
    whose bytes end at that node (-1 if none); tokens with the same bytes as another are `dup_ids`,
    allowed exactly when their `dup_canon` is.

    `shared_masks` holds the token masks every grammar on this vocabulary shares by content: made here, with the
    index (and not on the first grammar's first mask), so the mask worker and the step's thread find one object.
    """

    shared_masks: SharedMasks

    def __init__(self, token_bytes: list[bytes], special_ids: set[int], vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the logits width; ids past len(token_bytes) are padding
        self.token_bytes = list(token_bytes) + [b""] * max(0, vocab_size - len(token_bytes))
        self.special_ids = sorted(i for i in special_ids if i < vocab_size)
        self.special_set = frozenset(self.special_ids)
        self.shared_masks = SharedMasks()
        self._build()

    def _build(self) -> None:
        skip = set(self.special_ids)
        items = sorted((b, i) for i, b in enumerate(self.token_bytes) if b and i not in skip)
        parents: list[list[int]] = [[-1]]
        bytes_: list[list[int]] = [[0]]
        tokens: list[list[int]] = [[-1]]
        path = [0]  # node index at each depth along the previous token
        prev = b""
        dups, canon = [], []
        for data, token_id in items:
            if data == prev:
                dups.append(token_id)
                canon.append(tokens[len(data)][path[len(data)]])
                continue
            common = 0
            limit = min(len(data), len(prev))
            while common < limit and data[common] == prev[common]:
                common += 1
            del path[common + 1:]
            for depth in range(common + 1, len(data) + 1):
                if depth == len(parents):
                    parents.append([])
                    bytes_.append([])
                    tokens.append([])
                parents[depth].append(path[depth - 1])
                bytes_[depth].append(data[depth - 1])
                tokens[depth].append(-1)
                path.append(len(parents[depth]) - 1)
            tokens[len(data)][path[len(data)]] = token_id
            prev = data
        self.node_byte = [torch.tensor(b, dtype=torch.int64) for b in bytes_]
        self.node_token = [torch.tensor(t, dtype=torch.int64) for t in tokens]
        self.child_start, self.child_count = [], []
        for d in range(len(parents)):
            n = len(parents[d])
            if d + 1 < len(parents):
                nxt = torch.tensor(parents[d + 1], dtype=torch.int64)
                start = torch.searchsorted(nxt, torch.arange(n + 1))
            else:
                start = torch.zeros(n + 1, dtype=torch.int64)
            self.child_start.append(start[:-1].contiguous())
            self.child_count.append((start[1:] - start[:-1]).contiguous())
        self.dup_ids = torch.tensor(dups, dtype=torch.int64)
        self.dup_canon = torch.tensor(canon, dtype=torch.int64)
        self.num_nodes = sum(len(p) for p in parents)
        self._flatten()

    def _flatten(self) -> None:
        """All levels in one array each (node i of level d at level_offsets[d] + i), for the dense walk:
        flat_parent is the parent's index in the same numbering (the root's is 0)."""
        offsets = [0]
        for level in self.node_byte:
            offsets.append(offsets[-1] + level.numel())
        parents = [torch.zeros(1, dtype=torch.int64)]
        for d in range(len(self.node_byte) - 1):
            local = torch.repeat_interleave(torch.arange(self.node_byte[d].numel()), self.child_count[d])
            parents.append(local + offsets[d])
        self.level_offsets = offsets
        self.flat_parent = torch.cat(parents)
        self.flat_byte = torch.cat(self.node_byte)
        self.flat_token = torch.cat(self.node_token)

    def py_arrays(self) -> tuple[bytes, array, array, array]:
        """(byte, first child, child count, token) per node in the flat numbering, as a bytes and int32 arrays read
        from Python: a walk in Python over a few alive nodes costs microseconds where each tensor op costs several.

        Compact, not lists: a narrow walk reads a few nodes, scattered over the trie, per mask, and between masks
        the step writes a logits row (600 KB) that evicts them. Lists of 333k ints (a pointer and a 32-byte int
        object per item) put those reads out of cache; 4 bytes an item (1 for the byte) made nested20's first pass
        with a row written between masks 6-9% cheaper, the same without one."""
        arrays = getattr(self, "_py", None)
        if arrays is not None:
            return arrays
        with _LAZY_LOCK:
            arrays = getattr(self, "_py", None)
            if arrays is not None:
                return arrays
            offsets = self.level_offsets
            first = [start + offsets[d + 1] for d, start in enumerate(self.child_start)]
            arrays = (_raw_bytes(self.flat_byte.to(torch.uint8)), _int32s(torch.cat(first)),
                      _int32s(torch.cat(self.child_count)), _int32s(self.flat_token))
            self._py = arrays
        return arrays

    def dups_of(self) -> dict[int, list[int]]:
        """canonical id -> the ids with the same bytes (most vocabularies have none)."""
        dups = getattr(self, "_dups", None)
        if dups is None:
            dups = {}
            for dup, canon in zip(self.dup_ids.tolist(), self.dup_canon.tolist()):
                dups.setdefault(canon, []).append(dup)
            self._dups = dups
        return dups

    def plain_split(self) -> PlainSplit:
        """The vocabulary split into plain-character prefixes and tails (built once, about a second)."""
        split = getattr(self, "_plain", None)
        if split is not None:
            return split
        with _LAZY_LOCK:
            split = getattr(self, "_plain", None)
            if split is None:
                split = self._plain = PlainSplit(self)
        return split

    # ----- disk cache

    def state_dict(self) -> dict:
        lengths = torch.tensor([len(b) for b in self.token_bytes], dtype=torch.int64)
        blob = torch.tensor(list(b"".join(self.token_bytes)), dtype=torch.uint8)
        return {"format": _FORMAT, "vocab_size": self.vocab_size, "token_lengths": lengths, "token_blob": blob,
                "special_ids": self.special_ids, "node_byte": self.node_byte, "node_token": self.node_token,
                "child_start": self.child_start, "child_count": self.child_count, "dup_ids": self.dup_ids,
                "dup_canon": self.dup_canon, "num_nodes": self.num_nodes}

    @classmethod
    def from_state_dict(cls, state: dict) -> VocabIndex:
        self = cls.__new__(cls)
        raw = bytes(state["token_blob"].tolist())
        ends = state["token_lengths"].cumsum(0).tolist()
        self.token_bytes = [raw[a:b] for a, b in zip([0] + ends[:-1], ends)]
        for name in ("vocab_size", "special_ids", "node_byte", "node_token", "child_start",
                     "child_count", "dup_ids", "dup_canon", "num_nodes"):
            setattr(self, name, state[name])
        self.special_set = frozenset(self.special_ids)
        self.shared_masks = SharedMasks()
        self._flatten()
        return self


class PlainSplit:
    """Every token as P + R: P its longest prefix of at most PLAIN_MAX_CHARS plain characters, R the rest.

    A configuration that every plain character moves alike (a JSON string body, counted or not) then needs no
    walk over P: tokens with an empty R are allowed by their character count alone (`by_chars`, a prefix of
    token ids sorted by count), and only the distinct tails R, a small trie, are walked. Tokens that are
    longer runs of plain characters alone are kept by count apart (`long_plain`).
    """

    def __init__(self, vocab: VocabIndex) -> None:
        char = re.compile(_PLAIN_CHAR)
        prefix = re.compile(rb"(?:" + _PLAIN_CHAR + rb"){0,%d}" % PLAIN_MAX_CHARS)
        skip = vocab.special_set
        counted: list[tuple[int, int]] = []  # (chars, token) of tokens that are P alone
        every_plain = re.compile(rb"(?:" + _PLAIN_CHAR + rb")*")
        # tokens of more than PLAIN_MAX_CHARS plain characters and nothing else (runs of spaces, dashes, `=`),
        # by count: in the tails' trie they made walks a hundred bytes deep into a counted string
        self.long_plain: dict[int, list[int]] = {}
        # the tails' trie: children[node] byte -> node; tails[node] chars of P -> token ids ending there
        self.children: list[dict[int, int]] = [{}]
        self.tails: list[dict[int, list[int]] | None] = [None]
        for token_id, data in enumerate(vocab.token_bytes):
            if not data or token_id in skip:
                continue
            head = prefix.match(data).end()
            num_chars = len(char.findall(data, 0, head)) if head else 0
            if head == len(data):
                counted.append((num_chars, token_id))
                continue
            if num_chars == PLAIN_MAX_CHARS and every_plain.fullmatch(data):
                self.long_plain.setdefault(len(char.findall(data)), []).append(token_id)
                continue
            node = 0
            for byte in data[head:]:
                nxt = self.children[node].get(byte)
                if nxt is None:
                    nxt = self.children[node][byte] = len(self.children)
                    self.children.append({})
                    self.tails.append(None)
                node = nxt
            groups = self.tails[node]
            if groups is None:
                groups = self.tails[node] = {}
            groups.setdefault(num_chars, []).append(token_id)
        counted.sort()
        self.by_chars = torch.tensor([t for _, t in counted], dtype=torch.int64)
        # num_upto[n]: tokens of at most n plain characters (P alone), a prefix of by_chars
        self.num_upto = [0] * (PLAIN_MAX_CHARS + 1)
        for n, _ in counted:
            self.num_upto[n] += 1
        for n in range(1, PLAIN_MAX_CHARS + 1):
            self.num_upto[n] += self.num_upto[n - 1]
        self.all_tails = [None if g is None else [t for ids in g.values() for t in ids] for g in self.tails]
        # counts_below[node]: bit n set when a token of n plain characters has its tail in node's subtree. A
        # counted string's walk from D_n only enters subtrees with bit n (children are numbered after parents).
        below = [0] * len(self.children)
        for node in range(len(self.children) - 1, -1, -1):
            bits = 0
            for n in self.tails[node] or ():
                bits |= 1 << n
            for child in self.children[node].values():
                bits |= below[child]
            below[node] = bits
        self.counts_below = below
        # the root's (byte, child) pairs whose subtree holds a tail of n plain characters, per n
        self.roots_by_count = [[(b, c) for b, c in self.children[0].items() if below[c] >> n & 1]
                               for n in range(PLAIN_MAX_CHARS + 1)]
        # per node: its subtree's node count, and the most bytes a walk goes below it
        self.subtree_size = [1] * len(self.children)
        self.height = [0] * len(self.children)
        for node in range(len(self.children) - 1, 0, -1):
            for child in self.children[node].values():
                self.subtree_size[node] += self.subtree_size[child]
                self.height[node] = max(self.height[node], 1 + self.height[child])
        self._masks: dict[int, torch.Tensor] = {}
        self.vocab_size = vocab.vocab_size

    def mask_upto(self, n: int) -> torch.Tensor:
        """[V] bool: the tokens that are 1..n plain characters and nothing else (kept per n, 150 KB each)."""
        mask = self._masks.get(n)
        if mask is None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[self.by_chars[:self.num_upto[n]]] = True
            self._masks[n] = mask
        return mask


def _raw_bytes(values: torch.Tensor) -> bytes:
    """A CPU tensor's values as their bytes, copied in one go (numpy is not a dependency, and bytes() of its
    storage reads item by item: 4 s for 333k ints)."""
    values = values.contiguous().cpu()  # (a device pointer would be read as a host one)
    return ctypes.string_at(values.data_ptr(), values.numel() * values.element_size())


def _int32s(values: torch.Tensor) -> array:
    """An int tensor's values as an int32 array (through their bytes, not a list of Python ints)."""
    out = array("i")
    out.frombytes(_raw_bytes(values.to(torch.int32)))
    return out


def _cache_path(model_dir: pathlib.Path, key: str) -> list[pathlib.Path]:
    """Next to the model if that folder is writable, else the user's cache folder."""
    name = f".rawserve-vocab-{key}.pt"
    home = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "rawserve"
    return [model_dir / name, home / name]


def _cache_key(model_dir: pathlib.Path, vocab_size: int) -> str:
    digest = hashlib.sha256(f"{_FORMAT}:{vocab_size}:".encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = model_dir / name
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def is_vocab_index_cached(model_dir: str | os.PathLike, vocab_size: int) -> bool:
    """Whether load_vocab_index would read its disk cache (tens of ms) rather than build (seconds)."""
    model_dir = pathlib.Path(model_dir)
    return any(path.exists() for path in _cache_path(model_dir, _cache_key(model_dir, vocab_size)))


def load_vocab_index(model_dir: str | os.PathLike, vocab_size: int) -> VocabIndex:
    """The model's VocabIndex, from the disk cache when the tokenizer is unchanged."""
    model_dir = pathlib.Path(model_dir)
    key = _cache_key(model_dir, vocab_size)
    candidates = _cache_path(model_dir, key)
    for path in candidates:
        if path.exists():
            try:
                state = torch.load(path, weights_only=True)
                if state.get("format") == _FORMAT:
                    return VocabIndex.from_state_dict(state)
            except (OSError, RuntimeError, ValueError, EOFError) as error:  # a torn or foreign file: rebuild
                log.warning("ignoring vocabulary cache %s: %s", path, error)
    # The core loads text (tokenizers, jinja2) only to build the index, not to read it from the cache.
    from rawserve.text.tokenizer import Tokenizer

    began = time.perf_counter()
    tok = Tokenizer.from_dir(model_dir)
    index = VocabIndex(tok.vocab_bytes(), set(tok.added_token_ids), vocab_size)
    log.info("guided decoding: vocabulary index of %d tokens, %d trie nodes in %.2f s", len(tok.vocab_bytes()),
             index.num_nodes, time.perf_counter() - began)
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(index.state_dict(), tmp)
            os.replace(tmp, path)
            break
        except OSError:
            continue
    return index
