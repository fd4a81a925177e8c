"""DraftModelProposer: a smaller checkpoint of the same vocabulary drafts k tokens greedily, one forward for the
tokens it has not seen plus one per further draft. Its KV pool is its own, indexed by the target's block ids.
"""
from __future__ import annotations

import dataclasses
import logging

from rawserve.config import EngineConfig
from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.request import Request
from rawserve.engine.step_plan import ForwardBatch, StepInput

log = logging.getLogger("rawserve.engine.spec")


@dataclasses.dataclass(slots=True)
class DraftProgress:
    """What of a request the draft's KV holds: its first `num_computed` tokens, in these blocks. A preemption or a
    trim that gave blocks back shows as a table that no longer starts with them; drafting then recomputes from
    the common part (a block freed and handed back to the same request unchanged would keep stale KV: that only
    makes drafts worse, never the output, which the target verifies)."""
    num_computed: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)


class DraftModelProposer:
    """Drafts are the draft model's greedy tokens (a point mass: verification is exact whatever they are). The
    draft's KV pool has as many blocks as the target's and is indexed by the same block ids, so the target's
    block tables, allocation, trims and frees serve both: a draft needs no table of its own. The KV budget buys
    blocks of both pools together (ModelRunner._spec_block_bytes); the draft's weights are not counted in it."""

    def __init__(self, target: EngineConfig, draft_dir: str, blocks: KVCacheManager, vocab_size: int) -> None:
        config = dataclasses.replace(
            target, model_dir=draft_dir, num_kv_blocks=blocks.num_blocks, speculative_config=None, lora_modules=[],
            enable_lora=False, allow_runtime_lora_updating=False, enable_prefix_caching=False)
        self.runner = ModelRunner(config)
        if self.runner.vocab_size != vocab_size:
            raise ValueError(f"--speculative-config: the draft model's vocabulary ({self.runner.vocab_size}) is not "
                             f"the target's ({vocab_size})")
        if self.runner.is_hybrid:
            raise ValueError("--speculative-config: a draft model must be a dense decoder (Qwen3, Qwen2, Llama)")
        self.blocks = blocks
        self.block_size = blocks.block_size
        log.info("draft model %s: %d layers, KV pool of %d blocks", draft_dir, self.runner.model_config.num_layers,
                 blocks.num_blocks)

    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] drafts for each request (fewer, or none, where KV blocks for them cannot be had)."""
        rows, counts = [], []
        blocks = self.blocks
        # Blocks are taken before the scheduler runs: leave one per drafting row, so drafting never makes it
        # preempt a request for a block that request's own decode needs
        reserve = len(reqs)
        for req, k in zip(reqs, ks):
            # The draft writes positions up to len + k - 2 (its last draft is not fed back)
            needed = blocks.blocks_for(req.num_tokens + k - 1) - len(req.block_ids)
            if needed <= blocks.num_free_blocks - reserve and blocks.allocate(req.block_ids, req.num_tokens + k - 1):
                rows.append(req)
                counts.append(k)
        drafts: dict[str, list[int]] = {req.rid: [] for req in reqs}
        if not rows:
            return [drafts[req.rid] for req in reqs]
        seqs = []
        for req in rows:
            start = self._valid_prefix(req)
            seqs.append(StepInput(req.token_ids[start:], start, req.block_ids))
        tokens = self.runner.execute(ForwardBatch.last_tokens(seqs)).argmax(dim=-1).tolist()
        for req, token in zip(rows, tokens):
            drafts[req.rid].append(token)
            req.spec_state.draft = DraftProgress(req.num_tokens, req.block_ids[:self._blocks_for(req.num_tokens)])
        for j in range(1, max(counts)):
            active = [req for req, k in zip(rows, counts) if k > j]
            seqs = [StepInput([drafts[req.rid][-1]], req.num_tokens + j - 1, req.block_ids) for req in active]
            tokens = self.runner.execute(ForwardBatch.last_tokens(seqs)).argmax(dim=-1).tolist()
            for req, token in zip(active, tokens):
                drafts[req.rid].append(token)
        return [drafts[req.rid] for req in reqs]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _valid_prefix(self, req: Request) -> int:
        """Tokens of req whose draft KV is in its blocks now: the draft's count, cut to the blocks still the same
        and to the target's computed tokens (a trim may have taken the block of the last)."""
        progress = req.spec_state.draft
        if progress is None:
            return 0
        same = 0
        for a, b in zip(progress.block_ids, req.block_ids):
            if a != b:
                break
            same += 1
        return min(progress.num_computed, same * self.block_size, req.num_computed_tokens)
