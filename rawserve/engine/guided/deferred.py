"""Deferred samples: constrained rows whose forward ran but whose grammar mask is still being built keep their
logits row and sample in a later step, so one cold mask never holds up the batch.

Core side. EngineCore owns one (without speculative decoding); the scheduler leaves a row that holds one out.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rawserve.engine.guided.matcher import GuidedRegistry
from rawserve.engine.request import Request, RequestStatus
from rawserve.engine.types import RequestOutput

# After the forward, a row whose mask is still building is waited for up to this share of the forward's time before
# it is deferred: most cold masks finish within it (a deferred row whose mask is not built by the next step's start
# misses that step's forward, which costs batch-32 throughput), and the other rows' inter-token gap grows by at most
# this much.
GRACE_FRACTION = 0.1


class DeferredSamples:
    """Per request, the logits row ([V] float32, a copy) of the position it has not sampled yet.

    A row holding one has its KV computed up to its last token and nothing to run, so the scheduler skips it
    (EngineCore gives it `holds` as Scheduler.ready's negation). A preempted row's is dropped: it computes its
    sequence again and gets fresh logits for the same position.
    """

    def __init__(self) -> None:
        self._rows: dict[Request, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def holds(self, req: Request) -> bool:
        return req in self._rows

    def drop(self, req: Request) -> None:
        self._rows.pop(req, None)

    def split(self, logits: torch.Tensor, reqs: list[Request], registry: GuidedRegistry, grace_s: float = 0.0
              ) -> tuple[torch.Tensor, list[Request]]:
        """The step's sampling rows (logits [len(reqs), V], row i for reqs[i]) -> the rows to sample now: those
        whose mask is ready (or unconstrained), then the deferred rows whose mask became ready since. A row whose
        mask is not ready after grace_s is kept here, its mask queued on the helper thread
        (GuidedRegistry.is_ready)."""
        rows = self._rows
        if not rows and all(req.guided is None for req in reqs):
            return logits, reqs
        if grace_s > 0:
            registry.wait_built([req.guided for req in reqs if req.guided is not None], grace_s)
        keep: list[int] = []
        for i, req in enumerate(reqs):
            rows.pop(req, None)  # fresh logits for the same position: a preempted row computed again
            if req.guided is None or registry.is_ready(req.guided):
                keep.append(i)
            else:
                rows[req] = logits[i].clone()  # the step's logits are the runner's reused buffer
        later: list[Request] = []
        for req in list(rows):
            if req.status is not RequestStatus.RUNNING:  # preempted (its KV dropped) or ended
                del rows[req]
            elif registry.is_ready(req.guided):
                later.append(req)
        if rows:  # the grammars of rows that sit out, unless a sampling row uses them, go back to the helper now
            release_idle_grammars(registry, rows, [reqs[i] for i in keep] + later)
        if len(keep) == len(reqs) and not later:
            return logits, reqs
        if len(keep) < len(reqs):
            logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
        if later:
            logits = torch.cat([logits, torch.stack([rows.pop(req) for req in later])])
        return logits, [reqs[i] for i in keep] + later


def release_idle_grammars(registry: GuidedRegistry, sitting: Iterable[Request], sampling: list[Request]) -> None:
    """is_ready claimed each row's grammar for the step; a row that sits out will not touch its grammar again
    this step, so the helper builds its mask while the step samples the others (the sampler's torch ops release
    the GIL): most then sample at the next step's start and make its forward, instead of missing it."""
    used = {req.guided.runtime for req in sampling if req.guided is not None}
    registry.release(req.guided for req in sitting if req.guided.runtime not in used)


def merge_outputs(first: list[RequestOutput], then: list[RequestOutput]) -> list[RequestOutput]:
    """One step's outputs when deferred rows sampled before its forward (`first`) and some sampled again after
    it (`then`): one output per request, its tokens in order."""
    later = {out.request_id: out for out in then}
    merged = []
    for out in first:
        after = later.get(out.request_id)
        if after is None:
            merged.append(out)
            continue
        after.new_token_ids = out.new_token_ids + after.new_token_ids
        if out.logprobs is not None or after.logprobs is not None:
            after.logprobs = (out.logprobs or []) + (after.logprobs or [])
        if after.prompt_logprobs is None:
            after.prompt_logprobs = out.prompt_logprobs
    return merged + then
