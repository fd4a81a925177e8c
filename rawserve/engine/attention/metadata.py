"""AttentionMetadata: where one step's new tokens go in the paged KV cache and what each sequence sees.

Built once per step by the model runner and shared by every layer; holds no model state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SPLITS = 16  # split-K decode: at most this many partial results per (sequence, KV head)
MIN_SPLIT_TOKENS = 256  # ... and none shorter than this: a split's fixed cost must stay small against its reads
TARGET_PROGRAMS = 264  # decode programs worth launching: two per SM of an H100/H200 (132 SMs)


def decode_splits(num_decodes: int, num_kv_heads: int, max_context: int) -> int:
    """Split-K parts for a decode batch (a power of two): enough programs to fill a GPU at small batch,
    none covering under MIN_SPLIT_TOKENS of context. Host ints only, so graphs can fix it at capture."""
    by_programs = max(1, TARGET_PROGRAMS // max(1, num_decodes * num_kv_heads))
    by_length = max(1, max_context // MIN_SPLIT_TOKENS)
    wanted = min(MAX_SPLITS, by_programs, by_length)
    return 1 << (wanted.bit_length() - 1)  # rounded down to a power of two


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
    # The sequences that decode one token this step, and those with more than one new token.
    decode_token_ids: torch.Tensor  # [num_decodes] int64 indices into the token batch
    max_decode_len: int  # longest context among the decodes
    prefill_seq_ids: list[int]  # sequences with more than one new token
    block_size: int
    # Torch backend: the decodes' block list and mask, built once per step here, not again in each layer.
    decode_blocks: torch.Tensor | None = None  # [num_decodes * ceil(max_decode_len / block_size)] int64 block ids
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_decode_len] bool: slot < the sequence's length
    # (None for a single decode, which sees every slot up to max_decode_len)
    decode_block_run: int | None = None  # a single decode whose blocks are consecutive: the first (read as a view)
    # CPU decodes long_decode.takes_long_path picks (a long context or a large batch): each one's chunks
    # (long_decode.LongDecode), planned by the first layer that reads them and reused by the others
    long_decodes: list | None = None
    # CPU: flat K and V buffers the runner reuses across layers and steps, which the block gathers write into
    # (each at least as long as the largest gather this step); None: each gather allocates its own
    gather_out: tuple[torch.Tensor, torch.Tensor] | None = None
    # CPU, a cache stored in another dtype than attention reads (--kv-cache-dtype): flat uint8 buffers the
    # gathers are upcast into, viewed as the read dtype (torch_backend._read_as); None: each upcast allocates
    read_out: tuple[torch.Tensor, torch.Tensor] | None = None
    # Triton backend: the same selections as device index tensors, and the grid sizes (host ints).
    decode_seq_ids: torch.Tensor | None = None  # [num_decodes] int64: each decode's sequence
    prefill_seqs: torch.Tensor | None = None  # [num_prefills] int64: prefill_seq_ids on the device
    max_prefill_len: int = 0  # longest prefill chunk (new tokens)
    decode_num_splits: int = 1  # split-K parts per decode context (decode_splits)
