"""Decode-step and prefill time of our model vs transformers' forward with its own KV cache.

python -m bench.model_forward [--batches 1,8,32,128] [--context 128] [--prefill 512] [--model-dir DIR]
Prints one JSON object per line. Default model: a random checkpoint with the Qwen3-0.6B shape.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from rawserve.config import EngineConfig
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.step_plan import ForwardBatch, StepInput


def rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(fn, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Read+write bandwidth of a large tensor copy (bytes read + bytes written, per second)."""
    a = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = min(timed(lambda: b.copy_(a), reps=5))
    return 2 * num_bytes / best / 1e9


def read_bandwidth_gb_s(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Streaming-read bandwidth (a sum over 1 GiB, far larger than any cache): the ceiling for reading
    weights once per decode step."""
    a = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    best = min(timed(lambda: a.sum(), reps=5))
    return num_bytes / best / 1e9


def weight_bytes_of(model: torch.nn.Module) -> int:
    """Bytes of every weight, dense parameters and oneDNN pre-packed ones alike (tied ones once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in getattr(model, "layers", []):
        total += sum(w.numel() * w.element_size() for w in layer.packed.values())
    if getattr(model, "packed_head", None) is not None and model.lm_head is None:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()  # read as the packed head
    if getattr(model, "packed_head", None) is not None:
        total += model.packed_head.numel() * model.packed_head.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per sequence")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if args.model_dir is None:
        from bench.checkpoints import ensure_qwen3_06b_shape

        args.model_dir = str(ensure_qwen3_06b_shape(args.dtype))
    batches = [int(b) for b in args.batches.split(",")]
    block = 16
    blocks_per_seq = -(-(args.context + 1) // block)
    num_blocks = max(max(batches) * blocks_per_seq, -(-args.prefill // block)) + 1
    runner = ModelRunner(EngineConfig(model_dir=args.model_dir, dtype=args.dtype, device=args.device,
                                      block_size=block, num_kv_blocks=num_blocks))
    device = runner.device
    weight_bytes = weight_bytes_of(runner.model)
    base = {"bench": "model_forward", "model_dir": args.model_dir, "dtype": str(runner.dtype), "device": str(device),
            "context": args.context, "rev": rev(), "threads": torch.get_num_threads()}
    hf = None
    if not args.skip_transformers:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(
            args.model_dir, dtype=runner.dtype).to(device).eval()
    bandwidth = copy_bandwidth_gb_s(device)
    read_bandwidth = read_bandwidth_gb_s(device)
    for batch in batches:
        inputs = ForwardBatch.last_tokens([StepInput([7], args.context,
                                                     list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                                           for i in range(batch)])
        ours = statistics.median(timed(lambda: runner.execute(inputs), args.reps))
        row = {**base, "phase": "decode", "batch": batch, "ours_step_ms": round(ours * 1e3, 2),
               "ours_tok_s": round(batch / ours, 2)}
        if batch == 1:
            row["weight_bytes"] = weight_bytes
            row["weight_read_gb_s"] = round(weight_bytes / ours / 1e9, 2)
            row["copy_bandwidth_gb_s"] = round(bandwidth, 2)
            row["read_bandwidth_gb_s"] = round(read_bandwidth, 2)
            # The roofline: every weight byte read once per step at the streaming-read bandwidth.
            row["roofline_tok_s"] = round(read_bandwidth * 1e9 / weight_bytes, 2)
            row["roofline_fraction"] = round(weight_bytes / ours / 1e9 / read_bandwidth, 3)
        if hf is not None:
            from transformers import DynamicCache

            cfg = runner.model_config
            shape = (batch, cfg.num_kv_heads, args.context, cfg.head_dim)

            def hf_step() -> None:
                # A fresh cache of `context` tokens each call: DynamicCache grows in place on update.
                cache = DynamicCache(config=hf.config)
                for layer in range(cfg.num_layers):
                    cache.update(torch.zeros(shape, dtype=runner.dtype, device=device),
                                 torch.zeros(shape, dtype=runner.dtype, device=device), layer)
                ids = torch.full((batch, 1), 7, device=device)
                pos = torch.full((batch, 1), args.context, device=device)
                with torch.inference_mode():
                    hf(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                       logits_to_keep=1)

            theirs = statistics.median(timed(hf_step, args.reps))
            row.update({"transformers_step_ms": round(theirs * 1e3, 2), "speedup_vs_transformers":
                        round(theirs / ours, 3)})
        print(json.dumps(row), flush=True)
    ids = list(range(10, 10 + args.prefill))
    table = list(range(-(-args.prefill // block)))
    prefill = ForwardBatch.last_tokens([StepInput(ids, 0, table)])
    ours = statistics.median(timed(lambda: runner.execute(prefill), max(1, args.reps - 1)))
    row = {**base, "phase": "prefill", "prompt_tokens": args.prefill, "ours_ms": round(ours * 1e3, 1),
           "ours_tok_s": round(args.prefill / ours, 1)}
    if hf is not None:
        def hf_prefill() -> None:
            with torch.inference_mode():
                hf(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)

        theirs = statistics.median(timed(hf_prefill, max(1, args.reps - 1)))
        row.update({"transformers_ms": round(theirs * 1e3, 1), "speedup_vs_transformers": round(theirs / ours, 3)})
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
