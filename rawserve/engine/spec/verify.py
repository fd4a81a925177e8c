"""SpecDecoder: drafts for the rows about to decode, then their verification after the forward: accepted tokens
out, rejected positions rolled back (KV counters, blocks past the end, nothing rejected published).

It holds no request and no tensor across steps but each request's acceptance record; sampling, grammar masks and
stop decisions stay EngineCore's, called position by position through `VerifyHooks`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from rawserve.config import SpeculativeConfig
from rawserve.engine import vocab_ops
from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.request import Request, RequestStatus
from rawserve.engine.spec.draft_model import DraftModelProposer
from rawserve.engine.spec.mtp import MTPProposer
from rawserve.engine.spec.policy import BatchPolicy
from rawserve.engine.spec.proposers import NgramProposer, SyntheticProposer
from rawserve.engine.state_cache import StateCacheManager
from rawserve.engine.step_plan import SpecSpan
from rawserve.engine.types import RequestOutput

log = logging.getLogger("rawserve.engine.spec")

# A row's acceptance record: the average accepted drafts per verified step, over about the last 1 / _EMA steps
_EMA = 0.25
_WARMUP_STEPS = 4  # verified steps before a row's average may pause it
_PAUSE_STEPS = 8  # a low-acceptance row's first pause; each pause after doubles it, up to _MAX_PAUSE_STEPS
_MAX_PAUSE_STEPS = 512


@dataclass(slots=True)
class RowState:
    """One request's acceptance record (Request.spec_state)."""
    mean_accepted: float = 0.0
    num_verified: int = 0
    paused_until: int = 0  # the decoder's step count before which the row drafts nothing
    pause_steps: int = _PAUSE_STEPS
    num_forced: int = 0  # synthetic: this step's leading drafts taken without comparing
    draft: object = None  # a draft model's progress through this request (draft_model.DraftProgress)
    mtp: object = None  # the MTP layer's progress and the target's hidden states it has yet to read (mtp.MTPProgress)


@dataclass(slots=True)
class VerifyHooks:
    """EngineCore's per-row steps, which verification runs once per verified position:
    mask(logits [R, V], reqs, failures) -> (rows left, their reqs); sample(logits, reqs, failures) -> (reqs that
    drew a token, tokens, logprobs or None);
    update(reqs, tokens, logprobs, failures) -> one RequestOutput per request that took its token."""
    mask: Callable
    sample: Callable
    update: Callable


@dataclass(slots=True)
class _StepSample:
    """The step being timed for BatchPolicy: its clock starts at propose and stops at the next propose (the core
    loop steps back to back while requests run), so the loop's own work per step counts too."""
    num_rows: int
    probe: bool
    began: float
    rids: frozenset
    decode_only: bool = False  # every scheduled row was one of the decoding rows (no prefill chunk)
    drafted: bool = False
    tokens: int = 0


@dataclass(slots=True)
class SpecCounters:
    num_drafts: int = 0  # verified rows (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_steps_off_by_batch: int = 0  # steps with no drafts because at least disable_by_batch_size rows decoded
    num_pauses: int = 0  # rows paused for low acceptance, in all


class SpecDecoder:
    """The seam: `propose(running)` before the scheduler runs (Request.spec_tokens), `verify(spans, logits, ...)`
    after the forward, for the StepPlan's spec_spans.

    Verification is sequential per position and exact: at position j every still-accepting row draws its token
    with the sampler exactly as plain decoding would draw it there (same processors, penalties counted so far,
    the grammar's state, the request's seeded generator's next uniform), and the run goes on while the drawn
    token equals the draft. For a proposer whose draft is one token (n-gram), that is rejection sampling: the
    draft d is accepted with probability p(d), and otherwise the token comes from p with d removed, renormalised;
    the emitted tokens follow the target's distribution under every sampling parameter, and a seeded request
    emits the very tokens it would without speculation. Greedy rows take the longest matching prefix plus the
    target's next token.
    """

    def __init__(self, config: SpeculativeConfig, blocks: KVCacheManager, max_model_len: int,
                 states: StateCacheManager | None = None,
                 draft: DraftModelProposer | MTPProposer | None = None) -> None:
        self.config = config
        # A hybrid model's (Qwen3.5) recurrent states cannot drop a rejected draft's update: each drafted row's
        # state is copied aside before the forward (hold_states) and copied back when a draft is rejected; its
        # accepted tokens are then recomputed at the start of its next step's row, for the wider row's near-free
        # cost at small batches (a row's weights are read once however many tokens it carries), instead of a
        # state per verified position inside the delta-rule kernels.
        self.states = states
        self._held: dict[str, tuple[int, int]] = {}  # rid -> (snapshot slot, computed tokens it stands for)
        self.k = config.num_speculative_tokens
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.draft = draft  # the draft model drafts for all rows at once (propose_batch), not row by row
        self._running: set[str] = set()  # the rids running at the last propose
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method in ("draft_model", "mtp"):
            self.proposer = None
        else:
            self.proposer = SyntheticProposer(self.k, config.acceptance_length, config.seed)
        # A draft model or MTP layer with "acceptance_length" (benchmarks, as llama.cpp's --spec-synth-len over its
        # draft-simple): real drafts, paid for, with their acceptance drawn at that mean instead of compared
        self._synthetic_acceptance = SyntheticProposer(self.k, config.acceptance_length, config.seed) \
            if draft is not None and config.acceptance_length > 1 else None
        self.is_synthetic = config.method == "synthetic" or self._synthetic_acceptance is not None
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)
        self.steps = 0
        self.off_reason = ""  # why this step drafted nothing for anyone, for the stats line
        # Whether a step drafts at all: a fixed disable_by_batch_size, or (by default) measured step times
        self.policy = BatchPolicy() if config.disable_by_batch_size is None else None
        self._sample: _StepSample | None = None
        self.clock = time.perf_counter

    # ---- before the schedule -------------------------------------------------------------------------------

    def propose(self, running: Iterable[Request]) -> None:
        """Draft for each running request that decodes this step (its tokens all computed but the last)."""
        self.steps += 1
        now = self.clock()
        sample, self._sample = self._sample, None
        decoding = []
        was_running, self._running = self._running, set()
        for req in running:
            req.spec_tokens = []
            self._running.add(req.rid)
            if req.rid not in was_running and req.spec_state is not None:
                # Back from a preemption: the blocks its draft KV was in went to others meanwhile
                req.spec_state.draft = None
            # Past its prompt with tokens to compute: a decode, or (a hybrid after a rejection, or a preempted
            # request resuming) a run of accepted tokens to recompute, which its drafts follow
            if (req.status is RequestStatus.RUNNING and req.num_computed_tokens >= req.num_prompt_tokens
                    and req.num_tokens > req.num_computed_tokens):
                decoding.append(req)
        if sample is not None and sample.decode_only and not sample.rids.isdisjoint(self._running):
            # Some of its rows still run, so the loop went straight on to this step: the gap is the step's time
            self.policy.record(sample.num_rows, sample.drafted, sample.tokens, now - sample.began, sample.probe)
        if not decoding:
            self.off_reason = ""
            return
        if self.policy is not None:
            # Compute-bound at some batch size: k more positions per row cost about k more rows' work there
            draft, probe = self.policy.choose(len(decoding))
            self._sample = _StepSample(len(decoding), probe, now, frozenset(req.rid for req in decoding))
            off = not draft
        else:
            off = len(decoding) >= self.config.disable_by_batch_size
        if off:
            self.counters.num_steps_off_by_batch += 1
            self.off_reason = self.policy.describe(len(decoding)) if self.policy is not None else \
                f"off: {len(decoding)} rows decode (disable_by_batch_size {self.config.disable_by_batch_size})"
            return
        self.off_reason = ""
        batch: list[tuple[Request, int]] = []
        for req in decoding:
            params = req.params
            # Never past max_tokens (the last drafted position's token is the target's own) nor max_model_len
            k = min(self.k, params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
            if k < 1 or params.pooling is not None:
                continue
            state = req.spec_state
            if state is None:
                state = req.spec_state = RowState()
            if state.paused_until > self.steps:
                continue
            if self.draft is not None:
                batch.append((req, k))
                continue
            proposal = self.proposer.propose(req.token_ids, k)
            req.spec_tokens = proposal.tokens
            # Forced acceptance (synthetic) skips the draw, so a row that needs its drawn tokens' logprobs or a
            # grammar's check gets its drafts verified like any proposer's
            forced = proposal.num_forced if req.guided is None and params.logprobs is None else 0
            state.num_forced = min(forced, len(proposal.tokens))
        if batch:
            reqs = [req for req, _ in batch]
            for req, drafts in zip(reqs, self.draft.propose_batch(reqs, [k for _, k in batch])):
                req.spec_tokens = drafts
                if self._synthetic_acceptance is not None and drafts:
                    forced = self._synthetic_acceptance.propose(req.token_ids, len(drafts)).num_forced
                    req.spec_state.num_forced = forced if req.guided is None and req.params.logprobs is None else 0

    def hold_states(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """A hybrid's step, scheduled: snapshot each drafted row's state into a spare running slot; a row with
        none left runs without its drafts (their blocks go back)."""
        states, out = self.states, []
        for req, num_new in scheduled:
            num_real = req.num_tokens - req.num_computed_tokens
            if num_new > num_real:
                slot = states.snapshot(req)
                if slot >= 0:
                    self._held[req.rid] = (slot, req.num_computed_tokens)
                else:
                    num_new = num_real
                    req.spec_tokens = []
                    self.blocks.trim(req.block_ids, req.num_computed_tokens + num_new)
            out.append((req, num_new))
        return out

    # ---- after the forward ---------------------------------------------------------------------------------

    def observe(self, scheduled: list[tuple[Request, int]], seqs: list) -> None:
        """After the target's forward: an MTP proposer keeps the step's final hidden states (the rows' next drafts
        are made from them)."""
        sample = self._sample
        if sample is not None:
            sample.decode_only = all(req.rid in sample.rids for req, _ in scheduled)
            sample.tokens = len(scheduled)  # each decoding row's own token; verify adds the accepted drafts
        observe = getattr(self.draft, "observe", None)
        if observe is not None:
            for req, _ in scheduled:
                if req.spec_state is None and req.params.pooling is None:
                    req.spec_state = RowState()
            observe(scheduled, seqs)

    def verify(self, spans: list[SpecSpan], logits: torch.Tensor, hooks: VerifyHooks,
               failures: list) -> list[RequestOutput]:
        """Accept each span's drafts against `logits` (row span.first_row + j predicts the token after draft j,
        row first_row the token after the last real one) -> one merged RequestOutput per request."""
        outputs: dict[str, list[RequestOutput]] = {}
        # Plain greedy rows (no processors, grammar or logprobs) need no sampler: one argmax over all their rows
        fast = [s for s in spans if s.req.is_plain_greedy and s.req.guided is None and s.req.params.logprobs is None]
        argmax: dict[int, list[int]] = {}
        if fast:
            rows = [s.first_row + j for s in fast for j in range(len(s.drafts) + 1)]
            tokens = vocab_ops.argmax(logits.index_select(0, torch.tensor(rows, dtype=torch.int64,
                                                                           device=logits.device))).tolist()
            at = 0
            for s in fast:
                argmax[id(s)] = tokens[at:at + len(s.drafts) + 1]
                at += len(s.drafts) + 1
        accepted = {id(s): 0 for s in spans}
        alive = list(spans)
        position = 0
        while alive:
            taken: list[tuple[SpecSpan, RequestOutput]] = []
            direct = [s for s in alive if id(s) in argmax or position < self._num_forced(s)]
            drawn = [s for s in alive if id(s) not in argmax and position >= self._num_forced(s)]
            if direct:
                tokens = [s.drafts[position] if position < self._num_forced(s) else argmax[id(s)][position]
                          for s in direct]
                taken += self._taken(direct, hooks.update([s.req for s in direct], tokens, None, failures))
            if drawn:
                taken += self._draw(drawn, position, logits, hooks, failures)
            alive = []
            for span, out in taken:
                outputs.setdefault(span.req.rid, []).append(out)
                # Synthetic rows stop at their drawn count: a draft the target happens to agree with is not counted
                if not out.finished and (position < self._num_forced(span) if self.is_synthetic else
                                         position < len(span.drafts) and out.new_token_ids[0] == span.drafts[position]):
                    accepted[id(span)] += 1
                    alive.append(span)
            position += 1
        for span in spans:
            self._settle(span, accepted[id(span)])
        if self._sample is not None and spans:
            self._sample.drafted = True
            self._sample.tokens += sum(accepted.values())
        return [merge_outputs(outs) for outs in outputs.values()]

    def _num_forced(self, span: SpecSpan) -> int:
        return min(span.req.spec_state.num_forced, len(span.drafts)) if self.is_synthetic else 0

    @staticmethod
    def _taken(spans: list[SpecSpan], outs: list[RequestOutput]) -> list[tuple[SpecSpan, RequestOutput]]:
        """Pair update's outputs (one per request that took its token; a grammar fault drops one) with spans."""
        by_rid = {out.request_id: out for out in outs}
        return [(s, by_rid[s.req.rid]) for s in spans if s.req.rid in by_rid]

    def _draw(self, spans: list[SpecSpan], position: int, logits: torch.Tensor, hooks: VerifyHooks,
              failures: list) -> list[tuple[SpecSpan, RequestOutput]]:
        """The sampler's token at `position` for each span, through the grammar masks and the sampler's
        processors as they stand after the tokens accepted so far."""
        rows = torch.tensor([s.first_row + position for s in spans], dtype=torch.int64, device=logits.device)
        x, reqs = hooks.mask(logits.index_select(0, rows), [s.req for s in spans], failures)
        if not reqs:
            return []
        reqs, tokens, logprobs = hooks.sample(x, reqs, failures)
        return self._taken(spans, hooks.update(reqs, tokens, logprobs, failures))

    def _settle(self, span: SpecSpan, num_accepted: int) -> None:
        """Count the span, and roll its request back to what it accepted: the KV of its token_ids but the last is
        computed (the forward wrote the drafts' too, and counted none of them), full blocks are published now
        that their tokens are accepted, and blocks past the computed tokens are freed."""
        req, counters = span.req, self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += len(span.drafts)
        counters.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            counters.accepted_per_pos[j] += 1
        state = req.spec_state
        state.num_verified += 1
        state.mean_accepted += _EMA * (num_accepted - state.mean_accepted)
        if (state.num_verified >= _WARMUP_STEPS and state.mean_accepted < self.config.min_acceptance):
            state.paused_until = self.steps + state.pause_steps
            state.pause_steps = min(2 * state.pause_steps, _MAX_PAUSE_STEPS)
            state.num_verified = 0
            state.mean_accepted = 0.0
            counters.num_pauses += 1
        held = self._held.pop(req.rid, None)
        if req.status is not RequestStatus.RUNNING:
            if held is not None:
                self.states.end_snapshot(held[0])
            return  # finished inside its run: the scheduler freed its blocks
        blocks = self.blocks
        req.num_computed_tokens = req.num_tokens - 1
        if held is not None:
            slot, num_before = held
            if num_accepted < len(span.drafts):  # the state ran past a rejected draft: back to the snapshot's
                self.states.end_snapshot(slot, restore_into=req.state_slot)
                req.num_computed_tokens = num_before
            else:
                self.states.end_snapshot(slot)
                if blocks.enable_prefix_caching and req.is_cacheable:
                    self.states.save(req, is_decode=True)
        if blocks.enable_prefix_caching and req.is_cacheable:
            req.num_published_blocks = blocks.publish_full_blocks(
                req.block_ids, req.block_hashes, req.num_published_blocks, req.num_computed_tokens)
        blocks.trim(req.block_ids, req.num_computed_tokens)  # as a plain decode leaves them

    def num_paused(self, running: Iterable[Request]) -> int:
        return sum(1 for r in running if r.spec_state is not None and r.spec_state.paused_until > self.steps)

    def stats(self, running: Iterable[Request]) -> dict:
        """EngineStats.extra["spec"]: vLLM's spec_decode counters and why drafting is off where it is."""
        c = self.counters
        return {"num_drafts": c.num_drafts, "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens, "accepted_per_pos": list(c.accepted_per_pos),
                "num_steps_off_by_batch": c.num_steps_off_by_batch, "num_pauses": c.num_pauses,
                "num_paused_rows": self.num_paused(running), "off_reason": self.off_reason,
                **({"policy": self.policy.stats()} if self.policy is not None else {})}


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step, a token each, as one output: tokens and logprobs in order, the
    prompt logprobs of the first, the end and counts of the last."""
    if len(outs) == 1:
        return outs[0]
    first, last = outs[0], outs[-1]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [entry for o in outs for entry in (o.logprobs or ())]
    return RequestOutput(
        last.request_id, [t for o in outs for t in o.new_token_ids], finished=last.finished,
        finish_reason=last.finish_reason, stop_reason=last.stop_reason, logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs, num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens)
