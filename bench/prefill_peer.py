"""Prefill speed against llama.cpp's server: the same N-token prompt (token ids) with one output token to rawserve
and to llama-server on the same checkpoint (HF directory and its GGUF), equal threads, alternating rounds.

python -m bench.prefill_peer [--prompt-tokens 4096] [--rounds 3] [--threads 2] [--dtype bfloat16]
    [--model-dir ~/.cache/rawserve-peers/models/qwen35-0.8b-random]
    [--gguf ~/.cache/rawserve-peers/gguf/qwen35-0.8b-random-bf16.gguf] [-- extra rawserve serve flags]
Both servers stay up for the whole run and are asked one at a time, so neither competes with the other's
requests. Each round sends a fresh random prompt (no prefix-cache or prompt-cache hit on either side; llama.cpp
also gets cache_prompt false). rawserve's figure is prompt tokens over the client's wall time of the request
(the one sampled token included, HTTP on loopback); llama.cpp's is its own timings.prompt_per_second, and its
client-side figure is printed beside it. One JSON object per round and peer, then a summary with the ratios.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import time

from bench.model_forward import rev
from bench.procs import free_port, wait_healthy
from bench.serve import log, start_server, stop_server

PEERS = os.path.expanduser("~/.cache/rawserve-peers")


def post(port: int, path: str, body: dict, timeout_s: float = 900) -> tuple[dict, float]:
    """One JSON POST on a fresh loopback connection -> (response, seconds from send to the whole answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    data = json.dumps(body).encode()
    started = time.perf_counter()
    conn.request("POST", path, data, {"content-type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    elapsed = time.perf_counter() - started
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"{path}: {response.status} {payload[:300]!r}")
    return json.loads(payload), elapsed


def start_llama(args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
               str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", str(args.prompt_tokens + 64),
               "--no-webui"]
    log("starting", " ".join(command))
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_healthy(proc, port, "llama-server")
    return proc, port


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-dir", default=f"{PEERS}/models/qwen35-0.8b-random")
    parser.add_argument("--gguf", default=f"{PEERS}/gguf/qwen35-0.8b-random-bf16.gguf")
    parser.add_argument("--llama-server", default=f"{PEERS}/llama.cpp/build/bin/llama-server")
    args = parser.parse_args(argv)
    n = args.prompt_tokens
    base = {"bench": "prefill_peer", "model_dir": os.path.basename(args.model_dir), "dtype": args.dtype,
            "prompt_tokens": n, "threads": args.threads, "rev": rev(), "rawserve_flags": " ".join(extra)}
    # Small pools: the machine is shared, and one sequence at a time is all this asks of either server.
    flags = ["--dtype", args.dtype, "--num-threads", str(args.threads), "--max-model-len", str(n + 64),
             "--max-num-seqs", "2", "--kv-cache-memory-gb", "1", "--served-model-name", "m", *extra]
    rawserve, rawserve_port = start_server(flags, args.model_dir)
    llama = None
    try:
        wait_healthy(rawserve, rawserve_port, "rawserve")
        llama, llama_port = start_llama(args)
        rng = random.Random(0)
        ours, theirs, theirs_client = [], [], []
        for round_index in range(args.rounds + 1):  # round 0 warms both up and is reported as such
            ids = [rng.randrange(1000, 100000) for _ in range(n)]
            _, elapsed = post(rawserve_port, "/v1/completions",
                              {"model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0})
            answer, llama_elapsed = post(llama_port, "/completion",
                                         {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0})
            timings = answer["timings"]
            assert timings["prompt_n"] == n, f"llama.cpp evaluated {timings['prompt_n']} of {n} prompt tokens"
            row = {**base, "round": round_index, "warmup": round_index == 0,
                   "load_avg_1m": round(os.getloadavg()[0], 2)}
            print(json.dumps({**row, "peer": "rawserve", "prefill_tok_s": round(n / elapsed, 1),
                              "request_ms": round(elapsed * 1e3, 1)}), flush=True)
            print(json.dumps({**row, "peer": "llama-server", "prefill_tok_s": round(timings["prompt_per_second"], 1),
                              "prompt_ms": round(timings["prompt_ms"], 1),
                              "client_tok_s": round(n / llama_elapsed, 1),
                              "request_ms": round(llama_elapsed * 1e3, 1)}), flush=True)
            if round_index:
                ours.append(n / elapsed)
                theirs.append(timings["prompt_per_second"])
                theirs_client.append(n / llama_elapsed)
        mine, peer, peer_client = (statistics.median(v) for v in (ours, theirs, theirs_client))
        print(json.dumps({**base, "summary": True, "rounds": args.rounds, "rawserve_tok_s_median": round(mine, 1),
                          "llama_tok_s_median": round(peer, 1), "llama_client_tok_s_median": round(peer_client, 1),
                          "ratio_vs_llama_timings": round(mine / peer, 3),
                          "ratio_client_side": round(mine / peer_client, 3),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        if llama is not None:
            llama.terminate()
            try:
                llama.wait(60)
            except subprocess.TimeoutExpired:
                llama.kill()
                llama.wait()
        stop_server(rawserve)


if __name__ == "__main__":
    main()
