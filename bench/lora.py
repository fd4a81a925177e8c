"""Batched multi-LoRA decode: tok/s at one batch with 0, 1, 4 and 8 distinct rank-16 adapters, as ratios to the
base model in the same run, the configurations interleaved step by step (target: >= 0.8x with 8 adapters).

python -m bench.lora [--batch 32] [--context 128] [--adapters 0,1,4,8] [--rank 16] [--model-dir DIR]
Prints one JSON object per line. Default model: a random checkpoint with the Qwen3-0.6B shape. The adapters are
random, target all seven projections, and sit in --max-loras = max(--adapters) slots.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.model_forward import rev, timed
from rawserve.config import EngineConfig
from rawserve.engine.lora import MODULES, LoraAdapter, part_shapes
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.step_plan import ForwardBatch, StepInput


def random_adapter(name: str, runner: ModelRunner, rank: int, seed: int) -> LoraAdapter:
    cfg = runner.model_config
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg.num_layers):
        for module, (in_f, out_f) in part_shapes(cfg).items():
            weights[(layer, module)] = (torch.randn(rank, in_f, generator=g) * 0.01,
                                        torch.randn(out_f, rank, generator=g) * 0.01)
    return LoraAdapter(name, "(random)", rank, weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per sequence")
    parser.add_argument("--adapters", default="0,1,4,8")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    if args.model_dir is None:
        from bench.checkpoints import ensure_qwen3_06b_shape

        args.model_dir = str(ensure_qwen3_06b_shape(args.dtype))
    counts = [int(n) for n in args.adapters.split(",")]
    block = 16
    blocks_per_seq = -(-(args.context + 1) // block)
    max_loras = max(max(counts), 1)
    runner = ModelRunner(EngineConfig(model_dir=args.model_dir, dtype=args.dtype, device=args.device,
                                      block_size=block, num_kv_blocks=args.batch * blocks_per_seq + 1,
                                      enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank))
    for slot in range(max_loras):
        runner.lora.load(slot, random_adapter(f"lora{slot}", runner, args.rank, slot))
    head = {"bench": "lora", "model_dir": args.model_dir, "dtype": str(runner.dtype), "device": str(runner.device),
            "batch": args.batch, "context": args.context, "rank": args.rank, "max_loras": max_loras,
            "targets": len(MODULES), "rev": rev(), "threads": torch.get_num_threads()}
    batches = {}
    for count in [0, *[c for c in counts if c]]:
        # Rows spread round-robin over `count` adapters (0: every row on the base model).
        seqs = [StepInput([7], args.context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                          i % count if count else -1) for i in range(args.batch)]
        batches[count] = ForwardBatch.last_tokens(seqs)
    # Interleaved: each rep times one step of every configuration back to back, so a neighbour's load falls on
    # all of them alike; a configuration's ratio is the median over reps of its step time over the base's.
    times: dict[int, list[float]] = {count: [] for count in batches}
    for rep in range(args.reps + 1):
        for count, batch in batches.items():
            step_s = timed(lambda: runner.execute(batch), 1, warmup=1 if rep == 0 else 0)[0]
            if rep:  # the first rep warms every configuration up
                times[count].append(step_s)
    for count in counts:
        step_s = statistics.median(times[count])
        ratio = statistics.median(base / step for base, step in zip(times[0], times[count]))
        print(json.dumps({**head, "adapters": count, "step_ms": round(step_s * 1e3, 2),
                          "tok_s": round(args.batch / step_s, 1), "ratio_to_base": round(ratio, 3)}), flush=True)

if __name__ == "__main__":
    main()
