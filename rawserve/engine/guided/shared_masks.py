"""Token masks shared by every grammar on one vocabulary, found by what they allow: a mask is a function of its
allowed set alone, whichever grammar or configuration reached it. Core side; bounded, least recently used dropped.
Owned by the VocabIndex (`VocabIndex.shared_masks`), made with it, so no thread races to make it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from rawserve.engine.guided.token_mask import TokenMask

# What one vocabulary's shared masks may hold, ids and keys: a string body's mask is a ban list of ~5k ids (40 KB)
# on Qwen3's vocabulary, a key's or a digit's a few ids. Past it the least recently used go.
MAX_SHARED_MASK_BYTES = 32 << 20
# Per entry beyond its ids and key: the TokenMask, its tensor, the dict and LRU links.
ENTRY_OVERHEAD_BYTES = 400


class SharedMasks:
    """Masks by content, for every GrammarRuntime of one vocabulary (`VocabIndex.shared_masks`). A key names the
    whole allowed set (and the device, and whether the configuration accepts): a narrow mask's ids (a frozenset), or a
    string lexeme's sets (its lexer state, or a counted place's characters left) with the ids its walk allowed beside
    them.

    Why: one output's string places, and every schema's, end in a handful of such sets (nested20's first pass made
    328 masks, 120 of them distinct; a later schema with its keys renamed, 6 new lexeme ones of 35), and a string's
    mask costs a [V] pass (0.15 ms) to make. The mask worker and the step's thread build masks of different grammars
    at once: one lock around the map; a mask is made outside it, and the first one kept wins (`put`)."""

    def __init__(self, max_bytes: int = MAX_SHARED_MASK_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._masks: OrderedDict[tuple, tuple[TokenMask, int]] = OrderedDict()
        self.nbytes = 0
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self._masks)

    def get(self, key: tuple) -> TokenMask | None:
        with self._lock:
            hit = self._masks.get(key)
            if hit is None:
                self.num_misses += 1
                return None
            self._masks.move_to_end(key)
            self.num_hits += 1
            return hit[0]

    def put(self, key: tuple, mask: TokenMask, key_bytes: int) -> TokenMask:
        """Keep `mask` under `key` (whose ids take key_bytes) -> the mask kept: another thread's, when it put one
        first, so equal masks stay one object."""
        nbytes = mask.nbytes + key_bytes + ENTRY_OVERHEAD_BYTES
        if nbytes > self.max_bytes:
            return mask
        with self._lock:
            kept = self._masks.get(key)
            if kept is not None:
                return kept[0]
            self._masks[key] = (mask, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, (_, dropped) = self._masks.popitem(last=False)
                self.nbytes -= dropped
        return mask

    def clear(self) -> None:
        with self._lock:
            self._masks.clear()
            self.nbytes = 0
