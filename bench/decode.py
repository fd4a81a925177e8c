"""Decode step time, eager vs CUDA-graphed, and batch-1 weight-read bandwidth against a roofline.

python -m bench.decode [--model demo|qwen3-0.6b | --model-dir DIR] [--batches 1,64] [--context 512]
                       [--attention-backend triton] [--roofline-gb-s 4300]
One JSON object per (batch, mode), then a summary: graphed/eager speedup per batch, and at batch 1 the weight
bytes read per second as a fraction of the roofline (H200 HBM3e: 4.3 TB/s) and of a measured streaming read.
Graphs need a CUDA device: elsewhere only eager rows are printed, and the summary says why.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import torch

from bench.engine import resolve_model_dir, rev
from bench.model_forward import read_bandwidth_gb_s, timed, weight_bytes_of
from rawserve.config import EngineConfig
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.step_plan import ForwardBatch, StepInput

log = logging.getLogger("bench.decode")

H200_GB_S = 4300.0
GRAPH_TARGET = 2.0  # graphed over eager decode at batch 1
ROOFLINE_TARGET = 0.5  # batch-1 weight reads as a fraction of the roofline


def decode_batch(batch: int, context: int, block_size: int) -> ForwardBatch:
    """`batch` sequences with `context` tokens cached, each decoding one token on its own blocks."""
    per_seq = -(-(context + 1) // block_size)
    return ForwardBatch.last_tokens([StepInput([7 + i % 100], context, list(range(i * per_seq, (i + 1) * per_seq)))
                                     for i in range(batch)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", choices=["demo", "qwen3-0.6b"])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=512, help="tokens already cached per sequence")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="triton", choices=["torch", "triton"])
    parser.add_argument("--roofline-gb-s", type=float, default=H200_GB_S)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    model_dir = resolve_model_dir(args.model, args.model_dir)
    batches = [int(b) for b in args.batches.split(",")]
    per_seq = -(-(args.context + 1) // args.block_size)
    modes = ["off", "on"]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type != "cuda" or args.attention_backend != "triton":
        modes = ["off"]
    step_s: dict[tuple[int, str], float] = {}
    base = {"bench": "decode", "model_dir": model_dir, "context": args.context,
            "attention_backend": args.attention_backend, "rev": rev()}
    weight_bytes = 0
    for mode in modes:
        config = EngineConfig(model_dir=model_dir, device=args.device, dtype=args.dtype, block_size=args.block_size,
                              num_kv_blocks=max(batches) * per_seq + 1, max_num_seqs=max(batches),
                              max_model_len=args.context + 64, attention_backend=args.attention_backend,
                              cuda_graphs=mode)
        runner = ModelRunner(config)
        weight_bytes = weight_bytes_of(runner.model)
        base.update(device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."))
        for batch in batches:
            inputs = decode_batch(batch, args.context, args.block_size)
            seconds = statistics.median(timed(lambda: runner.execute(inputs), args.reps, warmup=3))
            step_s[batch, mode] = seconds
            print(json.dumps({**base, "batch": batch, "cuda_graphs": mode, "step_ms": round(seconds * 1e3, 3),
                              "decode_tok_s": round(batch / seconds, 1)}), flush=True)
        del runner
    summary = {**base, "bench": "decode_summary", "weight_bytes": weight_bytes}
    best = min(step_s[1, m] for m in modes) if 1 in batches else None
    if best is not None:
        read = read_bandwidth_gb_s(device)
        achieved = weight_bytes / best / 1e9
        summary.update(batch1_tok_s=round(1 / best, 1), weight_read_gb_s=round(achieved, 3),
                       roofline_gb_s=args.roofline_gb_s, roofline_fraction=round(achieved / args.roofline_gb_s, 4),
                       measured_read_gb_s=round(read, 1), measured_read_fraction=round(achieved / read, 3),
                       roofline_target=ROOFLINE_TARGET)
    if "on" in modes:
        for batch in batches:
            summary[f"graph_speedup_batch{batch}"] = round(step_s[batch, "off"] / step_s[batch, "on"], 2)
        summary["graph_target_batch1"] = GRAPH_TARGET
    else:
        summary["graphs"] = f"not measured: CUDA graphs need a CUDA device and the triton backend ({device.type})"
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
