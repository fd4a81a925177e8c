"""KV block bookkeeping: a fixed pool of block ids with reference counts, SHA-256 chained prefix-cache keys
and LRU eviction of freed cached blocks.

It hands out block ids only; the KV tensors belong to the model runner, and who runs when is the scheduler's.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable

# The chain's anchor. Hashes live only in this process's memory, so native byte order is fine.
_ROOT = hashlib.sha256(b"rawserve.prefix-cache.v1").digest()


def extra_key(lora: str | None, cache_salt: str | None) -> bytes:
    """Bytes that separate caches: a LoRA adapter's KV differs from the base model's, and a tenant's salt
    keeps its prompts from being probed through cache timing by another tenant."""
    if lora is None and cache_salt is None:
        return b""
    parts = []
    for value in (lora, cache_salt):
        if value is None:
            parts.append(b"\x00")
        else:
            data = value.encode("utf-8")
            parts.append(b"\x01" + len(data).to_bytes(4, "little") + data)
    return b"".join(parts)


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """SHA-256 over (parent hash, extra keys, token ids): equal keys mean an equal whole prefix."""
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, extra: bytes) -> None:
    """Append the keys of every full block of token_ids that `hashes` does not cover yet.

    Called as tokens arrive, so each block is hashed once over a request's life.
    """
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))


class KVCacheManager:
    """Block ids 0..num_blocks-1. A block is in use (ref_count > 0), free and plain, or free and cached.

    Free cached blocks keep their contents and their key until LRU eviction, so a later request with the
    same prefix can take them back. Allocation prefers plain free blocks and evicts the least recently
    freed cached block only when none is left. Ids in use stay a low prefix of the pool (fresh blocks go out
    lowest first, and `compact` packs what an idle engine keeps), so the pages above it may be given back.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> the block holding that prefix
        self.free_plain: deque[int] = deque(range(num_blocks))  # fresh blocks lowest first (see free)
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first: eviction order
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, tokens found
        # Told each key whose block is evicted: a hybrid model's saved state under that key (StateCacheManager.
        # forget) stands for this block's prefix and goes with it.
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus evictable cached ones."""
        return len(self.free_plain) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, block_hashes: list[bytes], max_blocks: int) -> list[int]:
        """The cached blocks holding the longest prefix of these keys, at most max_blocks of them."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        cached = self.cached
        for key in block_hashes[:max_blocks]:
            block = cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate(self, block_ids: list[int], num_tokens: int, hits: list[int] | None = None) -> bool:
        """Grow block_ids (a request's table) so it covers num_tokens tokens, taking `hits` first.

        All or nothing: False leaves every count untouched.
        """
        num_hits = len(hits) if hits else 0
        num_new = self.blocks_for(num_tokens) - len(block_ids) - num_hits
        if num_new < 0:
            num_new = 0
        # A hit that sits free in the cache leaves the free pool when we take it.
        evictable_hits = sum(1 for b in hits if self.ref_counts[b] == 0) if hits else 0
        if num_new > self.num_free_blocks - evictable_hits:
            return False
        if hits:
            for block in hits:
                if self.ref_counts[block] == 0:
                    del self.free_cached[block]
                self.ref_counts[block] += 1
                block_ids.append(block)
        for _ in range(num_new):
            block = self._pop_free()
            self.ref_counts[block] = 1
            block_ids.append(block)
        return True

    def _pop_free(self) -> int:
        if self.free_plain:
            return self.free_plain.popleft()
        block, _ = self.free_cached.popitem(last=False)
        self._evict(block)
        return block

    def _evict(self, block: int) -> None:
        key = self.block_keys[block]
        del self.cached[key]
        self.block_keys[block] = None
        if self.on_evict is not None:
            self.on_evict(key)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block of a table and empty it.

        Released in reverse, so a sequence's tail (shared by the fewest) is evicted before its head.
        """
        ref_counts = self.ref_counts
        for block in reversed(block_ids):
            count = ref_counts[block] - 1
            assert count >= 0, f"block {block} freed more often than taken"
            ref_counts[block] = count
            if count == 0:
                if self.block_keys[block] is not None:
                    self.free_cached[block] = None
                else:  # reused first: fresh blocks stay untouched (unzeroed, unmapped) while recycled ones do
                    self.free_plain.appendleft(block)
        block_ids.clear()

    def trim(self, block_ids: list[int], num_tokens: int) -> None:
        """Free the blocks of a table past those num_tokens tokens fill (a speculative step's rejected
        positions): they hold no accepted token, so none of them was published."""
        keep = self.blocks_for(num_tokens)
        if len(block_ids) > keep:
            tail = block_ids[keep:]
            del block_ids[keep:]
            self.free(tail)

    def compact(self, keep_cached: int) -> tuple[list[tuple[int, int]], int]:
        """Make room to give pages back: keep the `keep_cached` most recently freed cached blocks (evicting the
        older ones), renumber them onto the lowest ids no request holds, and return (moves, top): the (from, to)
        block copies the KV tensors must make, and the end of the ids still in use (held or cached). Every id
        from `top` up is plain and free afterwards, and fresh blocks are handed out lowest first again, so the
        pages above `top` may be dropped and stay untouched until the pool fills that far.

        Held blocks (ref_count > 0) never move: a running request's table names them.
        """
        evict = max(0, len(self.free_cached) - max(0, keep_cached))
        for _ in range(evict):  # oldest first
            block, _ = self.free_cached.popitem(last=False)
            self._evict(block)
        ref_counts = self.ref_counts
        kept = set(self.free_cached)
        # The lowest ids no request holds, one per kept block: the kept blocks already there stay, the others
        # move into the rest. A target is never above the highest kept block, so it lies in the touched prefix.
        targets = []
        for block in range(self.num_blocks):
            if len(targets) == len(kept):
                break
            if ref_counts[block] == 0:
                targets.append(block)
        target_set = set(targets)
        sources = sorted(b for b in kept if b not in target_set)
        dests = [b for b in targets if b not in kept]
        moves = list(zip(sources, dests))
        if moves:
            renumber = dict(moves)
            keys = self.block_keys
            for src, dst in moves:
                key = keys[src]
                keys[dst], keys[src] = key, None
                self.cached[key] = dst
            self.free_cached = OrderedDict((renumber.get(b, b), None) for b in self.free_cached)  # LRU order kept
        held = [b for b in range(self.num_blocks) if ref_counts[b]]
        top = max((targets[-1] + 1) if targets else 0, (held[-1] + 1) if held else 0)
        kept_now = set(self.free_cached)
        self.free_plain = deque(b for b in range(self.num_blocks) if not ref_counts[b] and b not in kept_now)
        return moves, top

    def publish_full_blocks(self, block_ids: list[int], block_hashes: list[bytes], num_published: int,
                            num_computed_tokens: int) -> int:
        """Publish the blocks of a table that its first num_computed_tokens tokens fill, past the
        num_published already offered. Returns the new count of published leading blocks.

        Called after each forward: a block is published once full and its KV written, never before, so a
        request admitted in the same step cannot read it half-computed.
        """
        num_full = num_computed_tokens // self.block_size
        if num_full <= num_published or not self.enable_prefix_caching:
            return num_published
        self.cache_blocks(block_ids, block_hashes, num_published, num_full)
        return num_full

    def cache_blocks(self, block_ids: list[int], block_hashes: list[bytes], start: int, end: int) -> None:
        """Publish blocks start..end-1 of a table (full, their KV written) under their keys.

        A block already keyed (a hit) stays as it is. When another request published the same prefix
        first, this copy stays plain and is recycled on free; lookups find the first one.
        """
        if not self.enable_prefix_caching:
            return
        keys = self.block_keys
        cached = self.cached
        for i in range(start, end):
            block = block_ids[i]
            if keys[block] is not None:
                continue
            key = block_hashes[i]
            if key not in cached:
                cached[key] = block
                keys[block] = key
