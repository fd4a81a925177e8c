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


def test_guided_rows_on_cuda_validate_and_leave_unconstrained_rows_alone(large_vocab_model_dir):
    """The step masks a GPU's rows all at once (token_mask.apply_rows): every constrained output validates, and an
    unconstrained row in the batch samples what it samples alone."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from rawserve.config import EngineConfig
    from rawserve.engine.core import EngineCore
    from rawserve.engine.guided.json_schema import schema_to_grammar
    from rawserve.engine.guided.nfa import compile_grammar
    from rawserve.text.tokenizer import Tokenizer

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    tok = Tokenizer.from_dir(large_vocab_model_dir)
    core = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cuda", dtype="float32",
                                   num_kv_blocks=256, max_model_len=512))
    compiled = compile_grammar(schema_to_grammar(schema), json.dumps(schema))
    prompt = tok.encode("JSON please:")
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(requests: dict) -> dict:
        for rid, params in requests.items():
            core.add_request(rid, prompt, params)
        tokens, reasons = {rid: [] for rid in requests}, {}
        while core.has_unfinished:
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    reasons[out.request_id] = out.finish_reason
        return {rid: (tokens[rid], reasons[rid]) for rid in requests}

    try:
        alone = run({"free": free})["free"][0]
        outs = run({"free": free, **{f"g{s}": SamplingParams(max_tokens=60, temperature=1.0, seed=s, guided=compiled)
                                     for s in range(8)}})
    finally:
        core.close()
    assert outs["free"][0] == alone
    for s in range(8):
        ids, reason = outs[f"g{s}"]
        assert reason == "stop"
        jsonschema.validate(json.loads(tok.decode([i for i in ids if i not in (151643, 151645)])), schema)
