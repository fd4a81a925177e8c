"""Decode attention over a long cached context on a CPU: one query token per sequence, K and V read straight
from the block pool a chunk at a time, upcast to float32 in a cache-sized buffer, scores and weights in float32.

Used by torch_backend.paged_attention; knows nothing of models. On a GPU the fused SDPA (or triton) is faster.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

# A decode step whose longest context reaches this many tokens takes this path (on a CPU). Below it the reads are
# small either way, and the batched SDPA is one op a layer where this is a few per chunk.
LONG_DECODE_TOKENS = 2048
# Tokens per chunk: a chunk's float32 K (or V) copy, 512 x 2 heads x 256 x 4 bytes = 1 MiB for Qwen3.5 (2 MiB for
# Qwen3's 8 x 128), is read by its product while still in cache. 0.8B at 32k tokens, two threads on a loaded
# box: 512 and 2,048 within noise of each other, 1,024 no better.
CHUNK_TOKENS = 512


@dataclass(slots=True)
class Chunk:
    start: int  # first token of the chunk in its sequence
    num_tokens: int
    first_block: int | None  # the chunk's blocks are first_block, first_block + 1, ...: read as a view of the pool
    blocks: torch.Tensor | None  # else their ids, gathered


@dataclass(slots=True)
class LongDecode:
    token: int  # the decode's row in the step's token batch
    seq_len: int
    chunks: list[Chunk]


def plan_long_decodes(block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                      block_size: int) -> list[LongDecode]:
    """Each one-token sequence's chunks, in batch order: built once a step (host ints) and shared by every layer.

    A run of consecutive block ids is read in place, as a view of the pool; the allocator hands a sequence that
    grows alone consecutive blocks, so long contexts mostly need no gather at all."""
    per_chunk = max(1, CHUNK_TOKENS // block_size)
    tables = block_tables.cpu()
    plans = []
    for i in range(len(seq_lens)):
        if query_start_loc[i + 1] - query_start_loc[i] != 1:
            continue
        seq_len = seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        row = tables[i, :num_blocks]
        ids = row.tolist()
        chunks = []
        for b in range(0, num_blocks, per_chunk):
            part = ids[b:b + per_chunk]
            start = b * block_size
            n = min(seq_len, start + len(part) * block_size) - start
            if part == list(range(part[0], part[0] + len(part))):
                chunks.append(Chunk(start, n, part[0], None))
            else:
                chunks.append(Chunk(start, n, None, row[b:b + per_chunk].to(block_tables.device)))
        plans.append(LongDecode(query_start_loc[i], seq_len, chunks))
    return plans


def _chunk_rows(cache: torch.Tensor, chunk: Chunk, gathered: torch.Tensor | None) -> torch.Tensor:
    """The chunk's K or V as stored: [num_tokens, kv_heads, D], a view of the pool or of a gather into `gathered`."""
    if chunk.first_block is not None:
        count = -(-chunk.num_tokens // cache.shape[1])
        rows = cache[chunk.first_block:chunk.first_block + count]
    else:
        flat = cache.view(cache.shape[0], -1)
        out = gathered[:chunk.blocks.numel() * flat.shape[1]].view(chunk.blocks.numel(), -1)
        rows = torch.index_select(flat, 0, chunk.blocks, out=out).view(-1, *cache.shape[1:])
    return rows.flatten(0, 1)[:chunk.num_tokens]


class _Pass:
    """One thread's share of a layer's long decodes: a contiguous run of each decode's chunks, with its own
    buffers. scores() writes their scores, values() their weighted sum of V; between the two the caller turns
    the whole scores into weights."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, shares: list[list[Chunk]],
                 device: torch.device) -> None:
        self.k_cache, self.v_cache, self.shares = k_cache, v_cache, shares
        chunks = [c for share in shares for c in share]
        longest = max((c.num_tokens for c in chunks), default=0)
        # [tokens, kv_heads, D] float32: each chunk's K, then its V, upcast here (a contiguous streaming copy)
        self.upcast = torch.empty(longest, *k_cache.shape[2:], dtype=torch.float32, device=device)
        gathers = [c.blocks.numel() for c in chunks if c.blocks is not None]
        self.gathered = (torch.empty(max(gathers) * k_cache[0].numel(), dtype=k_cache.dtype, device=device)
                         if gathers else None)

    def scores(self, queries: list[torch.Tensor], scores: list[torch.Tensor]) -> None:
        """queries[d]: [kv_heads, group, D] float32, scaled; scores[d]: [kv_heads, group, seq_len], filled here
        at this share's tokens."""
        for qh, out, share in zip(queries, scores, self.shares):
            for chunk in share:
                k = self.upcast[:chunk.num_tokens].copy_(_chunk_rows(self.k_cache, chunk, self.gathered))
                out[:, :, chunk.start:chunk.start + chunk.num_tokens] = torch.bmm(qh, k.permute(1, 2, 0))

    def values(self, weights: list[torch.Tensor], out: torch.Tensor) -> None:
        """out[d] ([kv_heads, group, D] float32) = this share's weights times V."""
        for d, (w, share) in enumerate(zip(weights, self.shares)):
            for chunk in share:
                v = self.upcast[:chunk.num_tokens].copy_(_chunk_rows(self.v_cache, chunk, self.gathered))
                out[d].baddbmm_(w[:, :, chunk.start:chunk.start + chunk.num_tokens], v.transpose(0, 1))


def _on_helper(inference: bool, method, *args) -> None:
    """A _Pass method on the helper thread, one intra-op thread, under the caller's inference mode (thread-local:
    the runner's tensors are inference tensors, which only inference mode may write)."""
    torch.set_num_threads(1)  # as the caller set for the duration; again here in case the count is kept per thread
    with torch.inference_mode(inference):
        method(*args)


_helper: ThreadPoolExecutor | None = None


def long_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plans: list[LongDecode],
                          scale: float) -> torch.Tensor:
    """Attention of each planned decode's query over its whole context. q: [num_tokens, heads, D] ->
    [num_decodes, heads, D] in q's dtype, in plan order.

    Two passes over the chunks: every score first (float32 [kv_heads, group, seq_len], 1 MiB at 32k tokens for
    Qwen3.5), one exact softmax, then the weighted sum of V. Scores and weights stay float32 (the fused CPU SDPA
    rounds its weights to bf16 before the V product); the pool's bf16 values are exact in float32. GQA: each KV
    head's `group` query heads are one [group, D] operand, so no K/V is repeated per query head.

    Threads: with two or more intra-op threads, each decode's chunks are split in two runs, one for this thread
    and one for a helper, each running its ops on one intra-op thread, and the two meet twice a layer (after the
    scores, after the sums). With torch's own threads each of the hundred-odd small ops a layer ends in an
    OpenMP barrier, and on a loaded 2-core box a barrier waits out a descheduled thread while the other spins
    (0.8B at 32k tokens, load 12: 455 ms and 146 ms of CPU a layer, against 100 ms and 25 ms on one thread).
    """
    global _helper
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    queries = [q[plan.token].view(num_kv_heads, group, head_dim).float() * scale for plan in plans]
    scores = [torch.empty(num_kv_heads, group, plan.seq_len, dtype=torch.float32, device=device) for plan in plans]
    threads = torch.get_num_threads()
    split = threads > 1 and any(len(plan.chunks) > 1 for plan in plans)
    halves = [(len(plan.chunks) + 1) // 2 if split else len(plan.chunks) for plan in plans]
    mine = _Pass(k_cache, v_cache, [plan.chunks[:h] for plan, h in zip(plans, halves)], device)
    theirs = _Pass(k_cache, v_cache, [plan.chunks[h:] for plan, h in zip(plans, halves)], device) if split else None
    sums = torch.zeros(2 if split else 1, len(plans), num_kv_heads, group, head_dim, dtype=torch.float32,
                       device=device)
    inference = torch.is_inference_mode_enabled()
    torch.set_num_threads(1)
    try:
        if split and _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="rawserve-attention")
        other = _helper.submit(_on_helper, inference, theirs.scores, queries, scores) if split else None
        mine.scores(queries, scores)
        if other is not None:
            other.result()
        weights = [s.softmax(-1) for s in scores]
        other = _helper.submit(_on_helper, inference, theirs.values, weights, sums[1]) if split else None
        mine.values(weights, sums[0])
        if other is not None:
            other.result()
    finally:
        torch.set_num_threads(threads)
    return sums.sum(0).view(len(plans), num_heads, head_dim).to(q.dtype)
