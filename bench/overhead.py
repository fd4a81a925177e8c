"""What each layer above the engine costs: one workload through four paths, side by side in one run.

python -m bench.overhead [--streams 32,256] [--input-len 32] [--output-len 64] [--model-dir DIR]
Paths: EngineCore stepped in-process; AsyncLLM with the core in a thread; AsyncLLM with the core in a spawned
process; the full server (HTTP + SSE, `python -m rawserve serve`, core in a process) driven by bench/client.py.
Each: N greedy streams of input-len prompt tokens and output-len generated tokens (ignore_eos), output tok/s
from the first submit to the last token (the median of --repeats runs, interleaved across the paths after a
warm-up), and the ratio to the engine alone. One JSON line per (path, N), then
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


class EnginePath:
    """EngineCore stepped in this process, on its own."""

    def __init__(self, config: EngineConfig) -> None:
        from rawserve.engine.core import make_engine_core

        self.core = make_engine_core(config)
        self.runs = 0

    async def run(self, batch: list[list[int]], params: SamplingParams) -> int:
        self.runs += 1
        for i, ids in enumerate(batch):
            self.core.add_request(f"r{self.runs}-{i}", ids, params)
        tokens = 0
        while self.core.has_unfinished:
            for out in self.core.step():
                tokens += len(out.new_token_ids)
        return tokens

    async def close(self) -> None:
        pass


class AsyncLLMPath:
    """AsyncLLM with its core in a thread or a spawned process; the streams consumed on this loop."""

    def __init__(self, config: EngineConfig, tokenizer, mode: str, max_pending: int) -> None:
        from rawserve.engine.frontend.async_llm import AsyncLLM
        from rawserve.engine.launch import CoreFactory

        self.llm = AsyncLLM(CoreFactory(config, "warning"), tokenizer, mode=mode, max_pending=max_pending)
        self.runs = 0

    async def start(self) -> AsyncLLMPath:
        await self.llm.start()
        return self

    async def run(self, batch: list[list[int]], params: SamplingParams) -> int:
        self.runs += 1

        async def consume(stream) -> int:
            count = 0
            async for out in stream:
                count = out.num_output_tokens if out.finished else count
            return count

        return sum(await asyncio.gather(*(consume(self.llm.generate(ids, params, f"r{self.runs}-{i}"))
                                          for i, ids in enumerate(batch))))

    async def close(self) -> None:
        await self.llm.stop(0)


class ServerPath:
    """`python -m rawserve serve` (core in a process), driven by bench/client.py over HTTP + SSE."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def run(self, batch: list[list[int]], params: SamplingParams) -> int:
        from bench.client import call

        body = {"max_tokens": params.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        outcomes = await asyncio.gather(*(call("127.0.0.1", self.port, "/v1/completions", {**body, "prompt": ids})
                                          for ids in batch))
        failed = [o.error for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} server requests failed: {failed[:3]}")
        return sum(o.usage_tokens or 0 for o in outcomes)

    async def close(self) -> None:
        pass


async def measure(config: EngineConfig, tokenizer, port: int, batch: list[list[int]], output_len: int,
                  repeats: int) -> dict[str, list[float]]:
    """Every path built and warmed up first, then the timed runs interleaved (each repeat runs every path once),
    so load that comes and goes on a shared machine falls on all of them alike."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    paths = {"engine_core": EnginePath(config),
             "async_llm_thread": await AsyncLLMPath(config, tokenizer, "thread", len(batch) + 16).start(),
             "async_llm_process": await AsyncLLMPath(config, tokenizer, "process", len(batch) + 16).start(),
             "http_server": ServerPath(port)}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for path in paths.values():
            await path.run(batch[:8], params)  # warm-up
        for _ in range(repeats):
            for name, path in paths.items():
                started = time.perf_counter()
                tokens = await path.run(batch, params)
                rates[name].append(tokens / (time.perf_counter() - started))
    finally:
        for path in paths.values():
            await path.close()
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
        flags = ["--max-model-len", str(config.max_model_len), "--num-kv-blocks", str(config.num_kv_blocks),
                 "--max-num-seqs", str(config.max_num_seqs), "--no-enable-prefix-caching", "--device", "cpu",
                 "--max-pending", str(streams + 16)]
        proc, port = start_server(flags, model_dir)
        try:
            results = asyncio.run(measure(config, tokenizer, port, batch, args.output_len, args.repeats))
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
