"""The triton attention backend: the torch backend's two calls (write_kv, paged_attention) on triton kernels.

Graph-safe for pure decode batches: it reads only device tensors and host ints fixed by the metadata.
"""
from __future__ import annotations

import torch

from rawserve.engine.attention import triton_kernels
from rawserve.engine.attention.metadata import AttentionMetadata

write_kv = triton_kernels.write_kv


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (this step's K/V already written).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    """
    out = torch.empty_like(q)
    if meta.prefill_seq_ids:
        triton_kernels.prefill_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, meta.prefill_seqs, meta.max_prefill_len, scale)
    triton_kernels.decode_attention(q, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                    meta.decode_token_ids, meta.decode_seq_ids, scale, meta.decode_num_splits)
    return out
