"""AttentionMetadata: where one step's new tokens go in the paged KV cache and what each sequence sees.

Built once per step by the model runner and shared by every layer; holds no model state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    # Sequences are laid out in order in the flattened token batch.
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0 past each sequence's blocks
    # Host copies, so the torch backend can plan without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # The sequences that decode one token this step, batched together by the torch backend. Their
    # block list and mask are built once per step here, not again in each layer.
    decode_token_ids: torch.Tensor  # [num_decodes] int64 indices into the token batch
    max_decode_len: int  # longest context among the decodes
    decode_blocks: torch.Tensor  # [num_decodes * ceil(max_decode_len / block_size)] int64 block ids
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_decode_len] bool: slot < the sequence's length
    prefill_seq_ids: list[int]  # sequences with more than one new token
    block_size: int
