"""Triton kernels for paged attention (KV write by slot, split-K decode with GQA, varlen causal prefill over the
cache), each with a plain-torch reference beside it. CPU tensors need triton's interpreter, TRITON_INTERPRET=1
set before triton is imported (its own jitted helpers, tl.max and tl.sum among them, are built in one mode then).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from rawserve.engine.attention.kv_dtype import saturation, to_cache


@triton.jit
def _to_cache(x, cache_ptr, LIMIT: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr,
              SUB_STEP: tl.constexpr):
    # Activations -> the cache's dtype through float32 (triton 3.9's interpreter converts bf16's raw bits
    # otherwise); an fp8 cache saturates at LIMIT, unscaled (kv_dtype.to_cache is the torch twin).
    x = x.to(tl.float32)
    if LIMIT > 0:
        x = tl.minimum(tl.maximum(x, -LIMIT), LIMIT)
    if MANT > 0:  # see _downcast_grid: round to the target's grid (nearest even) in float32 first
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + ((1 << (22 - MANT)) - 1) + ((bits >> (23 - MANT)) & 1)
        normal = (bits & -(1 << (23 - MANT))).to(tl.float32, bitcast=True)
        magic = 1.5 * 8388608.0 * SUB_STEP  # adding 1.5 x 2^23 steps rounds to a multiple of the step
        tiny = (tl.abs(x) + magic) - magic  # on the magnitude, so a tiny negative rounds to -0.0 as torch's does
        x = tl.where(tl.abs(x) < MIN_NORMAL, tl.where(x < 0, -tiny, tiny), normal)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
              ROW: tl.constexpr, ROW_PAD: tl.constexpr, CONVERT: tl.constexpr, LIMIT: tl.constexpr,
              MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr):
    # One program per token: its [num_kv_heads * head_dim] row goes to its slot; slot -1 is a padding row.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, ROW_PAD)
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    if CONVERT:  # --kv-cache-dtype other than the activations'
        k = _to_cache(k, k_cache_ptr, LIMIT, MANT, MIN_NORMAL, SUB_STEP)
        v = _to_cache(v, v_cache_ptr, LIMIT, MANT, MIN_NORMAL, SUB_STEP)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt, kv_head, pos,
                 seq_len, visible, scale, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, CONVERT: tl.constexpr,
                 ACT: tl.constexpr):
    # One online-softmax step: q [M, D] against the K/V tile at positions pos [N] (read through the block
    # table); visible [M, N] (or [1, N]) masks the scores. Every row must see one key by its first tile.
    d = tl.arange(0, HEAD_DIM)
    valid = pos < seq_len
    block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0)
    rows = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)  # [N, D]
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if CONVERT:  # a cache stored in another dtype (--kv-cache-dtype): read into the activations' dtype ACT,
        # through float32 (the interpreter's note in _to_cache)
        k, v = k.to(tl.float32).to(ACT), v.to(tl.float32).to(ACT)
    if UPCAST:  # see _dot_inputs_upcast
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] float32
    s = tl.where(visible & valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is rounded to the activations' dtype for the PV product, as a GPU's half-precision dot takes it.
    p = p.to(ACT).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr,
            seq_lens_ptr, token_ids_ptr, seq_ids_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
            scale, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr, CONVERT: tl.constexpr):
    # Program (decode b, KV head, split): the GROUP query heads sharing the KV head, over the split's tiles.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(token_ids_ptr + b)
    seq = tl.load(seq_ids_ptr + b)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)  # padded to 16 rows at least: tl.dot's smallest M on a GPU
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None],
                other=0.0)  # [GROUP_PAD, D]
    if UPCAST:  # see _dot_inputs_upcast
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(first, last):  # a tile in range holds one valid position at least
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt,
                                     kv_head, tile * TILE_N + n, seq_len, (n >= 0)[None, :], scale,  # all visible
                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, PRECISION, UPCAST, CONVERT,
                                     q_ptr.dtype.element_ty)
    # An empty split (or a padding row of length 0) has l_i = 0: its output is 0 and its weight exp(-inf).
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (b * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split  # [B, H, S] layout
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=(g < GROUP)[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _reduce_splits(part_out_ptr, part_lse_ptr, out_ptr, token_ids_ptr, stride_ot, stride_oh,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    # Program (decode b, head): the splits' normalised outputs weighted by exp(lse - max lse).
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row)  # [S]
    top = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # all -inf (a padding row): every weight 0
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :])  # [S, D]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tok = tl.load(token_ids_ptr + b)
    tl.store(out_ptr + tok * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
             seq_ids_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, scale,
             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             TILE_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
             CONVERT: tl.constexpr):
    # Program (prefill sequence i, query head, query tile): causal attention of TILE_M new tokens over the
    # cache, which holds the context (earlier chunks, prefix-cache hits) and this step's K/V already.
    seq = tl.load(seq_ids_ptr + tl.program_id(0))
    h = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # query j sits at position context + j and sees keys 0..context + j

    m = m_tile * TILE_M + tl.arange(0, TILE_M)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, TILE_N)
    m_valid = m < q_len
    kv_head = h // GROUP
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_valid[:, None],
                other=0.0)  # [TILE_M, D]
    if UPCAST:  # see _dot_inputs_upcast
        q = q.to(tl.float32)
    # Keys past this tile's last query are never seen; a tile past the chunk's end reads nothing.
    key_end = tl.minimum(context + (m_tile + 1) * TILE_M, seq_len)
    num_tiles = tl.where(m_tile * TILE_M < q_len, tl.cdiv(key_end, TILE_N), 0)
    m_i = tl.full([TILE_M], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    for tile in range(0, num_tiles):  # key 0 is visible to every row
        pos = tile * TILE_N + n
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt,
                                     kv_head, pos, seq_len, pos[None, :] <= (context + m)[:, None], scale,
                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, PRECISION, UPCAST, CONVERT,
                                     q_ptr.dtype.element_ty)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def interpreted() -> bool:
    """Whether triton was imported under TRITON_INTERPRET=1 (kernels then run on CPU tensors, slowly)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older ones read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreted():
        raise RuntimeError("triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")


def _dot_inputs_upcast(dtype: torch.dtype) -> bool:
    """Under the interpreter, half-precision dot inputs go to float32 first: triton 3.9's interpreter
    multiplies bf16's raw uint16 bits in tl.dot. Loads, stores and the p rounding stay in the cache dtype."""
    return interpreted() and dtype != torch.float32


def _downcast_grid(dtype: torch.dtype) -> tuple[int, float, float]:
    """(mantissa bits, smallest normal, subnormal step) of a cache dtype narrower than float32, under the
    interpreter; (0, 0, 0) elsewhere. triton 3.9's interpreter truncates a float32 -> fp8/bf16/fp16 cast and can
    lose the carry into the exponent (0.49 -> 0.25 in e4m3), while values already on the target's grid convert
    exactly; so _to_cache rounds to the grid first. A GPU's cast rounds to nearest even by itself."""
    if not interpreted() or dtype == torch.float32:
        return 0, 0.0, 0.0
    info = torch.finfo(dtype)
    mant = round(-math.log2(info.eps))
    return mant, float(info.smallest_normal), float(info.smallest_normal * info.eps)


def _precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (a GPU would otherwise round the dot inputs to tf32); half types ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile(q: torch.Tensor, size: int, cpu: int = 32) -> int:
    """A tile edge: `size` on a GPU (halved for float32, whose operands take twice the shared memory), smaller
    under the interpreter, whose cost grows with the padding a large tile reads past a short sequence."""
    if not q.is_cuda:
        return cpu
    return size if q.element_size() <= 2 else size // 2


def check_shapes(head_dim: int, block_size: int) -> None:
    """The layouts the kernels take: tl.arange wants powers of two, tl.dot tiles of 16 at least."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"--attention-backend triton: head_dim must be a power of two >= 16, got {head_dim}")
    if block_size < 16:
        raise ValueError(f"--attention-backend triton: --block-size must be >= 16, got {block_size}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, D] (rows may be strided views of the fused qkv) -> the caches at slot_mapping [T].

    Caches: [num_blocks, block_size, kv_heads, D], contiguous. A slot of -1 writes nothing (graph padding).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
    row = num_kv_heads * head_dim
    _check_device(k)
    grid = _downcast_grid(k_cache.dtype)
    _write_kv[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                             ROW=row, ROW_PAD=triton.next_power_of_2(row), CONVERT=k.dtype != k_cache.dtype,
                             LIMIT=saturation(k_cache.dtype), MANT=grid[0], MIN_NORMAL=grid[1], SUB_STEP=grid[2])


def reference_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Torch reference of write_kv, padding slots (-1) skipped, cast as kv_dtype.to_cache casts."""
    keep = slot_mapping >= 0
    flat = k_cache.shape[2:]
    k_cache.view(-1, *flat)[slot_mapping[keep]] = to_cache(k[keep].float(), k_cache.dtype)
    v_cache.view(-1, *flat)[slot_mapping[keep]] = to_cache(v[keep].float(), v_cache.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, token_ids: torch.Tensor,
                     seq_ids: torch.Tensor, scale: float, num_splits: int = 1, tile_n: int | None = None) -> None:
    """One new token per decode: out[token_ids[b]] = attention of q[token_ids[b]] over sequence seq_ids[b].

    q, out: [T, heads, D]; block_tables: [num_seqs, max_blocks]; seq_lens: [num_seqs] (context incl. the new
    token, already written). num_splits > 1 splits each context into that many parts (flash-decoding) and
    merges them by log-sum-exp: parallelism for long contexts at small batch. num_splits must be a power of 2.
    """
    num_decodes = token_ids.numel()
    if num_decodes == 0:
        return
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    tile_n = tile_n or _tile(q, 64)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    _check_device(q)
    part_out = part_lse = out  # unused by the kernel when there is one split
    if num_splits > 1:
        part_out = torch.empty((num_decodes, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode[(num_decodes, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, token_ids, seq_ids,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype), UPCAST=_dot_inputs_upcast(q.dtype), CONVERT=k_cache.dtype != q.dtype)
    if num_splits > 1:
        _reduce_splits[(num_decodes, num_heads)](
            part_out, part_lse, out, token_ids, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_ids: torch.Tensor, max_query_len: int, scale: float, tile_m: int | None = None,
                      tile_n: int | None = None) -> None:
    """Causal attention of each listed sequence's new tokens over its whole cached context (varlen).

    seq_ids: [P] the sequences to run; query_start_loc: [num_seqs + 1]; max_query_len: the longest of their
    chunks (host int, sizes the grid).
    """
    num_seqs = seq_ids.numel()
    if num_seqs == 0:
        return
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tile_m = tile_m or _tile(q, 64, cpu=16)
    tile_n = tile_n or _tile(q, 64)
    _check_device(q)
    _prefill[(num_seqs, num_heads, triton.cdiv(max_query_len, tile_m))](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, seq_ids,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_M=tile_m, TILE_N=tile_n, PRECISION=_precision(q.dtype), UPCAST=_dot_inputs_upcast(q.dtype),
        CONVERT=k_cache.dtype != q.dtype)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: list[int], query_start_loc: list[int], scale: float) -> torch.Tensor:
    """Torch reference for both kernels, in float32: every new token over its sequence's cached context,
    causally (query j of a chunk of q_len at position seq_len - q_len + j). -> [T, heads, D] float32."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        pos = torch.arange(seq_len)
        slots = block_tables[i, pos // block_size].cpu() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots.to(k_cache.device)].float().cpu()  # [seq_len, kv_heads, D]
        v = v_cache.flatten(0, 1)[slots.to(v_cache.device)].float().cpu()
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [seq_len, heads, D]
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float().cpu(), k) * scale
        rows = torch.arange(end - start).unsqueeze(1) + seq_len - (end - start)
        scores = scores.masked_fill(pos.unsqueeze(0) > rows, -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
