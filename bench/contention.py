"""Serving beside busy processes: output tok/s at 1 and 8 streams and one n=8 request's latency, alone and beside
one and two busy processes pinned to the server's CPUs, for rawserve and llama.cpp's llama-server in one run.

python -m bench.contention [--cases stream1,stream8,n8,n8-demo] [--servers rawserve,llama] [--busy python|torch]
                           [--rounds 1] [--max-tokens 64] [--rawserve-flags FLAGS ...]
Servers start once and stay up; each round measures every case at each load level for each server in turn, so
the servers see the same neighbours step by step. One JSON line per (case, server): alone, beside1, beside2 and
the slowdowns (alone / beside for tok/s, beside / alone for latency; medians over rounds), after a meta line
with the load average. The tiny checkpoint and llama.cpp come from ../shared/peers (run.sh setup); n8-demo is
rawserve's n=8 on the demo model (llama.cpp has no GGUF of it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import signal
import statistics
import subprocess
import sys
import time

from bench.checkpoints import rev
from bench.client import call
from bench.procs import wait_healthy
from bench.serve import log, start_server, stop_server

PEERS = pathlib.Path(os.environ.get("PEERS_ROOT", pathlib.Path.home() / ".cache/rawserve-peers"))
CASES = ("stream1", "stream8", "n8", "n8-demo")
PROMPT = list(range(200, 328))  # 128 ids inside every vocabulary here (the demo model's is the smallest)
BUSY = {"python": "while True:\n    pass\n",
        "torch": "import torch\na = torch.randn(512, 512)\nwhile True:\n    a @ a\n"}


def start_llama(port: int, gguf: pathlib.Path, parallel: int) -> subprocess.Popen:
    """llama-server as ../shared/peers/run.sh starts it (threads = CPUs), answering once /health is 200."""
    binary = PEERS / "llama.cpp/build/bin/llama-server"
    cpus = str(len(os.sched_getaffinity(0)))
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--alias", "tiny", "--host", "127.0.0.1", "--port",
                             str(port), "-t", cpus, "-tb", cpus, "-np", str(parallel), "-c", str(parallel * 512),
                             "-kvu", "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy(proc, port, "llama-server", timeout_s=300)
    except RuntimeError:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc


def start_busy(count: int, kind: str, cpus: set[int]) -> list[subprocess.Popen]:
    """`count` busy processes pinned to `cpus` (the servers'), as a neighbour on a shared host would be."""
    procs = []
    for _ in range(count):
        proc = subprocess.Popen([sys.executable, "-c", BUSY[kind]], stdout=subprocess.DEVNULL)
        os.sched_setaffinity(proc.pid, cpus)
        procs.append(proc)
    time.sleep(0.5)  # let them get going (and torch's import finish)
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


async def measure(case: str, server: str, port: int, model: str, max_tokens: int, n8_tokens: int) -> float:
    """tok/s for stream1/stream8 (3 and 8 requests); seconds for n8 (one n=8 request of n8_tokens; llama-server,
    which takes no n, gets the same prompt 8 times at once)."""
    body = {"model": model, "prompt": PROMPT, "temperature": 1.0, "ignore_eos": True, "seed": 1}
    if case.startswith("n8"):
        body["max_tokens"] = n8_tokens
        if server.startswith("rawserve"):
            calls = [call("127.0.0.1", port, "/v1/completions", {**body, "n": 8})]
        else:
            calls = [call("127.0.0.1", port, "/v1/completions", body) for _ in range(8)]
        started = time.perf_counter()
        outcomes = await asyncio.gather(*calls)
        seconds = time.perf_counter() - started
    else:
        body["max_tokens"] = max_tokens
        streams, requests = (1, 3) if case == "stream1" else (8, 8)
        queue = [body] * requests
        outcomes = []

        async def client() -> None:
            while queue:
                queue.pop()
                outcomes.append(await call("127.0.0.1", port, "/v1/completions", body))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        seconds = time.perf_counter() - started
    bad = [o for o in outcomes if o.status != 200 or o.error]
    if bad:
        raise RuntimeError(f"{server} {case}: {bad[0].status} {bad[0].error}")
    tokens = sum(o.usage_tokens or 0 for o in outcomes)
    return seconds if case.startswith("n8") else tokens / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--servers", default="rawserve,llama")
    parser.add_argument("--busy", default="python", choices=sorted(BUSY))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64, help="Output tokens of each stream1/stream8 request.")
    parser.add_argument("--n8-tokens", type=int, default=200, help="Output tokens of each of the n=8 sequences.")
    parser.add_argument("--model-dir", default=str(PEERS / "models/qwen3-tiny-random"))
    parser.add_argument("--gguf", default=str(PEERS / "gguf/qwen3-tiny-random-f32.gguf"))
    parser.add_argument("--rawserve-flags", action="append", default=None,
                        help="More flags for rawserve's servers; repeat it to run each variant side by side "
                             "(e.g. --rawserve-flags= --rawserve-flags='--num-threads 1': with '=', as the value starts with --).")
    parser.add_argument("--llama-port", type=int, default=8091)
    args = parser.parse_args(argv)
    # A SIGTERM (timeout, a CI's kill) unwinds through the finally below: no server or neighbour outlives us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = args.cases.split(",")
    variants = args.rawserve_flags or [""]
    servers = [name for name in args.servers.split(",") if name != "rawserve"]
    if "rawserve" in args.servers.split(","):
        servers[:0] = [f"rawserve {flags}".strip() for flags in variants]
    started: dict[tuple[str, str], tuple[int, str]] = {}  # (server, model) -> (port, served name)
    to_stop: list = []
    try:
        for flags in variants if servers[0].startswith("rawserve") else ():
            name, extra = f"rawserve {flags}".strip(), ["--dtype", "float32", "--max-model-len", "512",
                                                         *shlex.split(flags)]
            if any(case != "n8-demo" for case in cases):
                proc, port = start_server([*extra, "--served-model-name", "tiny"], args.model_dir)
                to_stop.append(proc)
                started[name, "tiny"] = (port, "tiny")
            if "n8-demo" in cases:
                proc, port = start_server(extra)
                to_stop.append(proc)
                started[name, "demo"] = (port, "rawserve-demo")
        if "llama" in servers and any(case != "n8-demo" for case in cases):
            to_stop.append(start_llama(args.llama_port, pathlib.Path(args.gguf), 8))
            started["llama", "tiny"] = (args.llama_port, "tiny")
        cpus = os.sched_getaffinity(0)
        print(json.dumps({"meta": True, "load_avg": os.getloadavg(), "cpus": sorted(cpus), "busy": args.busy,
                          "rounds": args.rounds, "max_tokens": args.max_tokens,
                          "n8_tokens": args.n8_tokens, "rawserve_variants": variants, "rev": rev()}),
              flush=True)
        plan = [(case, server, started[server, "demo" if case == "n8-demo" else "tiny"]) for case in cases
                for server in servers if (server, "demo" if case == "n8-demo" else "tiny") in started]
        for case, server, (port, model) in plan:  # warm up every path once
            asyncio.run(measure(case, server, port, model, 8, 8))
        results: dict[tuple[str, str], dict[int, list[float]]] = {}
        for _ in range(args.rounds):
            for busy in (0, 1, 2):
                neighbours = start_busy(busy, args.busy, cpus)
                try:
                    for case, server, (port, model) in plan:
                        value = asyncio.run(measure(case, server, port, model, args.max_tokens, args.n8_tokens))
                        results.setdefault((case, server), {}).setdefault(busy, []).append(value)
                        log(f"{case} {server} beside {busy}: {value:.2f}")
                finally:
                    stop_busy(neighbours)
        for (case, server), by_busy in results.items():
            alone, beside1, beside2 = (statistics.median(by_busy[n]) for n in (0, 1, 2))
            latency = case.startswith("n8")
            slow = (lambda x: x / alone) if latency else (lambda x: alone / x)
            print(json.dumps({"case": case, "server": server, "unit": "s" if latency else "tok/s",
                              "alone": round(alone, 3), "beside1": round(beside1, 3), "beside2": round(beside2, 3),
                              "slowdown1": round(slow(beside1), 2), "slowdown2": round(slow(beside2), 2),
                              "load_avg_end": [round(x, 2) for x in os.getloadavg()]}), flush=True)
    finally:
        for proc in to_stop:
            if proc.args[0].endswith("llama-server"):
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(30)
            else:
                stop_server(proc)


if __name__ == "__main__":
    main()
