"""Serving load generator: sweeps concurrency against a rawserve (or any OpenAI-compatible) server over raw
asyncio sockets; TTFT, ITL, TPOT and end-to-end p50/p99, output tok/s, req/s and errors per level.

python -m bench.serve [--url http://HOST:PORT | --model-dir DIR] [--concurrency 1,8,32] [--num-prompts N]
                      [--input-len 128] [--output-len 64] [--random-range 0.0] [--endpoint completions|chat]
                      [--no-stream] [--plot out.png] [--api-key K]
Without --url it starts `python -m rawserve serve` (the demo model unless --model-dir) and stops it after.
One JSON object per concurrency level on stdout, then a summary; logs go to stderr. --plot needs matplotlib.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.parse

from bench.client import Outcome, call, get_json, percentile


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def start_server(extra: list[str], model_dir: str | None = None) -> tuple[subprocess.Popen, int]:
    """`python -m rawserve serve` on a free port; returns once it listens."""
    command = [sys.executable, "-m", "rawserve", "serve", *([model_dir] if model_dir else []), "--port", "0",
               "--no-log-requests", *extra]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 300
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("the server exited before serving:\n" + "".join(lines))
        lines.append(line)
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        if match:
            import threading

            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
            return proc, int(match.group(1))
    proc.kill()
    raise RuntimeError("the server did not start within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def prompt_ids(host: str, port: int, api_key: str | None) -> list[int]:
    """Token ids of ordinary text (from the server's own /tokenize), cycled to build prompts of exact lengths."""
    from bench.client import request_bytes

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request_bytes(host, "/tokenize", {"prompt": "The quick brown fox jumps over the lazy dog. "
                                                   "Once upon a time there was a little dragon who loved stories."},
                               api_key))
    data = await reader.read(-1)
    writer.close()
    return json.loads(data.partition(b"\r\n\r\n")[2])["tokens"]


def make_payload(endpoint: str, model: str, ids: list[int], input_len: int, output_len: int, stream: bool,
                 text: str) -> dict:
    if endpoint == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": text}], "logprobs": True, "top_logprobs": 0}
    else:
        body = {"model": model, "prompt": (ids * (input_len // len(ids) + 1))[:input_len], "logprobs": 0}
    body.update(max_tokens=output_len, ignore_eos=True, temperature=0.0, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def run_level(host: str, port: int, path: str, payloads: list[dict], concurrency: int,
                    api_key: str | None) -> tuple[list[Outcome], float]:
    """Closed loop: `concurrency` clients, each sending its next payload as soon as its last one ends."""
    queue = list(reversed(payloads))
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while queue:
            outcomes.append(await call(host, port, path, queue.pop(), api_key=api_key))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, time.perf_counter() - started


def summarize(outcomes: list[Outcome], wall_s: float, concurrency: int) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    gaps = [g for o in ok for g in o.gaps_s]
    tpot = [(o.e2e_s - o.ttft_s) / (o.tokens - 1) for o in ok if o.ttft_s is not None and o.tokens > 1]
    e2e = [o.e2e_s for o in ok]
    tokens = sum(o.tokens for o in ok)
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or f"status {o.status}"] = errors.get(o.error or f"status {o.status}", 0) + 1
    return {"concurrency": concurrency, "requests": len(outcomes), "ok": len(ok), "errors": errors,
            "wall_s": round(wall_s, 3), "output_tok_s": round(tokens / wall_s, 1), "req_s": round(len(ok) / wall_s, 2),
            "ttft_ms_p50": ms(percentile(ttft, 0.5)), "ttft_ms_p99": ms(percentile(ttft, 0.99)),
            "itl_ms_p50": ms(percentile(gaps, 0.5)), "itl_ms_p99": ms(percentile(gaps, 0.99)),
            "tpot_ms_p50": ms(percentile(tpot, 0.5)), "tpot_ms_p99": ms(percentile(tpot, 0.99)),
            "e2e_ms_p50": ms(percentile(e2e, 0.5)), "e2e_ms_p99": ms(percentile(e2e, 0.99)),
            "usage_mismatches": sum(1 for o in ok if o.usage_tokens is not None and o.usage_tokens != o.tokens)}


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # bench-only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [r["concurrency"] for r in results]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(levels, [r["output_tok_s"] for r in results], "o-", color="tab:blue")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency")
    left.set_ylabel("output tok/s", color="tab:blue")
    right = left.twinx()
    right.plot(levels, [r["ttft_ms_p50"] or 0 for r in results], "s--", color="tab:red")
    right.set_ylabel("TTFT p50 (ms)", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")


async def bench(args: argparse.Namespace, host: str, port: int) -> list[dict]:
    status, models = await get_json(host, port, "/v1/models", args.api_key)
    model = models["data"][0]["id"] if status == 200 else "default"
    ids = await prompt_ids(host, port, args.api_key)
    rng = random.Random(args.seed)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    results = []
    for concurrency in args.concurrency:
        payloads = []
        for _ in range(args.num_prompts or concurrency * 4):
            scale = lambda n: max(1, round(n * rng.uniform(1 - args.random_range, 1 + args.random_range)))  # noqa: E731
            input_len, output_len = scale(args.input_len), scale(args.output_len)
            text = " ".join(rng.choice(("the", "dragon", "story", "little", "time", "once")) for _ in range(input_len))
            payloads.append(make_payload(args.endpoint, model, ids, input_len, output_len, not args.no_stream, text))
        outcomes, wall_s = await run_level(host, port, path, payloads, concurrency, args.api_key)
        result = {"bench": "serve", "endpoint": args.endpoint, "stream": not args.no_stream,
                  "input_len": args.input_len, "output_len": args.output_len, "random_range": args.random_range,
                  **summarize(outcomes, wall_s, concurrency)}
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve")
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (default: start one)")
    parser.add_argument("--model-dir", help="checkpoint for the server this starts (default: the demo model)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for the server it starts")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--num-prompts", type=int, default=0, help="requests per level (default 4 x concurrency)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-range", type=float, default=0.0, help="lengths uniform in len x (1 +- this)")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write tok/s and TTFT against concurrency to this PNG (matplotlib)")
    args = parser.parse_args(argv)
    proc = None
    if args.url:
        url = urllib.parse.urlparse(args.url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
    else:
        proc, port = start_server(["--max-model-len", "4096", *args.server_arg], args.model_dir)
        host = "127.0.0.1"
    try:
        results = asyncio.run(bench(args, host, port))
    finally:
        if proc is not None:
            stop_server(proc)
    best = max(results, key=lambda r: r["output_tok_s"])
    print(json.dumps({"bench": "serve", "summary": True, "best_concurrency": best["concurrency"],
                      "best_output_tok_s": best["output_tok_s"], "cpus": os.cpu_count()}), flush=True)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
