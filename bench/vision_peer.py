"""Image time to first token side by side with llama.cpp's server (issue 28's target: rawserve no slower): the same
Qwen3.5-0.8B-shaped random checkpoint (HF files for rawserve, its bf16 GGUF + f16 mmproj for llama-server), the same
chat request with one image (a PNG data: URL, a fresh image each repeat so no cache helps either side), max_tokens 1.

python -m bench.vision_peer [--sizes 448x448,1024x768,1920x1080] [--reps 5] [--threads 2] [--dtype bfloat16]
                           [--peers ~/.cache/rawserve-peers] [--rawserve-args "..."]
Both servers are up at once but idle but for the one request in flight: each repeat sends the image to one and then
the other, the order alternating, so load drift on the shared machine falls on both alike. A request's time is its
whole max_tokens=1 exchange (a stream's first chunk would come before any work on rawserve: it carries only the
role). Both sides must give the image the same grid: each side's image tokens are its reply's prompt_tokens less
those of the same text alone and the two vision markers. Prints one JSON object per size, then a summary line.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bench.model_forward import rev
from bench.procs import free_port, wait_healthy

PEERS = os.path.expanduser("~/.cache/rawserve-peers")
PROMPT = "Describe this picture."


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def start(command: list[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    log("starting:", shlex.join(command))
    with open(log_path, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def png_url(width: int, height: int, seed: int) -> str:
    """A fresh picture per seed: a gradient under noise, so the PNG is about as large as a photo's."""
    from PIL import Image

    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buffer = io.BytesIO()
    Image.blend(base, noise, 0.25).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(port: int, model: str, url: str | None) -> tuple[float, dict]:
    """-> (ms of one max_tokens=1 chat request with the image (None: the text alone), its reply)."""
    image = [{"type": "image_url", "image_url": {"url": url}}] if url is not None else []
    body = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        *image, {"type": "text", "text": PROMPT}]}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        reply = json.loads(response.read())
    return (time.perf_counter() - started) * 1e3, reply


def rawserve_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        page = response.read().decode()
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", page, re.M))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="448x448,1024x768,1920x1080")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--peers", default=PEERS)
    parser.add_argument("--rawserve-args", default="", help="extra rawserve flags, one shell string")
    parser.add_argument("--llama-args", default="", help="extra llama-server flags, one shell string")
    args = parser.parse_args()
    gguf_type = {"bfloat16": "bf16", "float32": "f32"}[args.dtype]
    model_dir = f"{args.peers}/models/qwen35-0.8b-random"
    gguf = f"{args.peers}/gguf/qwen35-0.8b-random-{gguf_type}.gguf"
    mmproj = f"{args.peers}/gguf/mmproj-qwen35-0.8b-random-f16.gguf"
    llama_bin = f"{args.peers}/llama.cpp/build/bin/llama-server"
    logs = f"{args.peers}/logs"
    os.makedirs(logs, exist_ok=True)
    rs_port, ll_port = free_port(), free_port()
    rs_log, ll_log = f"{logs}/vision-peer-rawserve.log", f"{logs}/vision-peer-llama.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    servers = []
    # the servers run in their own sessions: a SIGTERM to this script must still stop them (in `finally`)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        servers.append(start([sys.executable, "-m", "rawserve", "--model-dir", model_dir, "--served-model-name", "m",
                              "--host", "127.0.0.1", "--port", str(rs_port), "--dtype", args.dtype,
                              "--num-threads", str(args.threads), "--max-model-len", "8192", "--no-log-requests",
                              *shlex.split(args.rawserve_args)], rs_log, env))
        # one slot and context for the largest image: the request is alone, as on rawserve's side
        servers.append(start([llama_bin, "-m", gguf, "--mmproj", mmproj, "--alias", "m", "--host", "127.0.0.1",
                              "--port", str(ll_port), "-t", str(args.threads), "-tb", str(args.threads), "-np", "1",
                              "-c", "8192", "--no-webui", *shlex.split(args.llama_args)], ll_log))
        wait_healthy(servers[0], rs_port, "rawserve")
        wait_healthy(servers[1], ll_port, "llama-server")
        sides = {"rawserve": rs_port, "llama": ll_port}
        text_tokens = {}
        for name, port in sides.items():  # warm each: first-request costs are not what we compare
            ask(port, "m", png_url(64, 64, 0))
            # the prompt without the image: a reply's prompt_tokens less this and the two vision markers are the
            # image's tokens, on either side
            text_tokens[name] = ask(port, "m", None)[1]["usage"]["prompt_tokens"]
            log(f"{name} warm; {text_tokens[name]} text tokens")
        summary = []
        for size in args.sizes.split(","):
            width, height = (int(v) for v in size.split("x"))
            times: dict[str, list[float]] = {name: [] for name in sides}
            prompt_tokens: dict[str, set[int]] = {name: set() for name in sides}
            llama_prompt_ms: list[float] = []
            encoder_s = rawserve_metric(rs_port, "rawserve:mm_encoder_seconds_total")
            for rep in range(args.reps):
                url = png_url(width, height, hash((size, rep)) & 0xFFFFFFFF)
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for name in order:
                    ms, reply = ask(sides[name], "m", url)
                    times[name].append(ms)
                    prompt_tokens[name].add(reply["usage"]["prompt_tokens"])
                    if name == "llama":  # llama-server's own prompt time (image encode + prefill), for reference
                        llama_prompt_ms.append(reply.get("timings", {}).get("prompt_ms", float("nan")))
                    log(f"{size} rep {rep} {name}: {ms:.0f} ms")
            encoder_s = rawserve_metric(rs_port, "rawserve:mm_encoder_seconds_total") - encoder_s
            rs_ms, ll_ms = statistics.median(times["rawserve"]), statistics.median(times["llama"])
            line = {"bench": "vision_peer", "model": "qwen35-0.8b-random", "dtype": args.dtype, "threads": args.threads,
                    "image": size, "reps": args.reps, "rawserve_ttft_ms_median": round(rs_ms, 1),
                    "llama_ttft_ms_median": round(ll_ms, 1), "ratio_llama_over_rawserve": round(ll_ms / rs_ms, 3),
                    "rawserve_ttft_ms": [round(t) for t in times["rawserve"]],
                    "llama_ttft_ms": [round(t) for t in times["llama"]],
                    "rawserve_prompt_tokens": sorted(prompt_tokens["rawserve"]),
                    "llama_prompt_tokens": sorted(prompt_tokens["llama"]),
                    "rawserve_image_tokens": sorted(n - text_tokens["rawserve"] - 2 for n in prompt_tokens["rawserve"]),
                    "llama_image_tokens": sorted(n - text_tokens["llama"] - 2 for n in prompt_tokens["llama"]),
                    "rawserve_encoder_ms_mean": round(encoder_s * 1e3 / args.reps, 1),
                    "llama_prompt_ms_median": round(statistics.median(llama_prompt_ms), 1),
                    "rev": rev(), "load_avg_1m": round(os.getloadavg()[0], 2)}
            summary.append(line)
            print(json.dumps(line), flush=True)
        print(json.dumps({"bench": "vision_peer_summary", "dtype": args.dtype, "threads": args.threads,
                          "ratios": {line["image"]: line["ratio_llama_over_rawserve"] for line in summary},
                          "rev": rev(), "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        for proc in servers:
            stop(proc)


if __name__ == "__main__":
    main()
