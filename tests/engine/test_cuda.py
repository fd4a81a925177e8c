"""On a CUDA device the engine gives what it gives on the CPU (skipped cleanly without a GPU)."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_greedy_generation_on_cuda_matches_cpu(tiny_qwen3_dir):
    from rawserve.engine.frontend.llm import LLM

    prompts = [[5, 9, 17, 33, 2 + i] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cpu = LLM(tiny_qwen3_dir, device="cpu", dtype="float32", num_kv_blocks=64).generate(prompts, params)
    gpu = LLM(tiny_qwen3_dir, device="cuda", dtype="float32", num_kv_blocks=64).generate(prompts, params)
    assert [r.outputs[0].token_ids for r in gpu] == [r.outputs[0].token_ids for r in cpu]


def test_seeded_sampling_on_cuda_is_reproducible(tiny_qwen3_dir):
    from rawserve.engine.frontend.llm import LLM

    llm = LLM(tiny_qwen3_dir, device="cuda", dtype="bfloat16", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    first = llm.generate([[4, 8, 15]], params)[0].outputs[0].token_ids
    assert llm.generate([[4, 8, 15]], params)[0].outputs[0].token_ids == first
