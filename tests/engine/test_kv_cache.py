"""KV block manager: reference counts, chained SHA-256 prefix keys, sharing, LRU eviction, all-or-nothing."""
from __future__ import annotations

import hashlib

import pytest

from rawserve.engine.kv_cache import KVCacheManager, extend_block_hashes, extra_key, hash_block


def keys(tokens, block_size=4, extra=b""):
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, extra)
    return out


def test_block_key_is_sha256_chained_over_parent_tokens_and_extras():
    first = hash_block(None, [1, 2, 3, 4])
    second = hash_block(first, [5, 6, 7, 8])
    assert len(first) == hashlib.sha256().digest_size
    # Same tokens under a different parent, or with an extra key, give a different key.
    assert hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != second
    assert hash_block(None, [1, 2, 3, 4], extra_key(None, "tenant-a")) != first
    assert hash_block(None, [1, 2, 3, 4], extra_key("adapter", None)) != first
    assert extra_key("a", None) != extra_key(None, "a")  # the lora name and the salt cannot alias


def test_only_full_blocks_get_keys_and_extension_is_incremental():
    tokens = list(range(10))
    hashes = keys(tokens)
    assert len(hashes) == 2  # 10 tokens, blocks of 4: two full blocks
    tokens += [10, 11]
    before = list(hashes)
    extend_block_hashes(hashes, tokens, 4, b"")
    assert hashes[:2] == before and len(hashes) == 3
    assert hashes == keys(tokens)


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    table: list[int] = []
    assert kv.allocate(table, 9)  # 3 blocks
    assert len(table) == 3 and kv.num_free_blocks == 5
    assert kv.allocate(table, 12)  # still 3 blocks
    assert len(table) == 3
    assert kv.allocate(table, 13)
    assert len(table) == 4 and kv.usage == pytest.approx(0.5)
    kv.free(table)
    assert table == [] and kv.num_free_blocks == 8 and kv.ref_counts == [0] * 8


def test_allocation_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a: list[int] = []
    assert kv.allocate(a, 12)
    b: list[int] = []
    assert not kv.allocate(b, 8)  # needs 2, 1 free
    assert b == [] and kv.num_free_blocks == 1


def test_published_prefix_is_found_and_shared_with_reference_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    hashes = keys(tokens)
    a: list[int] = []
    assert kv.allocate(a, 12)
    kv.cache_blocks(a, hashes, 0, 3)
    hits = kv.lookup(keys(tokens + [99]), max_blocks=3)
    assert hits == a
    b: list[int] = []
    assert kv.allocate(b, 13, hits)
    assert b[:3] == a and len(b) == 4
    assert [kv.ref_counts[x] for x in a] == [2, 2, 2]
    kv.free(a)
    assert [kv.ref_counts[x] for x in b[:3]] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_lookup_stops_at_first_miss_and_respects_max_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    a: list[int] = []
    kv.allocate(a, 12)
    kv.cache_blocks(a, keys(tokens), 0, 3)
    other = list(range(4)) + [50, 51, 52, 53] + list(range(8, 12))
    assert kv.lookup(keys(other), 3) == a[:1]  # the chain breaks at block 1, so block 2 cannot match
    assert kv.lookup(keys(tokens), 2) == a[:2]


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old: list[int] = []
    kv.allocate(old, 4)
    old_keys = keys([1, 2, 3, 4], 2)
    kv.cache_blocks(old, old_keys, 0, 2)
    kept = list(old)
    kv.free(old)
    assert kv.num_free_blocks == 4  # cached-free blocks count as free (evictable)
    assert kv.lookup(old_keys, 2) == kept  # still there after free
    # Taking the two plain blocks evicts nothing.
    c: list[int] = []
    kv.allocate(c, 4)
    assert kv.lookup(old_keys, 2) == kept
    # A third block must evict; the tail block (freed first) goes before the head.
    d: list[int] = []
    kv.allocate(d, 2)
    assert d == [kept[1]]
    assert kv.lookup(old_keys, 2) == kept[:1]


def test_hit_on_a_free_cached_block_is_not_counted_as_free_room():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a: list[int] = []
    kv.allocate(a, 6)
    hashes = keys([1, 2, 3, 4, 5, 6], 2)
    kv.cache_blocks(a, hashes, 0, 3)
    kv.free(a)
    hits = kv.lookup(hashes, 2)
    assert len(hits) == 2
    b: list[int] = []
    # 2 hit blocks + 2 new ones: only 1 block is left once the hits are taken.
    assert not kv.allocate(b, 8, hits)
    assert b == [] and kv.num_free_blocks == 3
    assert kv.allocate(b, 6, hits)
    assert b[:2] == hits


def test_different_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    a: list[int] = []
    kv.allocate(a, 8)
    kv.cache_blocks(a, keys(tokens, extra=extra_key(None, "alice")), 0, 2)
    assert kv.lookup(keys(tokens, extra=extra_key(None, "bob")), 2) == []
    assert kv.lookup(keys(tokens), 2) == []
    assert kv.lookup(keys(tokens, extra=extra_key(None, "alice")), 2) == a


def test_duplicate_publication_keeps_the_first_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    hashes = keys(list(range(4)))
    a: list[int] = []
    b: list[int] = []
    kv.allocate(a, 4)
    kv.allocate(b, 4)
    kv.cache_blocks(a, hashes, 0, 1)
    kv.cache_blocks(b, hashes, 0, 1)
    assert kv.lookup(hashes, 1) == a
    kv.free(b)  # the unpublished copy returns as a plain block
    assert b == [] and len(kv.free_plain) == 3


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    hashes = keys(list(range(8)))
    a: list[int] = []
    kv.allocate(a, 8)
    kv.cache_blocks(a, hashes, 0, 2)
    assert kv.lookup(hashes, 2) == []


def test_bad_pool_sizes_are_rejected_by_name():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


def test_publish_full_blocks_publishes_only_newly_filled_blocks_and_returns_the_count():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(16))
    hashes = keys(tokens)
    a: list[int] = []
    assert kv.allocate(a, 16)
    assert kv.publish_full_blocks(a, hashes, 0, 3) == 0  # no block full yet
    assert kv.lookup(hashes, 4) == []
    assert kv.publish_full_blocks(a, hashes, 0, 9) == 2  # tokens 0..8: two full blocks
    assert kv.lookup(hashes, 4) == a[:2]
    assert kv.publish_full_blocks(a, hashes, 2, 11) == 2  # still two
    assert kv.publish_full_blocks(a, hashes, 2, 16) == 4
    assert kv.lookup(hashes, 4) == a


def test_publish_full_blocks_is_a_no_op_without_prefix_caching():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    tokens = list(range(8))
    a: list[int] = []
    assert kv.allocate(a, 8)
    assert kv.publish_full_blocks(a, keys(tokens), 0, 8) == 0
    assert kv.cached == {}


def test_compact_keeps_the_newest_cached_blocks_on_the_lowest_free_ids_and_says_where_use_ends():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    tables = []
    for i in range(5):  # five two-block prompts, published and freed in this order: blocks 0..9
        table: list[int] = []
        assert kv.allocate(table, 4)
        kv.cache_blocks(table, keys([i, i, i, i], 2), 0, 2)
        tables.append(list(table))
        kv.free(table)
    held: list[int] = []
    assert kv.allocate(held, 2) and held == [10]  # a plain block still in use sits above them
    moves, top = kv.compact(keep_cached=4)
    # The four newest (prompts 3 and 4: blocks 6..9) stay, renumbered onto 0..3 with their contents copied.
    assert sorted(moves) == [(6, 0), (7, 1), (8, 2), (9, 3)]
    assert top == 11  # the held block does not move
    assert kv.lookup(keys([0, 0, 0, 0], 2), 2) == []  # the oldest are evicted
    assert kv.lookup(keys([4, 4, 4, 4], 2), 2) == [dict(moves)[b] for b in tables[4]]
    assert kv.num_free_blocks == 15
    kv.free(held)
    moves, top = kv.compact(keep_cached=4)
    assert (moves, top) == ([], 4)  # already compact: nothing moves, and nothing from 4 up is in use
    fresh: list[int] = []
    assert kv.allocate(fresh, 8) and fresh == [4, 5, 6, 7]  # lowest first again


def test_compact_keeps_lru_order_and_evicting_everything_frees_the_whole_pool():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a: list[int] = []
    b: list[int] = []
    assert kv.allocate(a, 2) and kv.allocate(b, 2)
    kv.cache_blocks(a, keys([1, 1], 2), 0, 1)
    kv.cache_blocks(b, keys([2, 2], 2), 0, 1)
    assert (a, b) == ([0], [1])
    kv.free(b)  # b is freed first: the older of the two
    kv.free(a)
    moves, top = kv.compact(keep_cached=2)
    assert (moves, top) == ([], 2)
    c: list[int] = []
    assert kv.allocate(c, 14)  # 7 blocks: the 6 plain ones, then the oldest cached one (b's)
    assert kv.lookup(keys([1, 1], 2), 1) == [0] and kv.lookup(keys([2, 2], 2), 1) == []
    kv.free(c)
    moves, top = kv.compact(keep_cached=0)
    assert (moves, top) == ([], 0) and kv.cached == {} and list(kv.free_plain) == list(range(8))
