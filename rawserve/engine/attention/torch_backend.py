"""Portable paged attention in plain torch (CPU and CUDA): cache writes, prefill and batched decode.

It is also the reference the triton kernels are checked against, so it favours clarity over speed
where the two conflict; decodes are batched because they dominate steady-state serving.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rawserve.engine.attention import long_decode
from rawserve.engine.attention.kv_dtype import to_cache
from rawserve.engine.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V at their slots, cast to the caches' dtype (--kv-cache-dtype; kv_dtype.to_cache).

    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim].
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k, v = to_cache(k, k_cache.dtype), to_cache(v, v_cache.dtype)
    if k_cache.element_size() == 1:  # index_copy_ has no fp8 kernel on a CPU (torch 2.13): copy the bytes
        k, v, k_cache, v_cache = (t.view(torch.uint8) for t in (k, v, k_cache, v_cache))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D] at blocks [n] -> [n, block_size, H, D] (a copy), written into the
    start of the flat buffer `out` when given.

    index_select over a 2-D view ([num_blocks, block_size * H * D]): each block is then one contiguous row
    copy, several times faster on CPU than over the 4-D tensor, and 2-4x faster than indexing the view with
    `[blocks]` (torch 2.13, 9 to 288 blocks, float32 and bf16). A reused `out` (the runner's, on a CPU) costs no
    allocation per layer: under glibc's default policy a gather past its mmap ceiling was mapped and zero-filled
    at every layer (0.6B bf16, 32 x 1,024 tokens: a decode step 868 against 2,290 ms); with the heap the CPU
    engine keeps (process_stats.keep_freed_heap) most of that is gone, and the reused buffer still saves 2-13%
    of a 32-sequence step.
    """
    rows = cache.view(cache.shape[0], -1)
    if out is None:
        rows = rows.index_select(0, blocks)
    else:
        rows = torch.index_select(rows, 0, blocks, out=out[:blocks.numel() * rows.shape[1]].view(blocks.numel(), -1))
    return rows.view(blocks.shape[0], *cache.shape[1:])


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int, out: torch.Tensor | None) -> torch.Tensor:
    """The first `length` slots of a sequence's blocks: [length, H, D]."""
    return gather_blocks(cache, blocks, out).flatten(0, 1)[:length]


def read_dtype(activation_dtype: torch.dtype, num_heads: int, num_kv_heads: int, device: torch.device
               ) -> torch.dtype:
    """The dtype decode attention reads K/V in: the activation dtype, but float32 for a half-precision model
    without GQA on a CPU (see paged_attention's one-row note)."""
    if num_heads == num_kv_heads and device.type == "cpu" and activation_dtype != torch.float32:
        return torch.float32
    return activation_dtype


def _read_as(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """x (K or V as stored) in the dtype attention computes in: itself when it is stored so, else an upcast copy,
    written into the start of the flat byte buffer `out` when that is large enough (the runner's, reused across
    layers and steps, as the gathers' are)."""
    if x.dtype == dtype:
        return x
    num_bytes = x.numel() * dtype.itemsize
    if out is None or out.numel() < num_bytes:
        return x.to(dtype)
    return out[:num_bytes].view(dtype).view(x.shape).copy_(x)


def _chunk_after_context(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, context: int, scale: float
                         ) -> torch.Tensor:
    """A prefill chunk's attention over `context` cached tokens and its own, on a CPU: the chunk over the context
    unmasked and over itself causal, two fused calls merged by their log-sum-exps (exact: softmax over the union
    of two key sets). One masked call over both makes the fused kernel compute the masked half of the chunk's own
    keys and read the mask: 0.8B, a 2,048-token chunk after 2,048, bf16, one thread, load 7: 3.1-4.0 s a layer
    masked, 2.7-2.8 s split, the first chunk's causal call 1.0-1.2 s.

    qs: [1, heads, q_len, D]; ks, vs: [1, kv_heads, context + q_len, D] -> [1, heads, q_len, D] in qs's dtype.
    """
    # aten's CPU flash kernel, the one F.scaled_dot_product_attention runs here, called directly for its
    # log-sum-exp ([1, heads, q_len] float32); it takes GQA's fewer KV heads as they are
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_past, lse_past = flash(qs, ks[:, :, :context], vs[:, :, :context], 0.0, False, scale=scale)
    o_own, lse_own = flash(qs, ks[:, :, context:], vs[:, :, context:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_past, lse_own)
    w_past, w_own = (lse_past - lse).exp_().unsqueeze(-1), (lse_own - lse).exp_().unsqueeze(-1)
    return (o_past.float().mul_(w_past) + o_own.float().mul_(w_own)).to(qs.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context (this step's K/V already written).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_decodes = meta.decode_token_ids.numel()
    # A step of decodes only (every token is decode i's, in order) needs no output to scatter into: at one row
    # the scatter, the gather of q and the empty output are three of a layer's few dozen small ops.
    decode_only = num_decodes == num_tokens
    out = None if decode_only else torch.empty_like(q)
    block_size = meta.block_size
    starts = meta.query_start_loc_cpu
    k_out, v_out = meta.gather_out or (None, None)  # one pair for every gather below: each is used before the next
    k_read, v_read = meta.read_out or (None, None)  # ... and for every upcast of a gather (a cache not stored in
    # the dtype attention computes in)

    for i in meta.prefill_seq_ids:
        start, end = starts[i], starts[i + 1]
        q_len, seq_len = end - start, meta.seq_lens_cpu[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :num_blocks]
        k = _read_as(_gather(k_cache, blocks, seq_len, k_out), q.dtype, k_read)  # [seq_len, kv_heads, D]
        v = _read_as(_gather(v_cache, blocks, seq_len, v_out), q.dtype, v_read)
        # 4-D [1, heads, len, D]: with 3-D inputs torch's CPU SDPA drops to its slow math path.
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, D]
        ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len, D]
        context = seq_len - q_len  # tokens already cached before this chunk
        if context == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        elif q.device.type == "cpu":
            o = _chunk_after_context(qs, ks, vs, context, scale)
        else:
            # Query i sits at position context + i and may see keys 0..context + i.
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + context
            cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=cols <= rows, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)

    if num_decodes and q.device.type == "cpu" and long_decode.takes_long_path(num_decodes, meta.max_decode_len):
        # Long contexts: the fused CPU SDPA reads a bf16 cache at a fraction of the memory bandwidth (0.8B,
        # 32k tokens: 27 ms a layer on one core where a pass over the same bytes takes 3); a gather of every
        # decode's blocks would also copy all of them first, padded to the longest.
        if meta.long_decodes is None:
            meta.long_decodes = long_decode.plan_long_decodes(meta.block_tables, starts, meta.seq_lens_cpu,
                                                              block_size)
        o = long_decode.long_decode_attention(q, k_cache, v_cache, meta.long_decodes, scale)
        if decode_only:
            return o
        out[meta.decode_token_ids] = o
    elif num_decodes:
        token_ids, max_len = meta.decode_token_ids, meta.max_decode_len
        # [B * max_blocks, block_size, kv_heads, D] -> [B, L, kv_heads, D] as a strided view (no copy)
        if meta.decode_block_run is not None:  # one sequence on consecutive blocks: read them in place
            first, count = meta.decode_block_run, meta.decode_blocks.numel()
            k, v = k_cache[first:first + count], v_cache[first:first + count]
        else:
            k, v = gather_blocks(k_cache, meta.decode_blocks, k_out), gather_blocks(v_cache, meta.decode_blocks, v_out)
        k = k.view(num_decodes, -1, num_kv_heads, head_dim)[:, :max_len]
        v = v.view(num_decodes, -1, num_kv_heads, head_dim)[:, :max_len]
        # GQA folded into query rows: each KV head's `group` query heads are its queries [B, kv_heads, group, D],
        # one mask row for all of them. No K/V expansion to every query head, and a query tile of `group` rows
        # rather than one: CPU SDPA's one-row path is slow, in bf16 2-10x slower than in float32 (torch 2.13).
        group = num_heads // num_kv_heads
        qd = (q if decode_only else q[token_ids]).reshape(num_decodes, num_kv_heads, group, head_dim)
        compute = read_dtype(q.dtype, num_heads, num_kv_heads, q.device)
        if compute != q.dtype:  # one row per head: float32 on the copies gathered anyway
            qd = qd.float()
        k, v = _read_as(k, compute, k_read), _read_as(v, compute, v_read)  # [B, L, kv_heads, D]
        o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=meta.decode_mask, scale=scale)
        o = o.reshape(num_decodes, num_heads, head_dim)
        if o.dtype != q.dtype:  # the float32 read above
            o = o.to(q.dtype)
        if decode_only:
            return o
        out[token_ids] = o
    return out
