"""What each layer above the engine costs: one workload through four paths, side by side in one run.

python -m bench.overhead [--streams 32,256] [--input-len 32] [--output-len 64] [--model-dir DIR]
Paths: EngineCore stepped in-process; AsyncLLM with the core in a thread; AsyncLLM with the core in a spawned
process; the full server (HTTP + SSE, `python -m rawserve serve`, core in a process) driven by bench/client.py.
Each: N greedy streams of input-len prompt tokens and output-len generated tokens (ignore_eos), output tok/s
from the first submit to the last token (the median of --repeats runs after a warm-up), and the ratio to the
engine alone. One JSON line per (path, N), then
a summary with the issue's target (server >= 0.85x the engine at 256 streams). The demo model by default.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from rawserve.config import EngineConfig
from rawserve.engine.types import SamplingParams

TARGET_RATIO = 0.85


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def engine_config(model_dir: str, streams: int, input_len: int, output_len: int) -> EngineConfig:
    blocks = streams * ((input_len + output_len) // 16 + 2) + 64
    return EngineConfig(model_dir=model_dir, device="cpu", max_model_len=max(512, input_len + output_len),
                        num_kv_blocks=blocks, max_num_seqs=max(256, streams), enable_prefix_caching=False)


def prompts(tokenizer, streams: int, input_len: int) -> list[list[int]]:
    ids = tokenizer.encode("Once upon a time there was a little dragon who loved stories and the quick brown fox.",
                           add_special_tokens=False)
    # Distinct prompts (a shifted window each), so no path gains from a shared prefix.
    base = ids * (input_len // len(ids) + 2)
    return [(base[i % len(ids):] + base)[:input_len] for i in range(streams)]


def run_engine(config: EngineConfig, batch: list[list[int]], output_len: int, repeats: int) -> list[float]:
    from rawserve.engine.core import make_engine_core

    core = make_engine_core(config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(batch[:8]):  # warm-up
        core.add_request(f"w{i}", ids, params)
    while core.has_unfinished:
        core.step()
    rates = []
    for r in range(repeats):
        started = time.perf_counter()
        for i, ids in enumerate(batch):
            core.add_request(f"r{r}-{i}", ids, params)
        tokens = 0
        while core.has_unfinished:
            for out in core.step():
                tokens += len(out.new_token_ids)
        rates.append(tokens / (time.perf_counter() - started))
    return rates


async def run_async_llm(config: EngineConfig, tokenizer, mode: str, batch: list[list[int]], output_len: int,
                        repeats: int) -> list[float]:
    from rawserve.engine.frontend.async_llm import AsyncLLM
    from rawserve.engine.launch import CoreFactory

    llm = AsyncLLM(CoreFactory(config, "warning"), tokenizer, mode=mode, max_pending=len(batch) + 16)
    await llm.start()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    async def consume(stream) -> int:
        count = 0
        async for out in stream:
            count = out.num_output_tokens if out.finished else count
        return count

    try:
        await asyncio.gather(*(consume(llm.generate(ids, params, f"w{i}")) for i, ids in enumerate(batch[:8])))
        rates = []
        for r in range(repeats):
            started = time.perf_counter()
            counts = await asyncio.gather(*(consume(llm.generate(ids, params, f"r{r}-{i}"))
                                            for i, ids in enumerate(batch)))
            rates.append(sum(counts) / (time.perf_counter() - started))
        return rates
    finally:
        await llm.stop(0)


async def run_server(port: int, batch: list[list[int]], output_len: int, repeats: int) -> list[float]:
    from bench.client import call

    def body(ids: list[int]) -> dict:
        return {"prompt": ids, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}

    await asyncio.gather(*(call("127.0.0.1", port, "/v1/completions", body(ids)) for ids in batch[:8]))
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(call("127.0.0.1", port, "/v1/completions", body(ids)) for ids in batch))
        elapsed = time.perf_counter() - started
        failed = [o.error for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} server requests failed: {failed[:3]}")
        rates.append(sum(o.usage_tokens or 0 for o in outcomes) / elapsed)
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[32, 256])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path (the median is reported)")
    args = parser.parse_args(argv)
    from bench.serve import start_server, stop_server
    from rawserve.text.tokenizer import Tokenizer

    model_dir = args.model_dir
    if model_dir is None:
        from rawserve.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    tokenizer = Tokenizer.from_dir(model_dir)
    ratios = {}
    for streams in args.streams:
        config = engine_config(model_dir, streams, args.input_len, args.output_len)
        batch = prompts(tokenizer, streams, args.input_len)
        n = args.repeats
        results = {"engine_core": run_engine(config, batch, args.output_len, n),
                   "async_llm_thread": asyncio.run(run_async_llm(config, tokenizer, "thread", batch, args.output_len, n)),
                   "async_llm_process": asyncio.run(run_async_llm(config, tokenizer, "process", batch,
                                                                  args.output_len, n))}
        flags = ["--max-model-len", str(config.max_model_len), "--num-kv-blocks", str(config.num_kv_blocks),
                 "--max-num-seqs", str(config.max_num_seqs), "--no-enable-prefix-caching", "--device", "cpu",
                 "--max-pending", str(streams + 16)]
        proc, port = start_server(flags, model_dir)
        try:
            results["http_server"] = asyncio.run(run_server(port, batch, args.output_len, n))
        finally:
            stop_server(proc)
        base = statistics.median(results["engine_core"])
        for path, rates in results.items():
            tok_s = statistics.median(rates)
            print(json.dumps({"bench": "overhead", "path": path, "streams": streams, "input_len": args.input_len,
                              "output_len": args.output_len, "output_tok_s": round(tok_s, 1),
                              "runs_tok_s": [round(r, 1) for r in rates], "ratio_to_engine": round(tok_s / base, 3)}),
                  flush=True)
        ratios[streams] = statistics.median(results["http_server"]) / base
    at = max(args.streams)
    print(json.dumps({"bench": "overhead", "summary": True, "server_ratio_at": at, "server_ratio": round(ratios[at], 3),
                      "target": TARGET_RATIO, "met": ratios[at] >= TARGET_RATIO, "cpus": os.cpu_count()}), flush=True)


if __name__ == "__main__":
    main()
