"""--quantization: ms per call of each CPU matmul kernel on Qwen3-0.6B-shaped layers, and whole-model decode tok/s
per precision through the offline LLM. Configurations interleave round by round, so a busy machine slows all alike.

python -m bench.quant [--rows 1,8,32,256] [--rounds 15] [--shapes gate_up,down] [--skip-decode]
                      [--configs bfloat16,int8/float32,int8/bfloat16,int4/bfloat16] [--streams 1,8] [--tokens 32]
                      [--model-dir DIR]
Kernel rows: {"bench": "quant_kernel", "shape", "n", "k", "rows", "kernel", "ms", "weight_gb_s"}; decode rows:
{"bench": "quant_decode", "config", "streams", "tok_s" (output tokens over wall time, prefill included)}.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.engine import resolve_model_dir, rev
from rawserve.engine import quant

log = logging.getLogger("bench.quant")

# Qwen3-0.6B's fused matrices: [out, in]
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def _onednn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def kernels(weight: torch.Tensor, plan8: quant.QuantPlan) -> dict[str, tuple[Callable, torch.dtype, int]]:
    """name -> (matmul, activation dtype, bytes of weight it reads)."""
    n, k = weight.shape
    out: dict[str, tuple[Callable, torch.dtype, int]] = {
        "fp32_onednn": (_onednn(weight), torch.float32, 4 * n * k),
        "bf16_onednn": (_onednn(weight.bfloat16()), torch.bfloat16, 2 * n * k),
        "bf16_linear": ((lambda w: lambda x: F.linear(x, w))(weight.bfloat16()), torch.bfloat16, 2 * n * k)}
    if plan8.int8_kernel == "w8a8":
        layer = quant.quantize_int8(weight, plan8)
        out["int8_w8a8_fp32in"] = (layer, torch.float32, layer.num_bytes)
        out["int8_w8a8_bf16in"] = (layer, torch.bfloat16, layer.num_bytes)
    weight_only = quant.quantize_int8(weight, quant.QuantPlan("int8", 0, "int8", False))
    out["int8_weight_only"] = (weight_only, torch.bfloat16, weight_only.num_bytes)
    for group in (32, 128):
        plan4 = quant.QuantPlan("int4", group, plan8.int8_kernel, plan8.reduce_range)
        if quant.int4_fits(n, k, group):
            layer = quant.quantize_int4(weight, plan4)
            out[f"int4_g{group}"] = (layer, torch.bfloat16, layer.num_bytes)
    return out


def bench_kernels(args: argparse.Namespace, base: dict) -> None:
    plan8 = quant.probe_plan("int8", 128, torch.device("cpu"))
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        weight = torch.randn(n, k) * 0.02
        table = kernels(weight, plan8)
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {dtype: torch.randn(rows, k).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
            calls = max(1, 64 // rows)  # each timing covers a few ms even at one row
            times: dict[str, list[float]] = {name: [] for name in table}
            for round_ in range(args.rounds + 2):  # the first two rounds warm up and are dropped
                for name, (fn, dtype, _) in table.items():
                    x = inputs[dtype]
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    if round_ >= 2:
                        times[name].append((time.perf_counter() - t0) / calls)
            for name, (_, _, num_bytes) in table.items():
                ms = statistics.median(times[name]) * 1e3
                print(json.dumps({**base, "bench": "quant_kernel", "shape": shape, "n": n, "k": k, "rows": rows,
                                  "kernel": name, "ms": round(ms, 4), "weight_bytes": num_bytes,
                                  "weight_gb_s": round(num_bytes / ms / 1e6, 1)}), flush=True)


def _decode_worker(conn, model_dir: str, options: dict) -> None:
    """One configuration's LLM in its own process: several 0.6B models alternating in one process slowed each
    other 10-25x here (bf16 decode after an int8 model's), which is no serving setup's speed."""
    import rawserve
    from rawserve.engine.model_runner import weight_bytes
    from rawserve.engine.types import SamplingParams

    t0 = time.perf_counter()
    llm = rawserve.LLM(model_dir, **options)
    runner = llm.core.runner
    conn.send((time.perf_counter() - t0, weight_bytes(model_dir, runner.dtype, runner.model_config, runner.device,
                                                      runner.quant)))
    while (job := conn.recv()) is not None:
        prompts, max_tokens = job
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        conn.send(time.perf_counter() - t0)


def bench_decode(args: argparse.Namespace, base: dict) -> None:
    import multiprocessing

    model_dir = resolve_model_dir("qwen3-0.6b", args.model_dir)
    streams = [int(s) for s in args.streams.split(",")]
    prompt_len = 32
    per_seq_blocks = -(-(prompt_len + args.tokens) // 16)
    ctx = multiprocessing.get_context("spawn")
    workers = {}
    try:
        for config in args.configs.split(","):  # loaded one after another, so loads do not overlap
            scheme, _, dtype = config.partition("/") if "/" in config else ("none", "", config)
            options = dict(dtype=dtype, device="cpu", quantization=scheme, quantization_group_size=args.group_size,
                           max_model_len=512, num_kv_blocks=max(streams) * per_seq_blocks + 4,
                           max_num_seqs=max(streams), max_num_batched_tokens=max(streams) * prompt_len)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode_worker, args=(child, model_dir, options), daemon=True)
            proc.start()
            workers[config] = (proc, parent)
            load_s, num_bytes = parent.recv()
            print(json.dumps({**base, "bench": "quant_load", "config": config, "load_s": round(load_s, 1),
                              "weight_bytes": num_bytes}), flush=True)
        g = torch.Generator().manual_seed(0)
        for n in streams:
            prompts = [torch.randint(1000, 100000, (prompt_len,), generator=g).tolist() for _ in range(n)]
            times: dict[str, list[float]] = {config: [] for config in workers}
            for round_ in range(args.decode_rounds + 1):  # round 0 warms up
                for config, (_, conn) in workers.items():  # one process runs at a time
                    conn.send((prompts, args.tokens))
                    elapsed = conn.recv()
                    if round_:
                        times[config].append(elapsed)
            for config, ts in times.items():
                print(json.dumps({**base, "bench": "quant_decode", "config": config, "streams": n,
                                  "prompt_tokens": prompt_len, "output_tokens": args.tokens,
                                  "tok_s": round(n * args.tokens / statistics.median(ts), 2)}), flush=True)
    finally:
        for proc, conn in workers.values():
            conn.send(None)
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,256")
    parser.add_argument("--shapes", default="gate_up,down")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--configs", default="bfloat16,int8/float32,int8/bfloat16,int4/bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--decode-rounds", type=int, default=3)
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    base = {"rev": rev(), "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    if not args.skip_kernels:
        bench_kernels(args, base)
    if not args.skip_decode:
        bench_decode(args, {**base, "load_avg_1m": round(os.getloadavg()[0], 2)})


if __name__ == "__main__":
    main()
