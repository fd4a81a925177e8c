"""What --kv-cache-dtype costs: accuracy against the float32 cache on a trained model, and decode step time.

python -m bench.kv_dtype [--accuracy-model-dir ../shared/fixtures/stories260k] [--speed-model qwen3-0.6b|tiny|demo]
                         [--kv-dtypes auto,bfloat16,float16,fp8_e4m3,fp8_e5m2] [--batches 1,32] [--context 256]
One JSON line per KV dtype for accuracy (bench "kv_dtype_accuracy": the prompt logprobs of a few stories, each
prompt scored in 16-token chunks so every chunk reads the earlier ones from the cache, as max/mean |difference|
against the float32 cache's; the greedy continuation's agreement with the float32 cache's, position by position,
and where it first differs), and one per (KV dtype, batch) for speed (bench "kv_dtype_decode": a decode step's
median ms, bench.decode's harness). Random weights give flat logits, so accuracy uses the trained stories260k.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys

import torch

from bench.decode import decode_batch
from bench.engine import resolve_model_dir, rev
from bench.model_forward import timed
from rawserve.config import KV_CACHE_DTYPES, EngineConfig
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.step_plan import ForwardBatch, StepInput
from rawserve.engine.types import SamplingParams

log = logging.getLogger("bench.kv_dtype")
STORIES = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "stories260k"
PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her mom. "
    "One day, she saw a big red ball under a tree.",
    "Tom had a small dog. The dog liked to run and jump. One morning the dog ran into the garden and found a "
    "shiny stone. Tom picked it up and smiled.",
    "The sun was hot and the sky was blue. A little bird sat on a branch and sang a happy song. A cat looked up "
    "at the bird and wanted to play.",
    "Sue and Ben went to the beach with their dad. They built a big sandcastle and put shells on top. Then a wave "
    "came and",
]
CHUNK = 16


def prompt_logprobs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for every prompt position, the prompt run in CHUNK-token steps."""
    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))
    out = []
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:min(start + CHUNK, len(ids) - 1)]
        logits = runner.execute(ForwardBatch([StepInput(chunk, start, table)], list(range(len(chunk)))))
        targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
        out.append(logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1))
    return torch.cat(out)


def accuracy(args: argparse.Namespace, kv_dtypes: list[str], base: dict) -> None:
    from rawserve.engine.frontend.llm import LLM
    from rawserve.text.tokenizer import Tokenizer

    model_dir = args.accuracy_model_dir
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(max_tokens=args.greedy_tokens, temperature=0, ignore_eos=True)
    reference_lp: list[torch.Tensor] = []
    reference_ids: list[list[int]] = []
    for kv in ["auto"] + [k for k in kv_dtypes if k != "auto"]:
        options = dict(device="cpu", dtype=args.dtype, kv_cache_dtype=kv, block_size=16, num_kv_blocks=64,
                       max_model_len=512)
        runner = ModelRunner(EngineConfig(model_dir=model_dir, **options))
        lps = [prompt_logprobs(runner, ids) for ids in prompts]
        del runner
        llm = LLM(model_dir, **options)
        greedy = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        del llm
        if kv == "auto":
            reference_lp, reference_ids = lps, greedy
        diffs = torch.cat([(a - b).abs() for a, b in zip(lps, reference_lp)])
        same = [sum(x == y for x, y in zip(g, r)) for g, r in zip(greedy, reference_ids)]
        first = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g)) for g, r in zip(greedy, reference_ids)]
        print(json.dumps({**base, "bench": "kv_dtype_accuracy", "model_dir": str(model_dir), "kv_cache_dtype": kv,
                          "num_prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
                          "logprob_max_abs_diff": round(diffs.max().item(), 5),
                          "logprob_mean_abs_diff": round(diffs.mean().item(), 6),
                          "mean_prompt_logprob": round(torch.cat(lps).mean().item(), 4),
                          "greedy_tokens": args.greedy_tokens,
                          "greedy_agreement": round(sum(same) / sum(len(r) for r in reference_ids), 4),
                          "greedy_first_difference": first}), flush=True)


def speed(args: argparse.Namespace, kv_dtypes: list[str], base: dict) -> None:
    model_dir = resolve_model_dir(args.speed_model, args.speed_model_dir)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.context + 1) // 16)
    for kv in kv_dtypes:
        runner = ModelRunner(EngineConfig(
            model_dir=model_dir, device=args.device, dtype=args.dtype, kv_cache_dtype=kv, block_size=16,
            num_kv_blocks=max(batches) * per_seq + 1, max_num_seqs=max(batches), max_model_len=args.context + 64,
            attention_backend=args.attention_backend))
        for batch in batches:
            inputs = decode_batch(batch, args.context, 16)
            seconds = statistics.median(timed(lambda: runner.execute(inputs), args.reps, warmup=2))
            print(json.dumps({**base, "bench": "kv_dtype_decode", "model_dir": model_dir, "kv_cache_dtype": kv,
                              "stored": runner.kv_dtype_name, "device": str(runner.device),
                              "attention_backend": args.attention_backend, "batch": batch, "context": args.context,
                              "kv_block_bytes": runner.block_bytes, "step_ms": round(seconds * 1e3, 2)}), flush=True)
        del runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy-model-dir", default=str(STORIES))
    parser.add_argument("--speed-model", default="qwen3-0.6b", choices=["demo", "tiny", "qwen3-0.6b"])
    parser.add_argument("--speed-model-dir", default=None)
    parser.add_argument("--kv-dtypes", default=",".join(KV_CACHE_DTYPES))
    parser.add_argument("--dtype", default="float32", help="activation dtype (the reference cache is auto: this)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=256, help="tokens cached per sequence in the decode steps")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip", choices=["accuracy", "speed"], default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s: %(message)s")
    kv_dtypes = args.kv_dtypes.split(",")
    base = {"dtype": args.dtype, "threads": torch.get_num_threads(), "rev": rev()}
    if args.skip != "accuracy":
        accuracy(args, kv_dtypes, base)
    if args.skip != "speed":
        speed(args, kv_dtypes, base)


if __name__ == "__main__":
    main()
