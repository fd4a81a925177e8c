"""Each triton kernel against its torch reference: fp32, then bf16 within BF16_TOL, block sizes 16 and 32, head
dims 64 and 128, GQA ratios 1, 2 and 8. Run by tests/engine/test_triton_attention.py in a subprocess: on a CPU
under TRITON_INTERPRET=1 (set before triton is imported), on CUDA tensors when a GPU is present.
"""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.attention import triton_kernels as tk


def shape_id(shape: tuple[int, int, int]) -> str:
    return f"block{shape[0]}-dim{shape[1]}-gqa{shape[2]}"


if not torch.cuda.is_available() and not tk.interpreted():
    pytest.skip("CPU runs need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and not tk.interpreted() else "cpu"
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# bf16: K/V/Q and the output are rounded to 8 mantissa bits (2^-8 = 0.4% relative) and p is rounded for the PV
# product; against a float32 reference over the same bf16 inputs the error stays well under 3e-2 absolute.
BF16_TOL = {"atol": 3e-2, "rtol": 2e-2}
SHAPES = [(block, dim, group) for block in (16, 32) for dim in (64, 128) for group in (1, 2, 8)]
# Under the interpreter the attention kernels run on covering subsets (each block size with each GQA ratio, each head
# dim with each block size, in fp32; each block size, head dim and GQA ratio at least once in bf16) to keep CI's
# time down; on a GPU fp32 runs every shape. write_kv, which is cheap, runs every shape in both dtypes.
FP32_SHAPES = SHAPES if DEVICE == "cuda" else [(16, 64, 1), (32, 128, 1), (16, 128, 2), (32, 64, 2), (16, 64, 8),
                                               (32, 128, 8)]
BF16_SHAPES = [(16, 64, 1), (32, 128, 2), (16, 128, 8), (32, 64, 8)]
ATTENTION_CASES = ([pytest.param(shape, torch.float32, id=f"{shape_id(shape)}-fp32") for shape in FP32_SHAPES]
                   + [pytest.param(shape, torch.bfloat16, id=f"{shape_id(shape)}-bf16") for shape in BF16_SHAPES])


def tolerance(dtype: torch.dtype) -> dict:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def make_cache(block: int, dim: int, group: int, dtype: torch.dtype, seq_lens: list[int], seed: int = 0):
    """A random cache with shuffled, non-contiguous block tables; (k_cache, v_cache, tables, heads)."""
    g = torch.Generator().manual_seed(seed)
    num_kv_heads = 1 if group == 8 else 2
    max_blocks = max(-(-n // block) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, block, num_kv_heads, dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), num_kv_heads * group


def starts_of(lengths: list[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_write_kv_stores_each_row_at_its_slot_and_skips_padding(shape, dtype):
    block, dim, group = shape
    k_cache, v_cache, _, _ = make_cache(block, dim, group, dtype, [3 * block])
    num_kv_heads = k_cache.shape[2]
    # k as a strided view of a fused row, as the decoder passes it
    fused = torch.randn(6, 3 * num_kv_heads * dim).to(dtype).to(DEVICE)
    k = fused[:, :num_kv_heads * dim].view(6, num_kv_heads, dim)
    v = fused[:, 2 * num_kv_heads * dim:].contiguous().view(6, num_kv_heads, dim)
    slots = torch.tensor([3, block + 1, -1, 2 * block - 1, 0, 3 * block + 2], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    tk.write_kv(k, v, k_cache, v_cache, slots)
    tk.reference_write_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert not torch.equal(k_cache.flatten(0, 1)[3], torch.zeros_like(k_cache.flatten(0, 1)[3]))


@pytest.mark.parametrize("shape, dtype", ATTENTION_CASES)
def test_decode_matches_reference_with_and_without_split_k(shape, dtype):
    block, dim, group = shape
    # lengths: one token, mid-block, several blocks, 5 tiles of 32 (every split used); a padding row (0) last
    seq_lens = [1, block + 3, 3 * block - 2, 4 * 32 + 7, 0]
    k_cache, v_cache, tables, heads = make_cache(block, dim, group, dtype, seq_lens, seed=1)
    q = torch.randn(len(seq_lens), heads, dim).to(dtype).to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    ref = tk.reference_attention(q, k_cache, v_cache, tables, seq_lens, list(range(len(seq_lens) + 1)), dim ** -0.5)
    rows = torch.arange(len(seq_lens), device=DEVICE)
    for num_splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        tk.decode_attention(q, k_cache, v_cache, out, tables, lens, rows, rows, dim ** -0.5, num_splits)
        torch.testing.assert_close(out[:-1].float().cpu(), ref[:-1], **tolerance(dtype))
        assert torch.equal(out[-1].float().cpu(), torch.zeros_like(ref[-1]))  # a length-0 row reads nothing


@pytest.mark.parametrize("shape, dtype", ATTENTION_CASES)
def test_prefill_is_causal_over_cached_context(shape, dtype):
    block, dim, group = shape
    # a whole prompt; a chunk after 2 cached blocks and a bit (chunked prefill / a prefix hit); a 2-token chunk
    q_lens = [block + 5, 20, 2]
    seq_lens = [block + 5, 2 * block + 3 + 20, block + 2]
    k_cache, v_cache, tables, heads = make_cache(block, dim, group, dtype, seq_lens, seed=2)
    starts = starts_of(q_lens)
    q = torch.randn(starts[-1], heads, dim).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    tk.prefill_attention(q, k_cache, v_cache, out, tables, torch.tensor(seq_lens, device=DEVICE),
                         torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                         torch.arange(len(q_lens), device=DEVICE), max(q_lens), dim ** -0.5)
    ref = tk.reference_attention(q, k_cache, v_cache, tables, seq_lens, starts, dim ** -0.5)
    torch.testing.assert_close(out.float().cpu(), ref, **tolerance(dtype))


def test_gpu_tile_sizes_and_a_subset_of_sequences():
    """The tiles a GPU uses (64 x 64) on CPU too, and seq_ids picking some sequences of a mixed batch."""
    block, dim, group = 16, 64, 2
    q_lens = [1, 70, 1, 9]
    seq_lens = [40, 70, 130, 9 + 33]
    k_cache, v_cache, tables, heads = make_cache(block, dim, group, torch.float32, seq_lens, seed=3)
    starts = starts_of(q_lens)
    q = torch.randn(starts[-1], heads, dim, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, device=DEVICE)
    tk.prefill_attention(q, k_cache, v_cache, out, tables, lens, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                         torch.tensor([1, 3], device=DEVICE), 70, dim ** -0.5, tile_m=64, tile_n=64)
    decode_tokens, decode_seqs = torch.tensor([0, 71], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    tk.decode_attention(q, k_cache, v_cache, out, tables, lens, decode_tokens, decode_seqs, dim ** -0.5, 2, tile_n=64)
    ref = tk.reference_attention(q, k_cache, v_cache, tables, seq_lens, starts, dim ** -0.5)
    torch.testing.assert_close(out.cpu(), ref, **FP32_TOL)
