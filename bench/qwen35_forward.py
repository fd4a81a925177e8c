"""Qwen3.5 (hybrid) forward speed on a random Qwen3.5-0.8B-shaped model built in memory: prefill tok/s per prompt
length and delta-rule chunk size, and a decode step's ms after a given context.

python -m bench.qwen35_forward [--prefill 512,4096] [--context 1024,8192] [--chunks 32,64,128] [--dtype bfloat16]
Prints one JSON object per line. A decode's cost does not depend on the values in its context, so the decode
rows fill the KV cache and the states with random values rather than prefilling them (32k prefill on a
2-core CPU takes minutes: pass it to --prefill explicitly when wanted).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.model_forward import rev, timed
from rawserve.engine.loader import HybridConfig, ModelConfig
from rawserve.engine.models.decoder import cpu_prepack_supported
from rawserve.engine.models.gated_delta import StateBatch
from rawserve.engine.models.qwen35 import Qwen35Model
from rawserve.engine.step_plan import StepInput
from tests.engine.test_qwen35_model import attention_metadata  # the runner's torch-backend metadata, no runner

BLOCK = 16


def config_0_8b(max_positions: int) -> ModelConfig:
    """Qwen3.5-0.8B's text stack as published (../shared/notes/qwen35.md)."""
    hybrid = HybridConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=16,
                          linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                          tensor_prefix="model.", set_aside_prefixes=())
    hybrid.layer_types = hybrid.layer_types * 6
    return ModelConfig(family="qwen3_5", architecture="Qwen3_5ForConditionalGeneration", vocab_size=248320,
                       hidden_size=1024, intermediate_size=3584, num_layers=24, num_heads=8, num_kv_heads=2,
                       head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, hybrid=hybrid)


def random_model(cfg: ModelConfig, dtype: torch.dtype, chunk_size: int) -> Qwen35Model:
    with torch.device("meta"):
        model = Qwen35Model(cfg, dtype, "torch", chunk_size)
    model.materialize(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 16, generator=gen).log())
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.finish_load()
    if cpu_prepack_supported(dtype):
        model.prepack()
    return model.eval()


class Harness:
    def __init__(self, model: Qwen35Model, max_tokens: int, dtype: torch.dtype) -> None:
        cfg = model.cfg
        self.model = model
        self.num_blocks = -(-max_tokens // BLOCK) + 1
        shape = (self.num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(model.num_kv_layers)]
        self.states = model.allocate_states(1, torch.device("cpu"))
        model.init_rope(max_tokens + 1, torch.device("cpu"))

    @torch.inference_mode()
    def step(self, ids: list[int], start: int) -> None:
        seq = StepInput(ids, start, list(range(1, -(-(start + len(ids)) // BLOCK) + 1)), state_slot=0)
        meta, positions = attention_metadata([seq], BLOCK)
        hidden = self.model(torch.tensor(ids), positions, self.kv, meta, states=self.states,
                            state_batch=StateBatch.from_inputs([seq]))
        self.model.compute_logits(hidden[-1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", default="512,4096")
    parser.add_argument("--context", default="1024,8192")
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    prefills = [int(n) for n in args.prefill.split(",") if n]
    contexts = [int(n) for n in args.context.split(",") if n]
    cfg = config_0_8b(max(prefills + contexts) + 2)
    base = {"bench": "qwen35_forward", "model": "qwen3.5-0.8b-random", "dtype": args.dtype,
            "threads": torch.get_num_threads(), "rev": rev()}
    ids = torch.randint(0, 1000, (max(prefills + [1]),)).tolist()
    for chunk in (int(c) for c in args.chunks.split(",")):
        model = random_model(cfg, dtype, chunk)
        harness = Harness(model, max(prefills + contexts) + 1, dtype)
        for n in prefills:
            reps = 1 if n > 2048 else args.reps
            times = timed(lambda: harness.step(ids[:n], 0), reps=reps, warmup=1)
            best = min(times)
            print(json.dumps({**base, "kind": "prefill", "chunk_size": chunk, "prompt_tokens": n,
                              "prefill_tok_s": round(n / best, 1), "prefill_ms": round(best * 1e3, 1),
                              "reps": reps}), flush=True)
        if chunk == int(args.chunks.split(",")[0]):
            for ctx in contexts:
                times = timed(lambda: harness.step([7], ctx), reps=max(5, args.reps), warmup=2)
                print(json.dumps({**base, "kind": "decode", "context_tokens": ctx,
                                  "decode_ms_median": round(statistics.median(times) * 1e3, 2),
                                  "decode_ms_min": round(min(times) * 1e3, 2)}), flush=True)
        del model, harness
        print(f"chunk {chunk} done", file=sys.stderr)


if __name__ == "__main__":
    main()
