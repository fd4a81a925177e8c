"""The engine on --attention-backend triton gives the torch backend's greedy ids: whole prompts, chunked
prefill, decodes batched with prefill chunks, and a prefix-cache hit. Run by tests/engine/test_triton_attention.py
in a subprocess (on a CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.attention import triton_kernels
from rawserve.engine.types import SamplingParams

if not torch.cuda.is_available() and not triton_kernels.interpreted():
    pytest.skip("CPU runs need TRITON_INTERPRET=1 set before triton is imported", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and not triton_kernels.interpreted() else "cpu"


def make_llm(model_dir, backend: str, **options):
    from rawserve.engine.frontend.llm import LLM

    # A 24-token step budget: the 40- and 57-token prompts prefill in chunks, beside the others' decodes.
    options = {"device": DEVICE, "dtype": "float32", "block_size": 16, "num_kv_blocks": 48,
               "max_num_batched_tokens": 24, **options}
    return LLM(model_dir, attention_backend=backend, **options)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def test_greedy_ids_equal_the_torch_backend_with_chunked_prefill_and_a_prefix_hit(tiny_qwen3_dir):
    shared = prompt(35, 0)  # two full blocks and a bit: a later prompt starting with it hits two cached blocks
    first = [shared, prompt(57, 1), prompt(3, 2), prompt(17, 3)]
    second = [shared + prompt(6, 4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny_qwen3_dir, backend)
        out = [r.outputs[0].token_ids for r in llm.generate(first, params)]
        hits_before = llm.core.stats().prefix_cache_hits
        out += [r.outputs[0].token_ids for r in llm.generate(second, params)]
        assert llm.core.stats().prefix_cache_hits - hits_before >= 32, "the second call must hit the cache"
        ids[backend] = out
    assert ids["triton"] == ids["torch"]


def test_runner_logits_match_the_torch_backend_over_chunks(tiny_qwen3_dir):
    """Every token's logits, a prompt in three uneven chunks on a shuffled block table."""
    from rawserve.config import EngineConfig
    from rawserve.engine.model_runner import ModelRunner
    from rawserve.engine.step_plan import ForwardBatch, StepInput

    ids, table = prompt(45, 5), [7, 2, 11]
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(EngineConfig(model_dir=str(tiny_qwen3_dir), device=DEVICE, dtype="float32",
                                          block_size=16, num_kv_blocks=16, attention_backend=backend))
        rows, start = [], 0
        for end in (13, 14, 45):
            rows.append(runner.execute(ForwardBatch.every_token([StepInput(ids[start:end], start, table)])))
            start = end
        logits[backend] = torch.cat(rows).cpu()
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_padded_static_decode_batch_gives_eager_logits(tiny_qwen3_dir):
    """What a CUDA graph replays, run without capture: decodes copied into the static buffers and padded up the
    batch ladder (padding rows write no KV and read none) give the eager step's logits, batch after batch."""
    from rawserve.config import EngineConfig
    from rawserve.engine.cuda_graphs import DecodeGraphs
    from rawserve.engine.model_runner import ModelRunner
    from rawserve.engine.step_plan import ForwardBatch, StepInput

    runner = ModelRunner(EngineConfig(model_dir=str(tiny_qwen3_dir), device=DEVICE, dtype="float32", block_size=16,
                                      num_kv_blocks=16, max_num_seqs=8, attention_backend="triton",
                                      cuda_graphs="off"))
    prompts, tables = [prompt(20, 6), prompt(5, 7), prompt(33, 8)], [[3, 9], [0], [12, 1, 5]]
    runner.execute(ForwardBatch.last_tokens([StepInput(p, 0, t) for p, t in zip(prompts, tables)]))
    graphs = DecodeGraphs(runner.model, runner.kv_caches, 8, runner.max_model_len, 16, runner.device, capture=False)
    # 3 rows padded to 4, then sequence 1 alone, on block 0: a padding row writing slot 0 would show there
    decodes = [ForwardBatch.last_tokens([StepInput([11 + i], len(prompts[i]), tables[i]) for i in picks])
               for picks in ([0, 1, 2], [1])]
    eager = [runner.execute(decode).cpu() for decode in decodes]
    runner.graphs = graphs
    for decode, expected in zip(decodes, eager):
        torch.testing.assert_close(runner.execute(decode).cpu(), expected, atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 2
