"""`rawserve demo`: the whole server in one command, no checkpoint needed. Starts `rawserve serve` on the demo
model (engine core in its own process), then acts as its client and prints one JSON object per line on stdout:
the model list, a forced get_weather tool call, a streamed completion's SSE events, N concurrent streams'
throughput and TTFT, and the key /metrics lines. Logs go to stderr.

A client on the standard library alone (http.client in threads): the server runs in its own process, so
the client's threads cost the server nothing.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from rawserve.config import LOG_LEVELS, apply_environment

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    # maxLength: the demo model has random weights, and an unbounded string could run to max_tokens.
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
METRIC_NAMES = ("prompt_tokens_total", "generation_tokens_total", "request_success_total",
                "time_to_first_token_seconds_count", "time_to_first_token_seconds_sum",
                "e2e_request_latency_seconds_count", "kv_cache_usage_perc", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "num_preemptions_total")
_PORT_LINE = re.compile(r"listening on https?://[^ ]*:(\d+)/v1")


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Client:
    """Just enough HTTP for the demo: JSON requests, and SSE streams read line by line."""

    def __init__(self, port: int, timeout_s: float = 300.0) -> None:
        self.port = port
        self.timeout_s = timeout_s

    def _send(self, method: str, path: str, body: dict | None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"content-type": "application/json"} if data else {})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status} {response.read()[:500]!r}")
        return response

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        with self._send(method, path, body) as response:
            return json.loads(response.read())

    def text(self, path: str) -> str:
        with self._send("GET", path, None) as response:
            return response.read().decode()

    def events(self, path: str, body: dict) -> Iterator[tuple[float, dict | str]]:
        """(arrival time, event) per SSE data line; '[DONE]' comes as the string."""
        with self._send("POST", path, body) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    payload = line[6:]
                    yield time.perf_counter(), payload if payload == "[DONE]" else json.loads(payload)


def start_server(model_dir: str | None, engine_mode: str, log_level: str) -> tuple[subprocess.Popen, int]:
    """`rawserve serve` on a free port; returns once it listens (its startup summary names the port)."""
    command = [sys.executable, "-m", "rawserve", "serve", "--port", "0", "--engine-mode", engine_mode,
               "--log-level", log_level if log_level != "warning" else "info", "--disable-log-requests",
               "--max-model-len", "1024"]
    if model_dir is not None:
        command += ["--model-dir", model_dir]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAWSERVE_")}  # the demo's flags, not the shell's
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 600
    seen: list[str] = []
    port = None
    while port is None:
        line = proc.stderr.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("the server did not start:\n" + "".join(seen[-20:]))
        seen.append(line)
        if log_level != "warning":
            sys.stderr.write(line)
        match = _PORT_LINE.search(line)
        port = int(match.group(1)) if match else None
    # Keep reading its stderr so a full pipe never blocks it; show what the chosen level asks for.
    def pump() -> None:
        for line in proc.stderr:
            if log_level != "warning" or " WARNING " in line or " ERROR " in line:
                sys.stderr.write(line)

    threading.Thread(target=pump, name="rawserve-demo-logs", daemon=True).start()
    return proc, port


def tool_call(client: Client, model: str) -> dict:
    r = client.json("POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 128, "seed": 0})
    choice = r["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return {"step": "tool_call", "finish_reason": choice["finish_reason"],
            "tool_calls": [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                           for c in calls], "usage": r["usage"]}


def streamed(client: Client, model: str, new_tokens: int) -> dict:
    events = [e for _, e in client.events("/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": new_tokens, "stream": True,
        "stream_options": {"include_usage": True}})]
    data = [e for e in events if e != "[DONE]"]
    return {"step": "stream", "num_events": len(events), "first_event": data[0] if data else None,
            "last_event": data[-1] if data else None, "ends_with_done": bool(events) and events[-1] == "[DONE]"}


def concurrent_streams(client: Client, model: str, num_requests: int, new_tokens: int) -> dict:
    def one(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        first = None
        num_tokens = 0
        for at, event in client.events("/v1/completions", {
                "model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": new_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}):
            if isinstance(event, dict):
                if first is None and any(c.get("text") for c in event.get("choices", [])):
                    first = at
                if event.get("usage"):
                    num_tokens = event["usage"]["completion_tokens"]
        return (first if first is not None else time.perf_counter()) - start, num_tokens

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        results = list(pool.map(one, range(num_requests)))
    wall_s = time.perf_counter() - started
    ttfts = sorted(t for t, _ in results)
    num_tokens = sum(n for _, n in results)
    return {"step": "concurrent", "requests": num_requests, "new_tokens": new_tokens, "output_tokens": num_tokens,
            "wall_s": round(wall_s, 3), "output_tok_s": round(num_tokens / wall_s, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1), "ttft_max_ms": round(ttfts[-1] * 1000, 1)}


def key_metrics(client: Client) -> dict:
    lines = [line for line in client.text("/metrics").splitlines()
             if not line.startswith("#") and any(f":{name}{{" in line for name in METRIC_NAMES)]
    return {"step": "metrics", "lines": lines}


def build_demo_parser() -> argparse.ArgumentParser:
    """The demo's flags, their defaults taken from RAWSERVE_<FLAG>; the CLI parses with it, strictly."""
    parser = argparse.ArgumentParser(prog="rawserve demo", allow_abbrev=False, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32, help="Concurrent streaming requests.")
    parser.add_argument("--new-tokens", type=int, default=32, help="Tokens each of them generates.")
    parser.add_argument("--model-dir", "--model", default=None, help="Checkpoint; default: the demo model.")
    parser.add_argument("--engine-mode", default="process", choices=("process", "thread"),
                        help="Where the engine core runs.")
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                        help="The server's stderr: warning shows only warnings and errors.")
    apply_environment(parser, os.environ)
    return parser


def run_demo(args: argparse.Namespace) -> int:
    """Serve, exercise and stop: 0 when every step ran and the server then exited cleanly."""
    if args.model_dir is None:  # built here (once, with progress); the server finds it cached by that name
        from rawserve.demo_model import ensure_demo_model
        from rawserve.logs import setup_logging

        setup_logging("info")
        ensure_demo_model()
    proc, port = start_server(args.model_dir, args.engine_mode, args.log_level)
    try:
        client = Client(port)
        models = client.json("GET", "/v1/models")
        model = models["data"][0]["id"]
        emit({"step": "models", "port": port, "models": [m["id"] for m in models["data"]]})
        emit(tool_call(client, model))
        emit(streamed(client, model, args.new_tokens))
        emit(concurrent_streams(client, model, args.requests, args.new_tokens))
        emit(key_metrics(client))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
    return 0 if status == 0 else 1
