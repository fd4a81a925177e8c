"""The triton kernels over a narrower KV cache (--kv-cache-dtype): write_kv stores exactly what kv_dtype.to_cache
stores, and decode/prefill over such a cache match the float32 reference over the same stored values. Run by
tests/engine/test_kv_dtype.py in a subprocess, under TRITON_INTERPRET=1 on CPU tensors (with or without a GPU).
"""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.attention import triton_kernels as tk

if not tk.interpreted():
    pytest.skip("runs under TRITON_INTERPRET=1, set before triton is imported", allow_module_level=True)


def test_triton_kernels_cast_on_write_and_read():
    g = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim = 16, 4, 2, 32
    seq_lens = [40, 1, 21]
    tables = torch.randperm(12, generator=g)[:9].view(3, 3)
    for act in (torch.float32, torch.bfloat16):
        for stored in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            if stored == act:
                continue
            k_cache = torch.zeros((12, block, kv_heads, dim), dtype=stored)
            v_cache = torch.zeros_like(k_cache)
            slots = torch.cat([tables[i, torch.arange(n) // block] * block + torch.arange(n) % block
                               for i, n in enumerate(seq_lens)])
            # magnitudes 1e-6 .. 1e3: subnormals and fp8's saturation included
            scale = torch.logspace(-6, 3, slots.numel()).view(-1, 1, 1)
            k = (torch.randn((slots.numel(), kv_heads, dim), generator=g) * scale).to(act)
            v = torch.randn((slots.numel(), kv_heads, dim), generator=g).to(act)
            tk.write_kv(k, v, k_cache, v_cache, slots)
            ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
            tk.reference_write_kv(k, v, ref_k, ref_v, slots)
            assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8)), (act, stored)
            assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8)), (act, stored)
            k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(stored))  # attention over moderate keys
            q = torch.randn((sum(seq_lens), heads, dim), generator=g).to(act)
            starts = [0, 40, 41, 62]
            reference = tk.reference_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.2)
            out = torch.zeros_like(q)
            tk.prefill_attention(q, k_cache, v_cache, out, tables, torch.tensor(seq_lens),
                                 torch.tensor(starts, dtype=torch.int32), torch.tensor([0, 2]), 40, 0.2)
            tk.decode_attention(q, k_cache, v_cache, out, tables, torch.tensor(seq_lens), torch.tensor([40]),
                                torch.tensor([1]), 0.2)
            tol = 1e-5 if act == torch.float32 else 3e-2
            assert torch.allclose(out.float(), reference, atol=tol, rtol=tol), (act, stored)
