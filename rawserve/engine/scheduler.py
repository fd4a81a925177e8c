"""Who computes what this step: a waiting queue by (priority, arrival), a running set, a token budget with
chunked prefill, and preemption by recompute when KV blocks run out.

It moves block ids and counters only; running the model and sampling belong to EngineCore.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.request import Request, RequestStatus
from rawserve.engine.state_cache import StateCacheManager

if TYPE_CHECKING:
    from rawserve.engine.multimodal.encode_queue import EncodeQueue


class LoraSlots:
    """Which adapter each of the max_loras LoRA slots holds, how many running requests use each, and the
    loads the model runner owes (slot, adapter) before the next forward.

    A running request holds its adapter's slot, so no step ever names more than max_loras adapters. An
    adapter that is not resident takes a free slot, else the least recently used slot nobody runs on.
    """

    def __init__(self, max_loras: int) -> None:
        self.slots: list[str | None] = [None] * max_loras
        self.users = [0] * max_loras
        self.last_used = [0] * max_loras
        self._clock = itertools.count(1)
        self.pending_loads: list[tuple[int, str]] = []

    def acquire(self, name: str) -> int:
        """The slot for a request of `name` to run on, or -1 when every slot is in use by others."""
        slots = self.slots
        if name in slots:
            slot = slots.index(name)
        else:
            free = [i for i, users in enumerate(self.users) if users == 0]
            if not free:
                return -1
            slot = min(free, key=lambda i: (slots[i] is not None, self.last_used[i]))  # empty, else LRU
            slots[slot] = name
            self.pending_loads.append((slot, name))
        self.users[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def evict(self, name: str) -> None:
        """Forget an unloaded adapter (nobody may be running on it)."""
        if name in self.slots:
            self.slots[self.slots.index(name)] = None

    def take_loads(self) -> list[tuple[int, str]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def running_adapters(self) -> list[str]:
        return [name for name, users in zip(self.slots, self.users) if name is not None and users]


class Scheduler:
    """One step's choice is a list of (request, num_new_tokens); StepPlan lays it out as a batch.

    Decodes are served before prefill chunks, so a long prompt spread over steps takes only the budget the
    running decodes leave. `running` stays sorted by (priority, arrival), so the request to preempt, the
    lowest-priority latest one, is always its last element.

    It also times each request's wait, queued to first scheduled (request_queue_time_seconds, as vLLM
    measures it: a preempted request's second wait is not counted), for the core loop to report.
    """

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 clock: Callable[[], float] = time.monotonic, max_loras: int = 0, whole_prompts: bool = False,
                 states: StateCacheManager | None = None, encoder: EncodeQueue | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A heap of (priority, arrival, tiebreak, request): the tiebreak keeps Requests from being compared.
        self.waiting: list[tuple[int, int, int, Request]] = []
        self._tiebreak = itertools.count()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._clock = clock
        # (rid, seconds queued) of the requests the last schedule() admitted for the first time. Replaced by
        # each schedule(), so it stays bounded when nobody takes it (the offline engine, benches).
        self._queue_times: list[tuple[str, float]] = []
        self._has_finished_running = False  # running holds finished requests to drop at the next step
        self.lora_slots = LoraSlots(max_loras) if max_loras else None
        # An encoder's requests (no KV cache to carry a chunk over) are never split: one that does not fit this
        # step's budget waits for the next (EngineCore refuses one longer than a whole step)
        self.whole_prompts = whole_prompts
        # A hybrid model's state slots: a running request holds one, so admission also waits for a free slot; a
        # prefix hit is cut to the longest prefix with a saved state, and prompts are cut at their save edge.
        self.states = states
        # A vision model's encode queue (MultiModalManager.encodes): no chunk runs past an image not encoded yet, and
        # the encoding a waiting request needs takes the budget its chunk leaves (_charge_encoder).
        self.encoder = encoder
        # Set by EngineCore once it serves guided requests: False for a running request that must sit this step out
        # (its sample waits for its grammar mask); it keeps its KV and its place, and runs in a later step.
        self.ready: Callable[[Request], bool] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        if self._has_finished_running:
            self._drop_finished()
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        req.queued_at_s = self._clock()
        heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._tiebreak), req))

    def finish(self, req: Request, reason: str, stop_reason: int | None = None) -> None:
        """End a request wherever it is and give its blocks back (published ones stay in the cache)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self._has_finished_running = True  # dropped from `running` in one pass, not one remove each
            self._release_lora(req)
        else:
            # Waiting: aborts are rare next to steps, so an O(n) removal beats tombstones in the heap.
            self.waiting = [entry for entry in self.waiting if entry[3] is not req]
            heapq.heapify(self.waiting)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        self.kv.free(req.block_ids)
        if self.states is not None:
            self.states.release(req)
        if self.encoder is not None and req.features is not None:
            self.encoder.drop(req)

    def take_queue_times(self) -> list[tuple[str, float]]:
        """(rid, seconds from queued to first scheduled) for each request the last schedule() admitted for
        the first time; each is reported once."""
        times = self._queue_times
        if times:
            self._queue_times = []
        return times

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1

    def _follows_a_prefill(self, req: Request, num_hit_blocks: int, prefilling: list[Request]) -> bool:
        """Whether a running request is still prefilling the prompt block this one would compute next: then this one
        waits for that prefill to end and continues from the cached prefix instead of computing the same tokens
        beside it (the n samples of one prompt, one system prompt sent by many clients at once). On a hybrid
        model this is how samples share their prompt: the first's state, saved at its prompt's last block edge,
        is restored into each of the others, so there a request waits only for a prefill whose whole prompt up to
        that edge it shares (a KV hit short of a saved state would be of no use to it)."""
        bs = self.kv.block_size
        if num_hit_blocks >= (req.num_tokens - 1) // bs:
            return False  # no full block left to compute that another could share
        hashes = req.block_hashes
        for other in prefilling:
            theirs = other.block_hashes
            if other.status is not RequestStatus.RUNNING or other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            # Block hashes are chained: one equal hash means the whole prefix before it is equal too
            shared = (other.num_prompt_tokens - 1) // bs if self.states is not None else num_hit_blocks + 1
            if num_hit_blocks < shared <= min(len(theirs), len(hashes)) and theirs[shared - 1] == hashes[shared - 1]:
                return True
        return False

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self._has_finished_running = False

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop the KV, keep the tokens. The request keeps its queue position, so it
        resumes before anything that arrived after it, and its outputs so far are kept."""
        self.running.remove(req)
        self.kv.free(req.block_ids)
        self._release_lora(req)
        if self.states is not None:
            self.states.release(req)  # recomputed from its first token, or from a saved state, on resuming
        if self.encoder is not None and req.features is not None:
            self.encoder.drop(req)  # its image's job, unless another request waits on it too
        req.num_computed_tokens = 0
        req.num_published_blocks = 0
        if not req.prompt_logprobs_done:
            req.prompt_logprobs = []  # the prompt will be computed again from its first token
        req.status = RequestStatus.PREEMPTED
        heapq.heappush(self.waiting, (req.priority, req.arrival, next(self._tiebreak), req))
        self.num_preemptions += 1

    def _charge_encoder(self, req: Request, start: int, num_new: int, budget: int) -> tuple[int, int]:
        """A chunk [start, start + num_new) of a prompt with images -> (its tokens, the budget encoding takes): cut
        before the first image whose encoding is not complete; the encoder then works on it with the budget the
        chunk leaves, a slice of the tower per step (multimodal/encode_queue.py). A chunk cut to nothing leaves the
        request out of the step's forward while its image encodes."""
        num_ready = self.encoder.ready_tokens(req, start, num_new)
        if num_ready == num_new:
            return num_new, 0
        return num_ready, self.encoder.charge(budget - num_ready)

    def schedule(self) -> list[tuple[Request, int]]:
        if self._has_finished_running:
            self._drop_finished()
        kv = self.kv
        states = self.states
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted = False
        queue_times: list[tuple[str, float]] = []
        self._queue_times = queue_times
        now = self._clock() if self.waiting else 0.0  # the step's start: where a wait it ends, ends

        # Decodes first (one token each), then chunks of prompts already under way.
        decodes, prefills = [], []
        ready = self.ready
        for req in self.running:
            if ready is None or ready(req):
                (decodes if req.num_tokens - req.num_computed_tokens == 1 else prefills).append(req)
        for req in decodes + prefills if prefills else decodes:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # A decode's drafts (speculative decoding) run after its token, as far as the budget goes
            num_new = min(req.num_tokens - req.num_computed_tokens + len(req.spec_tokens), budget)
            if states is not None:
                num_new = states.chunk_limit(req, req.num_computed_tokens, num_new)
            charged = 0
            if self.encoder is not None and req.features is not None:
                num_new, charged = self._charge_encoder(req, req.num_computed_tokens, num_new, budget)
                if num_new == 0:
                    budget -= charged
                    continue
            while not kv.allocate(req.block_ids, req.num_computed_tokens + num_new):
                if num_new > req.num_tokens - req.num_computed_tokens:  # drafts never cost anyone their blocks
                    num_new = req.num_tokens - req.num_computed_tokens
                    req.spec_tokens = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is req:
                    break
            else:
                scheduled[req] = num_new
                budget -= num_new + charged

        # Admit from the queue only when nobody had to yield blocks: otherwise a newcomer would take the
        # blocks a preempted request needs to resume.
        if not preempted:
            waiting = self.waiting
            bs = kv.block_size
            lora_slots = self.lora_slots
            parked = []  # requests whose adapter has no free slot, or whose prefix another computes: they wait
            prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
            while (waiting and budget > 0 and len(self.running) < self.max_num_seqs
                   and (states is None or states.has_free_slot)):
                req = waiting[0][3]
                if req.lora is not None:
                    slot = lora_slots.acquire(req.lora) if lora_slots is not None else -1
                    if slot < 0:
                        parked.append(heapq.heappop(waiting))
                        continue
                    req.lora_slot = slot
                num_tokens = req.num_tokens
                use_cache = kv.enable_prefix_caching and req.prompt_logprobs_done and req.is_cacheable
                # At least the last token is recomputed, so there are logits to sample from.
                hits = kv.lookup(req.block_hashes, (num_tokens - 1) // bs) if use_cache else []
                if states is not None and hits:  # a hybrid continues only from a prefix whose state was saved
                    del hits[states.usable_blocks(req.block_hashes, len(hits)):]
                if use_cache and self._follows_a_prefill(req, len(hits), prefilling):
                    self._release_lora(req)
                    parked.append(heapq.heappop(waiting))
                    continue
                num_cached = len(hits) * bs
                num_new = min(num_tokens - num_cached, budget)
                if states is not None:
                    num_new = states.chunk_limit(req, num_cached, num_new)
                charged = 0
                if self.encoder is not None and req.features is not None:
                    num_new, charged = self._charge_encoder(req, num_cached, num_new, budget)
                if self.whole_prompts and num_new < num_tokens - num_cached:
                    self._release_lora(req)
                    break  # the head waits for a step with room for all of it; nobody overtakes it
                if not kv.allocate(req.block_ids, num_cached + num_new, hits):
                    self._release_lora(req)
                    break  # the head waits for blocks; nobody overtakes it
                heapq.heappop(waiting)
                if states is not None:
                    states.admit(req, len(hits))
                if use_cache:
                    kv.record_lookup(num_tokens, num_cached)
                if req.status is RequestStatus.WAITING:  # its first admission (a preempted one resumes)
                    req.num_cached_tokens = num_cached
                    queue_times.append((req.rid, max(now - req.queued_at_s, 0.0)))
                req.num_computed_tokens = num_cached
                req.num_published_blocks = len(hits)
                req.status = RequestStatus.RUNNING
                bisect.insort(self.running, req, key=Request.sort_key)
                prefilling.append(req)
                if num_new:  # else it runs once its image is encoded
                    scheduled[req] = num_new
                budget -= num_new + charged
            for entry in parked:
                heapq.heappush(waiting, entry)
        return list(scheduled.items())
