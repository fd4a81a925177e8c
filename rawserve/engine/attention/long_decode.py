"""Decode attention over a long cached context on a CPU: one query token per sequence, K and V read straight
from the block pool (a view of each run of consecutive blocks, a gather only where blocks are scattered), the
products in the cache's own dtype, the softmax and its normaliser in float32.

Used by torch_backend.paged_attention; knows nothing of models. On a GPU the fused SDPA (or triton) is faster.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

# A decode step whose longest context reaches this many tokens takes this path (on a CPU). Below it the reads are
# small either way, and the batched SDPA is one op a layer where this is a few per run of blocks.
LONG_DECODE_TOKENS = 2048
# Tokens per copied piece: scattered blocks are gathered (and a cache stored in another dtype than the queries,
# fp8, is converted) this many at a time, into a buffer still in cache when its product reads it. A run of
# consecutive blocks is read in place whatever its length: one product per KV head over the whole run (0.8B, a
# decode step after 32k tokens, one thread, load 4-5, bests of 8 interleaved: the 6 layers' attention 96 ms; in
# pieces of 512 tokens, both heads per piece, 144; of 2,048 77, of 8,192 66: within the box's noise of the whole).
CHUNK_TOKENS = 512
# ... or whose decodes' padded batch (decodes x longest context) reaches this many tokens, the longest at least
# BATCH_MIN_TOKENS: the batched SDPA gathers and attends over every decode's padded context, where this path reads
# each context where it lies (0.8B's attention layer, bf16, one thread, load 9: 32 decodes of 1,024 tokens 34
# against 161 ms, 16 of 512 4 against 9; 8 of 512 and 32 of 256 even). Below that its ops per decode cost more
# than they save (32 of 64 tokens: 12.5 against 1.4 ms).
BATCH_LONG_TOKENS = 8192
BATCH_MIN_TOKENS = 512
# With two or more intra-op threads a layer's decodes are split between this thread and a helper from this many
# context tokens in all: below it the hand-over to the helper costs more than the half it takes (0.8B, one
# layer, load 8-9: 8k tokens 1.4 ms on one thread, 2.6 split; 32k 26-28 against 11-16).
SPLIT_TOKENS = 16384


def takes_long_path(num_decodes: int, max_decode_len: int) -> bool:
    """Whether a CPU step's decodes are read by this path rather than the batched SDPA."""
    return max_decode_len >= LONG_DECODE_TOKENS or (
        max_decode_len >= BATCH_MIN_TOKENS and num_decodes * max_decode_len >= BATCH_LONG_TOKENS)


@dataclass(slots=True)
class Chunk:
    start: int  # first token of the chunk in its sequence
    num_tokens: int
    first_block: int | None  # the chunk's blocks are first_block, first_block + 1, ...: read as a view of the pool
    blocks: torch.Tensor | None  # else their ids (at most CHUNK_TOKENS worth), gathered


@dataclass(slots=True)
class LongDecode:
    token: int  # the decode's row in the step's token batch
    seq_len: int
    chunks: list[Chunk]


def plan_long_decodes(block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                      block_size: int) -> list[LongDecode]:
    """Each one-token sequence's chunks, in batch order: built once a step (host ints) and shared by every layer.

    A run of at least CHUNK_TOKENS worth of consecutive block ids is one chunk read in place; the allocator hands a
    sequence that grows alone consecutive blocks, so a long context is mostly one or a few views. Shorter runs
    are gathered, CHUNK_TOKENS worth at a time."""
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
        chunks: list[Chunk] = []
        pending = 0  # first block of the scattered blocks not yet in a chunk (they end where the scan is)

        def add(first: int, end: int, in_place: bool) -> None:
            start = first * block_size
            n = min(seq_len, end * block_size) - start
            if in_place:
                chunks.append(Chunk(start, n, ids[first], None))
            else:
                chunks.append(Chunk(start, n, None, row[first:end].to(block_tables.device)))

        b = 0
        while b < num_blocks:
            end = b + 1
            while end < num_blocks and ids[end] == ids[end - 1] + 1:
                end += 1
            if end - b >= per_chunk:
                for g in range(pending, b, per_chunk):
                    add(g, min(b, g + per_chunk), False)
                add(b, end, True)
                pending = end
            b = end
        for g in range(pending, num_blocks, per_chunk):
            add(g, min(num_blocks, g + per_chunk), False)
        plans.append(LongDecode(query_start_loc[i], seq_len, chunks))
    return plans


def _split(chunks: list[Chunk], at: int, block_size: int) -> tuple[list[Chunk], list[Chunk]]:
    """The chunks before token `at` and from it, a chunk read in place cut at the block edge at or after `at`
    (a gathered one goes whole to the side its start is on)."""
    first, second = [], []
    for chunk in chunks:
        end = chunk.start + chunk.num_tokens
        if end <= at or (chunk.first_block is None and chunk.start < at):
            first.append(chunk)
        elif chunk.start >= at:
            second.append(chunk)
        else:
            cut = -(-(at - chunk.start) // block_size)  # blocks of the chunk before the cut
            head = cut * block_size
            if head >= chunk.num_tokens:
                first.append(chunk)
                continue
            first.append(Chunk(chunk.start, head, chunk.first_block, None))
            second.append(Chunk(chunk.start + head, chunk.num_tokens - head, chunk.first_block + cut, None))
    return first, second


class _Pass:
    """One thread's share of a layer's long decodes: for each decode, a contiguous run of its chunks, and the
    buffers its copies go to. run() leaves per decode the share's score maximum, the sum of its exponentials and
    their (unnormalised) weighted sum of V, for the caller to merge."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, shares: list[list[Chunk]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.k_cache, self.v_cache, self.shares, self.dtype = k_cache, v_cache, shares, dtype
        self.converts = k_cache.dtype != dtype
        chunks = [c for share in shares for c in share]
        gathers = [c.blocks.numel() for c in chunks if c.blocks is not None]
        self.gathered = (torch.empty(max(gathers) * k_cache[0].numel(), dtype=k_cache.dtype, device=device)
                         if gathers else None)
        # [tokens, kv_heads, D] in the queries' dtype: a piece of a cache stored in another dtype (fp8), converted
        pieces = [min(c.num_tokens, CHUNK_TOKENS) if c.first_block is not None else c.num_tokens for c in chunks]
        self.converted = (torch.empty(max(pieces), *k_cache.shape[2:], dtype=dtype, device=device)
                          if self.converts and pieces else None)
        self.results: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []

    def _pieces(self, cache: torch.Tensor, share: list[Chunk]):
        """(offset in the share, rows [n, kv_heads, D] in the compute dtype) over the share's chunks: a view of
        the pool where the chunk is read in place and stored in that dtype, else a copy in this pass's buffers."""
        offset = 0
        for chunk in share:
            if chunk.first_block is not None:
                count = -(-chunk.num_tokens // cache.shape[1])
                rows = cache[chunk.first_block:chunk.first_block + count].flatten(0, 1)[:chunk.num_tokens]
                if not self.converts:
                    yield offset, rows
                else:
                    for a in range(0, chunk.num_tokens, CHUNK_TOKENS):
                        part = rows[a:a + CHUNK_TOKENS]
                        yield offset + a, self.converted[:part.shape[0]].copy_(part)
            else:
                flat = cache.view(cache.shape[0], -1)
                out = self.gathered[:chunk.blocks.numel() * flat.shape[1]].view(chunk.blocks.numel(), -1)
                rows = torch.index_select(flat, 0, chunk.blocks, out=out).view(-1, *cache.shape[1:])
                rows = rows.flatten(0, 1)[:chunk.num_tokens]
                yield offset, (self.converted[:chunk.num_tokens].copy_(rows) if self.converts else rows)
            offset += chunk.num_tokens

    def run(self, queries: list[torch.Tensor], scale: float) -> None:
        """queries[d]: [kv_heads, group, D] in the compute dtype. Per head a 2-D product over each piece: the
        pool's rows of one head are a strided matrix BLAS reads in place, where a batched product over heads is
        many times slower on a CPU (torch 2.13, bf16: 324 against 23 ms at 32k tokens)."""
        self.results = []
        for qh, share in zip(queries, self.shares):
            num_tokens = sum(c.num_tokens for c in share)
            if not num_tokens:
                self.results.append(None)
                continue
            num_kv_heads, group, head_dim = qh.shape
            # [kv_heads, group, tokens]: q.k rounded to the compute dtype, as transformers' eager attention does
            scores = torch.empty(num_kv_heads, group, num_tokens, dtype=self.dtype, device=qh.device)
            for offset, k in self._pieces(self.k_cache, share):
                for h in range(num_kv_heads):
                    torch.mm(qh[h], k[:, h].t(), out=scores[h, :, offset:offset + k.shape[0]])
            weights = scores.float().mul_(scale)  # float32 from here to the normaliser
            top = weights.amax(-1, keepdim=True)
            weights = weights.sub_(top).exp_()
            total = weights.sum(-1, keepdim=True)
            if self.dtype != torch.float32:
                weights = weights.to(self.dtype)  # in [0, 1], each rounded once for the V product
            sums = torch.zeros(num_kv_heads, group, head_dim, dtype=torch.float32, device=qh.device)
            for offset, v in self._pieces(self.v_cache, share):
                for h in range(num_kv_heads):
                    w = weights[h, :, offset:offset + v.shape[0]]
                    if self.dtype == torch.float32:
                        sums[h].addmm_(w, v[:, h])
                    else:
                        sums[h] += torch.mm(w, v[:, h])
            self.results.append((top, total, sums))


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

    The products run in q's dtype over the pool as stored (bf16: oneDNN accumulates in float32 and rounds each
    score and each piece's weighted sum to bf16), so a bf16 cache is never upcast: the float32 upcast this path
    did before cost 4-14x the bf16 products at 32k tokens. The scores' softmax and its normaliser stay float32
    (transformers' eager attention rounds the weights to bf16 after normalising; here the unnormalised ones are
    rounded and the float32 sum divides at the end). A float32 cache computes in float32 throughout. GQA: each
    KV head's `group` query heads are one [group, D] operand, so no K/V is repeated per query head.

    Threads: with two or more intra-op threads and SPLIT_TOKENS of context, the decodes' tokens are cut in two
    halves, one for this thread and one for a helper, each on one intra-op thread; the decode across the cut has
    each half's softmax run over its own scores, merged by their maxima (flash-decoding's split), so the threads
    meet once a layer. With torch's own threads each small op ends in an OpenMP barrier, and on a loaded 2-core
    box a barrier waits out a descheduled thread while the other spins (one layer at 32k tokens, load 9: 34 ms
    on torch's two threads, 26 on one, 11-16 split with the helper; bests of 25).
    """
    global _helper
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    device, dtype = q.device, q.dtype
    block_size = k_cache.shape[1]
    queries = [q[plan.token].view(num_kv_heads, group, head_dim) for plan in plans]
    threads = torch.get_num_threads()
    total = sum(plan.seq_len for plan in plans)
    split = threads > 1 and total >= SPLIT_TOKENS
    # One cut in the decodes' tokens laid end to end: whole decodes on either side, the one across it split
    halves, offset = [], 0
    for plan in plans:
        at = total // 2 - offset if split else plan.seq_len
        halves.append(_split(plan.chunks, min(max(at, 0), plan.seq_len), block_size))
        offset += plan.seq_len
    mine = _Pass(k_cache, v_cache, [first for first, _ in halves], dtype, device)
    theirs = _Pass(k_cache, v_cache, [second for _, second in halves], dtype, device) if split else None
    inference = torch.is_inference_mode_enabled()
    torch.set_num_threads(1)
    try:
        if split and _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="rawserve-attention")
        other = _helper.submit(_on_helper, inference, theirs.run, queries, scale) if split else None
        mine.run(queries, scale)
        if other is not None:
            other.result()
        out = torch.empty(len(plans), num_kv_heads, group, head_dim, dtype=torch.float32, device=device)
        for d in range(len(plans)):
            parts = [p.results[d] for p in (mine, theirs) if p is not None and p.results[d] is not None]
            if len(parts) == 1:
                _, total, sums = parts[0]
                torch.div(sums, total, out=out[d])
            else:
                (top_a, total_a, sums_a), (top_b, total_b, sums_b) = parts
                top = torch.maximum(top_a, top_b)
                a, b = (top_a - top).exp_(), (top_b - top).exp_()
                torch.div(sums_a * a + sums_b * b, total_a * a + total_b * b, out=out[d])
    finally:
        torch.set_num_threads(threads)
    return out.view(len(plans), num_heads, head_dim).to(dtype)
