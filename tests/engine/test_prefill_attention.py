"""Prefill chunks after cached context in the torch backend (torch_backend._chunk_after_context): the chunk over the
context and over itself, merged by log-sum-exp, equals masked attention over both, at chunk and block edges."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rawserve.engine.attention import torch_backend
from rawserve.engine.step_plan import StepInput
from tests.engine.test_long_decode import BLOCK, GROUP, HEAD_DIM, KV_HEADS, filled_cache
from tests.engine.test_qwen35_model import attention_metadata


def masked_reference(q: torch.Tensor, k_cache, v_cache, seq: StepInput) -> torch.Tensor:
    """One chunk's attention in float64 with the explicit mask (query i at position context + i sees keys up to
    it), GQA expanded: [q_len, heads, D]."""
    context, q_len = seq.num_computed_tokens, len(seq.token_ids)
    seq_len = context + q_len
    k = k_cache[seq.block_table].flatten(0, 1)[:seq_len].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    v = v_cache[seq.block_table].flatten(0, 1)[:seq_len].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    mask = torch.arange(seq_len).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + context
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask, scale=HEAD_DIM ** -0.5)
    return o.transpose(0, 1)


def run(seqs: list[StepInput], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, tuple, list[int]]:
    k_cache, v_cache = filled_cache(dtype, seed=seed)
    num_tokens = sum(len(s.token_ids) for s in seqs)
    q = torch.randn(num_tokens, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(dtype)
    meta = attention_metadata(seqs, BLOCK)[0]
    out = torch_backend.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    return out, (q, k_cache, v_cache), meta.query_start_loc_cpu


# Chunks after 1 cached token, after a context ending mid-block, after one ending on a block edge, a 2-token chunk
# (the shortest a prefill row gets), a chunk that starts mid-block and runs over scattered blocks, a cold prompt
# and a decode beside them.
SEQS = [StepInput([1] * 6, 1, [3, 4]),
        StepInput([2] * 5, 7, [10, 11, 12]),
        StepInput([3] * 9, 8, [20, 21, 22, 23, 24]),
        StepInput([4] * 2, 13, [30, 31, 32, 33]),
        StepInput([5] * 11, 10, [41, 7, 55, 48, 50, 60]),
        StepInput([6] * 7, 0, [61, 62]),
        StepInput([7], 9, [13, 14, 15])]


def test_chunks_after_context_equal_masked_attention_in_float32():
    out, (q, k_cache, v_cache), starts = run(SEQS, torch.float32, seed=0)
    for i, seq in enumerate(SEQS):
        if len(seq.token_ids) == 1:
            continue
        rows = slice(starts[i], starts[i + 1])
        expected = masked_reference(q[rows], k_cache, v_cache, seq)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunks_after_context_in_half_precision_round_like_the_masked_call(dtype):
    # The two outputs are merged in float32 and rounded once more: within a step or two of the masked call's.
    out, (q, k_cache, v_cache), starts = run(SEQS, dtype, seed=2)
    for i, seq in enumerate(SEQS[:5]):
        rows = slice(starts[i], starts[i + 1])
        expected = masked_reference(q[rows], k_cache, v_cache, seq)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-2, rtol=2e-2)
