"""StepPlan: one step's batch layout, from the scheduler's choice: each sequence's token slice, which logit
rows the forward returns, which of them are sampled and which carry prompt logprobs.

Plain bookkeeping, no torch and no decisions: who runs is the scheduler's, what a row means is decided here once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rawserve.engine.request import Request


@dataclass(slots=True)
class StepInput:
    token_ids: list[int]  # tokens to compute this step (a prefill chunk, or the one decode token)
    num_computed_tokens: int  # tokens of this sequence already in the KV cache; positions start here
    block_table: list[int]  # KV block ids covering positions [0, num_computed_tokens + len(token_ids))
    lora_slot: int = -1  # the LoRA slot its adapter is resident in, -1 for the base model
    state_slot: int = -1  # hybrid models (Qwen3.5): its linear-attention state slot; -1 for other models
    type_split: int = -1  # encoders: tokens from this index on are the pair's second segment (token type 1)
    features: object | None = None  # the request's images (MultiModalInputs): M-RoPE positions, placeholder rows


@dataclass(slots=True)
class ForwardBatch:
    """What the model runner sees of a step: plain ids and tables, never a Request.

    The batch is the sequences' tokens flattened in order; logits row r is for flattened token
    logit_indices[r] (it predicts the token after that one).
    """

    seqs: list[StepInput]
    logit_indices: list[int]
    # Pooling requests' flattened token ranges [start, end) whose final hidden states are summed, one vector each
    # (ModelRunner.execute_pooling); empty in a step without them.
    pool_spans: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def last_tokens(cls, seqs: list[StepInput]) -> ForwardBatch:
        """One row per sequence, its last token's: what a decode, or a prompt's final chunk, samples from."""
        indices = []
        end = 0
        for seq in seqs:
            end += len(seq.token_ids)
            indices.append(end - 1)
        return cls(seqs, indices)

    @classmethod
    def every_token(cls, seqs: list[StepInput]) -> ForwardBatch:
        """A row for every token (row i predicts the token after flattened token i)."""
        return cls(seqs, list(range(sum(len(seq.token_ids) for seq in seqs))))


@dataclass(slots=True)
class PromptSpan:
    """A chunk of a prompt whose rows predict the prompt's next tokens (for prompt logprobs)."""

    req: Request
    first_row: int  # its first logits row; row first_row + j predicts the token at start + j + 1
    start: int  # tokens computed before this chunk
    num_tokens: int  # tokens in this chunk (one row each)


@dataclass(slots=True)
class SpecSpan:
    """A decode row that carries drafted tokens (speculative decoding): its last real token and the drafts run as
    one multi-token row, and each of its len(drafts) + 1 positions gets a logits row."""

    req: Request
    first_row: int  # row first_row + j predicts the token after draft j - 1 (row first_row: after the real token)
    drafts: list[int]


class StepPlan:
    """Built from the scheduler's [(request, num_new_tokens)], before the forward, read by the runner (`batch`)
    and by EngineCore (the rest). The layout per request:

    - prompt logprobs still wanted: a row per token of its chunk (a PromptSpan); it also samples, from the
      chunk's last row, when the chunk reaches the end of its tokens;
    - otherwise, a chunk that reaches the end of its tokens (a decode, or a prompt's last chunk): one row, its
      last token's, sampled;
    - otherwise (a prompt chunk that does not finish it): no row.

    A request with max_tokens 0 (scoring: prompt logprobs only) never samples: the chunk that finishes its prompt
    puts it in `scored_reqs` instead, and its last row (if any) only predicts a token nobody asked for.

    A pooling request (params.pooling) is a max_tokens 0 request that also gets a span of hidden states per chunk
    that holds tokens its method pools (`pool_reqs`, aligned with `batch.pool_spans`): the last token of the last
    chunk (last), every token of every chunk (mean, summed across chunks by EngineCore), the first token (cls).

    A decode row given more tokens than it has left (num_new past its end) runs its drafts (req.spec_tokens) after
    its real token; it samples through the verifier (`spec_spans`), not `sample_reqs`.
    """

    __slots__ = ("scheduled", "batch", "sample_reqs", "sample_rows", "prompt_spans", "scored_reqs", "pool_reqs",
                 "spec_spans")

    def __init__(self, scheduled: list[tuple[Request, int]]) -> None:
        self.scheduled = scheduled  # the scheduler's choice, in batch order
        seqs: list[StepInput] = []
        logit_indices: list[int] = []
        self.sample_reqs: list[Request] = []  # requests that get a token this step, in logits-row order
        self.sample_rows: list[int] = []  # their logits rows
        self.prompt_spans: list[PromptSpan] = []
        self.scored_reqs: list[Request] = []  # prompts finished this step that sample nothing (max_tokens 0)
        self.pool_reqs: list[tuple[Request, int]] = []  # (request, its chunk's start) per pool span
        self.spec_spans: list[SpecSpan] = []
        pool_spans: list[tuple[int, int]] = []
        sample_reqs = self.sample_reqs
        sample_rows = self.sample_rows
        offset = 0  # flattened index of this sequence's first token
        for req, num_new in scheduled:
            start = req.num_computed_tokens
            token_ids = req.token_ids
            end = min(start + num_new, len(token_ids))  # the real tokens' end; drafts run past it
            drafts = req.spec_tokens[:start + num_new - end] if start + num_new > end else None
            seqs.append(StepInput(token_ids[start:end] + drafts if drafts else token_ids[start:end], start,
                                  req.block_ids, req.lora_slot, req.state_slot))
            if req.features is not None:
                seqs[-1].features = req.features
            if req.params.pooling is not None and req.params.pooling.type_split >= 0:
                seqs[-1].type_split = req.params.pooling.type_split
            is_scoring = req.params.max_tokens == 0
            if is_scoring and end == len(token_ids):
                self.scored_reqs.append(req)
            pooling = req.params.pooling
            if pooling is not None:
                span = _pool_span(pooling.method, start, end, len(token_ids), offset)
                if span is not None:
                    self.pool_reqs.append((req, start))
                    pool_spans.append(span)
            if not req.prompt_logprobs_done:
                first_row = len(logit_indices)
                logit_indices.extend(range(offset, offset + num_new))
                self.prompt_spans.append(PromptSpan(req, first_row, start, num_new))
                if end == len(token_ids) and not is_scoring:
                    sample_reqs.append(req)
                    sample_rows.append(first_row + num_new - 1)
            elif drafts:
                self.spec_spans.append(SpecSpan(req, len(logit_indices), drafts))
                logit_indices.extend(range(offset + num_new - 1 - len(drafts), offset + num_new))
            elif end == len(token_ids) and not is_scoring:
                sample_reqs.append(req)
                sample_rows.append(len(logit_indices))
                logit_indices.append(offset + num_new - 1)
            offset += num_new
        self.batch = ForwardBatch(seqs, logit_indices, pool_spans)

    @property
    def samples_every_row(self) -> bool:
        """True when every logits row is sampled, in order (no prompt-logprob rows): no selection needed."""
        return len(self.sample_rows) == len(self.batch.logit_indices)


def _pool_span(method: str, start: int, end: int, num_tokens: int, offset: int) -> tuple[int, int] | None:
    """The flattened range of a chunk [start, end) of a sequence (its first token at `offset`) that `method` pools,
    or None when this chunk holds none of them."""
    if method == "mean":
        return offset, offset + end - start
    if method == "cls":
        return (offset, offset + 1) if start == 0 else None
    return (offset + end - start - 1, offset + end - start) if end == num_tokens else None
