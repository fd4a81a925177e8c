"""StepPlan: one step's row layout (which logit rows come back, which are sampled, which carry prompt logprobs)."""
from __future__ import annotations

from rawserve.engine.request import Request
from rawserve.engine.step_plan import ForwardBatch, StepInput, StepPlan
from rawserve.engine.types import SamplingParams


def make(rid: str, prompt_len: int, *, computed: int = 0, prompt_logprobs: int | None = None) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    req = Request(rid, list(range(100, 100 + prompt_len)), params)
    req.num_computed_tokens = computed
    req.block_ids = [7, 8, 9]
    return req


def test_decodes_and_final_prompt_chunks_sample_their_last_row_and_partial_chunks_give_no_row():
    decode = make("decode", 5, computed=4)
    partial = make("partial", 10, computed=2)  # 3 of its remaining 8 tokens: no logits
    final = make("final", 6, computed=2)  # its last 4 tokens: sample from the last
    plan = StepPlan([(decode, 1), (partial, 3), (final, 4)])
    assert plan.batch.seqs == [StepInput([104], 4, [7, 8, 9]), StepInput([102, 103, 104], 2, [7, 8, 9]),
                               StepInput([102, 103, 104, 105], 2, [7, 8, 9])]
    assert plan.batch.logit_indices == [0, 7]  # flattened: decode at 0, partial 1..3, final 4..7
    assert plan.sample_reqs == [decode, final] and plan.sample_rows == [0, 1]
    assert plan.prompt_spans == [] and plan.samples_every_row


def test_prompt_logprob_chunks_return_every_row_and_sample_only_at_the_prompt_end():
    decode = make("decode", 5, computed=4)
    first = make("first", 10, prompt_logprobs=2)  # its first 4 tokens: 4 rows, no sample
    last = make("last", 6, computed=3, prompt_logprobs=0)  # its last 3 tokens: 3 rows, samples from the last
    plan = StepPlan([(decode, 1), (first, 4), (last, 3)])
    assert plan.batch.logit_indices == [0, 1, 2, 3, 4, 5, 6, 7]
    assert plan.sample_reqs == [decode, last] and plan.sample_rows == [0, 7]
    assert [(s.req, s.first_row, s.start, s.num_tokens) for s in plan.prompt_spans] == [(first, 1, 0, 4),
                                                                                         (last, 5, 3, 3)]
    assert not plan.samples_every_row


def test_forward_batch_helpers_pick_last_or_every_token():
    seqs = [StepInput([1, 2, 3], 0, [0]), StepInput([4], 9, [1])]
    assert ForwardBatch.last_tokens(seqs).logit_indices == [2, 3]
    assert ForwardBatch.every_token(seqs).logit_indices == [0, 1, 2, 3]
