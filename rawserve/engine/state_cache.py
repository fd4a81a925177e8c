"""StateCacheManager: a hybrid model's fixed-size per-sequence states (Qwen3.5's conv and recurrent states) as slot
ids: one running slot per admitted sequence, and saved states the prefix cache restores, keyed like KV blocks.

Bookkeeping only, like KVCacheManager: the state tensors are the model runner's, which performs the copies this
manager queues (restores before a step's forward, saves after it).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rawserve.engine.request import Request


class StateCacheManager:
    """Slots 0..num_running-1 hold running sequences' states; slots num_running.. hold saved states.

    A running slot is taken at admission and given back at finish, abort and preemption: every admitted request
    holds exactly one, so the scheduler admits nobody without a free one (`has_free_slot`).

    A saved state is a running slot's contents copied when the sequence's computed tokens end on a block edge,
    keyed by that block's prefix-cache key (the chain over every earlier block, the salt and the adapter), so it
    stands for exactly the prefix the KV blocks under the same key hold. A KV hit is usable only up to the longest
    prefix with a saved state (`usable_blocks`); restoring copies it into the new running slot. Saved states are
    LRU-evicted when a save needs room, and dropped when the KV block of their key is evicted (`forget`): a state
    without its KV is never restored, since lookups walk the KV chain first.

    Saves: each prefill chunk that ends on a block edge (the scheduler cuts the prompt at its last full block,
    `chunk_limit`, so that edge is always one), and while decoding one rolling save per sequence, at its newest
    block edge (the previous one dropped), so the next turn of a chat that extends this output can hit.
    """

    def __init__(self, num_running: int, num_saved: int, block_size: int) -> None:
        if num_running < 1:
            raise ValueError(f"num_running: must be >= 1, got {num_running}")
        self.num_running = num_running
        self.num_saved = num_saved
        self.block_size = block_size
        self.free_running: list[int] = list(range(num_running - 1, -1, -1))  # popped lowest first
        self.free_saved: list[int] = list(range(num_running + num_saved - 1, num_running - 1, -1))
        self.saved: OrderedDict[bytes, int] = OrderedDict()  # key -> saved slot, least recently used first
        self._rolling: dict[int, bytes] = {}  # running slot -> key of its sequence's latest decode-time save
        self._copies: list[tuple[int, int]] = []  # (from slot, to slot) the runner owes, in order
        self.num_restores = 0
        self.num_saves = 0
        self.num_evictions = 0

    @property
    def enable_saving(self) -> bool:
        return self.num_saved > 0

    @property
    def num_free_slots(self) -> int:
        return len(self.free_running)

    @property
    def has_free_slot(self) -> bool:
        return bool(self.free_running)

    @property
    def num_slots(self) -> int:
        """Rows of the runner's state tensors: running slots, then saved ones."""
        return self.num_running + self.num_saved

    def usable_blocks(self, block_hashes: list[bytes], num_hit_blocks: int) -> int:
        """Of a KV hit of num_hit_blocks leading blocks, how many a restored state can continue from: the longest
        prefix whose last block's key has a saved state (0: compute from the first token)."""
        saved = self.saved
        for n in range(num_hit_blocks, 0, -1):
            if block_hashes[n - 1] in saved:
                return n
        return 0

    def admit(self, req: Request, num_hit_blocks: int) -> None:
        """Give an admitted request a running slot; with a hit, queue the copy of its saved state into it (the
        hit's blocks are held by the request now, so their keys, and this state, stay until the copy is done)."""
        assert req.state_slot < 0, f"{req.rid} already holds state slot {req.state_slot}"
        slot = self.free_running.pop()
        req.state_slot = slot
        if num_hit_blocks:
            key = req.block_hashes[num_hit_blocks - 1]
            self.saved.move_to_end(key)
            self._copies.append((self.saved[key], slot))
            self.num_restores += 1

    def release(self, req: Request) -> None:
        """The request finished, was aborted or preempted: its running slot goes back (its saves stay)."""
        slot = req.state_slot
        if slot < 0:
            return
        req.state_slot = -1
        self._rolling.pop(slot, None)
        self.free_running.append(slot)

    def chunk_limit(self, req: Request, start: int, num_new: int) -> int:
        """Cut a prefill chunk at the prompt's save edge, so that state is saved there: the start of the block that
        holds the prompt's last token (what a repeat of the prompt can hit), and the prompt's end when it ends a
        block (what a longer prompt extending it can hit; saved as any chunk end on an edge is)."""
        if not self.enable_saving or not req.is_cacheable:
            return num_new
        edge = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        if req.features is not None:  # also the last edge before the first image: prompts that share the text
            # before it and differ in the image (multimodal/prefix_keys.py) continue from there
            first = req.features.images[0].offset // self.block_size * self.block_size
            if start < first < start + num_new:
                return first - start
        return edge - start if start < edge < start + num_new else num_new

    def save(self, req: Request, is_decode: bool) -> None:
        """After a forward: when the request's computed tokens end on a block edge, save its state under that
        block's key (nothing to do when that key is saved already)."""
        num_computed = req.num_computed_tokens
        if not self.enable_saving or num_computed % self.block_size or not num_computed or not req.is_cacheable:
            return
        index = num_computed // self.block_size - 1
        if index >= len(req.block_hashes):
            return
        key = req.block_hashes[index]
        saved = self.saved
        if key in saved:
            saved.move_to_end(key)
            return
        if is_decode:  # one rolling save per decoding sequence: the newest edge replaces the last
            previous = self._rolling.get(req.state_slot)
            if previous is not None:
                self.forget(previous)
            self._rolling[req.state_slot] = key
        if self.free_saved:
            slot = self.free_saved.pop()
        else:
            _, slot = saved.popitem(last=False)
            self.num_evictions += 1
        saved[key] = slot
        self._copies.append((req.state_slot, slot))
        self.num_saves += 1

    def forget(self, key: bytes) -> None:
        """Drop the saved state under `key` (its KV block was evicted, or a newer rolling save replaces it)."""
        slot = self.saved.pop(key, None)
        if slot is not None:
            self.free_saved.append(slot)

    def snapshot(self, req: Request) -> int:
        """A free running slot holding a copy of req's state as it is now, or -1 when none is free: speculative
        decoding's rollback point, lent for one step (end_snapshot gives it back)."""
        if not self.free_running:
            return -1
        slot = self.free_running.pop()
        self._copies.append((req.state_slot, slot))
        return slot

    def end_snapshot(self, slot: int, restore_into: int = -1) -> None:
        """Give a snapshot's slot back, first copying it into `restore_into` (the request's running slot, rolled
        back past rejected drafts) when that is >= 0. The copies run in order before the next forward, so a later
        admission into the same slot overwrites it only after the restore has read it."""
        if restore_into >= 0:
            self._copies.append((slot, restore_into))
        self.free_running.append(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (from, to) slot copies owed, in order, for the runner to perform now."""
        copies, self._copies = self._copies, []
        return copies

    def stats(self) -> dict[str, int]:
        return {"state_slots_running": self.num_running - len(self.free_running),
                "state_slots": self.num_running, "saved_states": len(self.saved),
                "saved_state_slots": self.num_saved, "state_restores": self.num_restores,
                "state_saves": self.num_saves, "state_evictions": self.num_evictions}
