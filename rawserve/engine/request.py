"""Per-request state inside the core: tokens so far, KV progress, block table, prefix keys, stop sets.

Plain data the scheduler, sampler and EngineCore share; it decides nothing and never crosses the queue.
"""
from __future__ import annotations

import enum

import torch

from rawserve.engine.kv_cache import extend_block_hashes, extra_key
from rawserve.engine.multimodal.prefix_keys import extend_image_block_hashes
from rawserve.engine.types import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue; its KV is gone and will be recomputed
    FINISHED = 3


class Request:
    """One sequence. token_ids grows in place (prompt, then outputs) and is never rebuilt, so per-step work
    stays independent of the sequence's length."""

    __slots__ = (
        "rid", "params", "priority", "arrival", "lora", "features", "cache_salt", "token_ids",
        "num_prompt_tokens", "num_output_tokens", "num_computed_tokens", "num_cached_tokens", "block_ids",
        "block_hashes", "hash_extra", "is_cacheable", "num_published_blocks", "status", "finish_reason",
        "stop_reason", "eos_ids", "stop_ids", "min_tokens_ban", "prompt_logprobs", "prompt_logprobs_done",
        "generator", "penalty_slot", "needs_penalties", "is_plain_greedy", "bias_ids", "bias_values",
        "sampling_row", "guided", "guided_end_ids", "queued_at_s", "lora_slot", "state_slot", "spec_tokens",
        "spec_state",
    )

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0,
                 arrival: int = 0, eos_token_ids: tuple[int, ...] = (), lora: str | None = None,
                 features: object | None = None, cache_salt: str | None = None, lora_load: int = 0) -> None:
        self.rid = rid
        self.params = params
        self.priority = priority
        self.arrival = arrival  # admission order among equal priorities
        self.lora = lora
        self.lora_slot = -1  # the LoRA slot it holds while running (the scheduler's LoraSlots assigns it)
        self.state_slot = -1  # a hybrid model's state slot while running (StateCacheManager assigns it)
        self.features = features
        self.cache_salt = cache_salt
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_output_tokens = 0
        self.num_computed_tokens = 0  # tokens whose KV is in this request's blocks
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # one key per full block of token_ids
        # Keyed by the adapter's load, not only its name: a name reloaded with other weights gets fresh blocks.
        self.hash_extra = extra_key(f"{lora}#{lora_load}" if lora is not None else None, cache_salt)
        # Images change the KV of the tokens that stand for them, which the token ids alone cannot say: their keys
        # go into the block hashes from the first image on (multimodal/prefix_keys.py).
        self.is_cacheable = True
        self.num_published_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = RequestStatus.WAITING
        self.queued_at_s = 0.0  # the scheduler's clock when it was queued (time.monotonic by default)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        # EOS ends a request with stop_reason None; an explicit stop id reports itself (as vLLM does).
        self.eos_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        # Ids held back while fewer than min_tokens were generated: whatever would stop the request
        # (so EOS is not held back under ignore_eos, where it does not stop anything).
        self.min_tokens_ban = tuple(sorted(self.eos_ids | self.stop_ids)) if params.min_tokens else ()
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        self.prompt_logprobs_done = params.prompt_logprobs is None
        self.generator: torch.Generator | None = None  # the sampler makes it on first use (device-bound)
        self.penalty_slot = -1  # the sampler's penalty-state row, -1 when none
        self.needs_penalties = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                                or params.frequency_penalty != 0.0)
        bias = params.logit_bias or {}
        self.bias_ids = [int(t) for t in bias]
        self.bias_values = [float(v) for v in bias.values()]
        self.is_plain_greedy = (params.temperature == 0 and not self.needs_penalties and not bias
                                and not params.min_tokens)
        self.guided = None  # GuidedState, set by EngineCore when params.guided is given
        # What a grammar lets end the output once it accepts: EOS and the explicit stop ids.
        self.guided_end_ids = sorted(self.eos_ids | self.stop_ids)
        # One row of the sampler's per-step parameter table; greedy rows divide by 1, not 0.
        # Speculative decoding (engine/spec/): the tokens drafted for this step's verification (not in token_ids
        # until accepted), and the proposer's per-request record (acceptance, pauses)
        self.spec_tokens: list[int] = []
        self.spec_state = None
        self.sampling_row = (params.temperature if params.temperature > 0 else 1.0, float(params.top_k),
                             params.top_p, params.min_p)

    def update_block_hashes(self, block_size: int) -> None:
        if self.features is not None:
            extend_image_block_hashes(self.block_hashes, self.token_ids, block_size, self.hash_extra,
                                      self.features.images)
        else:
            extend_block_hashes(self.block_hashes, self.token_ids, block_size, self.hash_extra)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority as vLLM orders it (lower value wins), then arrival."""
        return (self.priority, self.arrival)

    def __repr__(self) -> str:
        return (f"Request({self.rid!r}, {self.status.name}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
