"""Soak: minutes of mixed traffic at high concurrency against a real server, then checks that nothing leaked.

python -m bench.soak [--seconds 600] [--concurrency 256] [--model-dir DIR] [--seed 0]
The mix: 20% of clients leave mid-stream, 5% read slowly, 5% send malformed or oversized requests, 5% never read;
the rest are ordinary requests (chat or completions, streamed or not) whose usage.completion_tokens must equal
the tokens received. At the end: /health 200, every KV block free, nothing in flight, the API process's asyncio
task count back to its baseline, RSS growth under 10% over the second half. JSON lines on stdout: progress
every 30 s, then the result with each check; exit status 1 if a check failed.

The server is this module again (`--serve-child`): rawserve's OpenAIServer in its own process (the core in a
third), which prints its task count when sent SIGUSR1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

from bench import hostile
from bench.client import Outcome, call, get_json, request_bytes, send_raw

SERVER_FLAGS = ["--max-model-len", "1024", "--num-kv-blocks", "2048", "--write-timeout-s", "5",
                "--max-body-bytes", str(1 << 20), "--no-log-requests", "--log-level", "warning"]
RSS_GROWTH_LIMIT = 0.10


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


# ----- the server child -------------------------------------------------------------------------------------

def serve_child(argv: list[str]) -> int:
    from rawserve.api.app import OpenAIServer
    from rawserve.cli import parse_with_model
    from rawserve.config import build_parser, configs_from_args
    from rawserve.logs import setup_logging

    engine, server = configs_from_args(parse_with_model(build_parser("bench.soak"), argv))
    setup_logging(server.log_level)

    async def run() -> int:
        app = OpenAIServer(engine, server)
        await app.start()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: print(f"TASKS {len(asyncio.all_tasks(loop))}", flush=True))
        print(f"PORT {app.port}", flush=True)
        return await app.serve()

    return asyncio.run(run())


class Child:
    def __init__(self, model_dir: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.soak", "--serve-child", model_dir, "--port", "0",
                                      *SERVER_FLAGS], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"the server child did not start: {line!r}")
        self.port = int(line.split()[1])
        self._tasks: list[int] = []
        self._got = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("TASKS "):
                with self._got:
                    self._tasks.append(int(line.split()[1]))
                    self._got.notify_all()

    def task_count(self) -> int:
        with self._got:
            seen = len(self._tasks)
            self.proc.send_signal(signal.SIGUSR1)
            self._got.wait_for(lambda: len(self._tasks) > seen, 10)
            return self._tasks[-1]

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ----- the traffic ------------------------------------------------------------------------------------------

def malformed(rng: random.Random, host: str, model: str) -> tuple[bytes, tuple[int, ...]]:
    """A bad request and the statuses it may get (never a 5xx): half the time one of the hostile run's cases."""
    if rng.random() < 0.5:
        case = rng.choice(hostile.CASES)
        return case.build(host, model), case.allowed
    choice = rng.randrange(7)
    if choice == 0:
        return request_bytes(host, "/v1/chat/completions", b'{"messages": [oops'), (400,)
    if choice == 1:
        return request_bytes(host, "/v1/completions", {"prompt": "x", "temperature": "hot"}), (400,)
    if choice == 2:  # over --max-body-bytes: refused from its head
        return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000000\r\n\r\n" + b"{" * 1000), (413,)
    if choice == 3:  # fits the body limit, far over the context
        return request_bytes(host, "/v1/completions", {"prompt": "dragon " * 120000, "max_tokens": 4}), (400,)
    if choice == 4:
        return b"GET / HTTP/9.9\r\n\r\n", (400, 505, 0)
    if choice == 5:
        return request_bytes(host, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "chat_template_kwargs": {"messages": []}}), (400,)
    return request_bytes(host, "/v1/completions", {"prompt": [[1, 2]] * 40, "n": 40, "max_tokens": 2}), (400,)


class Tally:
    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}
        self.normal_ok = 0
        self.normal_failed: dict[str, int] = {}
        self.usage_mismatches: list[tuple[int | None, int]] = []
        self.bad_status: dict[str, int] = {}
        self.tokens = 0

    def add(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def one_client(host: str, port: int, rng: random.Random, tally: Tally, model: str) -> None:
    roll = rng.random()
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": rng.randint(4, 48), "temperature": rng.choice((0.0, 0.8)),
                  "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body.update(messages=[{"role": "user", "content": "Tell me a story " * rng.randint(1, 20)}], logprobs=True,
                    top_logprobs=0)
    else:
        body.update(prompt="Once upon a time " * rng.randint(1, 20), logprobs=0)
    if roll < 0.20:
        tally.add("leave_mid_stream")
        body.update(max_tokens=200, ignore_eos=True)
        await call(host, port, path, body, leave_after_events=rng.randint(1, 5))
    elif roll < 0.25:
        tally.add("slow_reader")
        await call(host, port, path, body, read_delay_s=0.2)
    elif roll < 0.30:
        tally.add("malformed")
        data, allowed = malformed(rng, host, model)
        status = await send_raw(host, port, data)
        if status not in allowed:
            tally.bad_status[str(status)] = tally.bad_status.get(str(status), 0) + 1
    elif roll < 0.35:
        tally.add("never_read")
        body.update(max_tokens=400, ignore_eos=True)
        await call(host, port, path, body, never_read=True, timeout_s=rng.uniform(2, 8))
    else:
        tally.add("normal")
        body["stream"] = rng.random() < 0.7
        if not body["stream"]:
            body.pop("stream_options")
        outcome: Outcome = await call(host, port, path, body, timeout_s=300)
        if outcome.ok:
            tally.normal_ok += 1
            tally.tokens += outcome.tokens
            if outcome.usage_tokens != outcome.tokens:
                tally.usage_mismatches.append((outcome.usage_tokens, outcome.tokens))
        else:
            key = outcome.error or f"status {outcome.status}"
            tally.normal_failed[key] = tally.normal_failed.get(key, 0) + 1


async def metrics(host: str, port: int) -> dict[str, float]:
    _, text = await get_json(host, port, "/metrics")
    values = {}
    for line in str(text).splitlines():
        if line.startswith("rawserve:") and "{" in line:
            name = line.split("{", 1)[0][len("rawserve:"):]
            if name in ("kv_cache_usage_perc", "requests_in_flight", "num_requests_running", "num_requests_waiting"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


async def soak(child: Child, seconds: float, concurrency: int, seed: int, catalog_first: bool = False) -> dict:
    host, port = "127.0.0.1", child.port
    _, models = await get_json(host, port, "/v1/models")
    model = models["data"][0]["id"]
    catalog_failures = await hostile.run_catalog(host, port, model) if catalog_first else []
    rng = random.Random(seed)
    tally = Tally()
    # Warm up, then take the baselines at rest.
    await asyncio.gather(*(call(host, port, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
                           for _ in range(8)))
    await asyncio.sleep(1.0)
    baseline_tasks = child.task_count()
    rss: list[tuple[float, float]] = [(0.0, child.rss_mib())]
    started = time.monotonic()
    stop_at = started + seconds

    async def worker(k: int) -> None:
        local = random.Random(rng.random())
        while time.monotonic() < stop_at:
            await one_client(host, port, local, tally, model)

    async def sampler() -> None:
        last_report = started
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(5.0, max(0.1, stop_at - time.monotonic())))
            now = time.monotonic()
            rss.append((now - started, child.rss_mib()))
            if now - last_report >= 30:
                last_report = now
                print(json.dumps({"bench": "soak", "progress_s": round(now - started), "rss_mib": rss[-1][1],
                                  "completed": tally.normal_ok, "kinds": tally.kinds}), flush=True)

    await asyncio.gather(sampler(), *(worker(k) for k in range(concurrency)))
    elapsed = time.monotonic() - started
    # Let the server settle: dropped never-readers time out (write timeout), aborted requests are freed.
    deadline = time.monotonic() + 30
    final = await metrics(host, port)
    while time.monotonic() < deadline and (final.get("requests_in_flight") or final.get("kv_cache_usage_perc")):
        await asyncio.sleep(0.5)
        final = await metrics(host, port)
    await asyncio.sleep(1.0)
    end_tasks = child.task_count()
    health, _ = await get_json(host, port, "/health")
    half = [r for t, r in rss if t >= elapsed / 2]
    growth = (half[-1] - half[0]) / half[0] if len(half) >= 2 else 0.0
    checks = {
        "health_200": health == 200,
        "kv_blocks_all_free": final.get("kv_cache_usage_perc") == 0.0,
        "nothing_in_flight": final.get("requests_in_flight") == 0.0 and final.get("num_requests_running") == 0.0,
        "tasks_back_to_baseline": end_tasks <= baseline_tasks,
        "rss_growth_second_half_under_10pct": growth < RSS_GROWTH_LIMIT,
        "usage_equals_tokens_received": not tally.usage_mismatches,
        "malformed_never_5xx": not tally.bad_status,
        "normal_requests_completed": tally.normal_ok > 0 and not tally.normal_failed,
        "hostile_catalog_held": not catalog_failures,
    }
    return {"bench": "soak", "seconds": round(elapsed, 1), "concurrency": concurrency, "passed": all(checks.values()),
            "checks": checks, "clients": tally.kinds, "normal_ok": tally.normal_ok,
            "normal_failed": tally.normal_failed, "catalog_failures": catalog_failures, "tokens_received": tally.tokens,
            "output_tok_s": round(tally.tokens / elapsed, 1), "usage_mismatches": tally.usage_mismatches[:5],
            "bad_statuses": tally.bad_status, "tasks": {"baseline": baseline_tasks, "end": end_tasks},
            "rss_mib": {"start": rss[0][1], "half": half[0] if half else None, "end": rss[-1][1],
                        "growth_second_half": round(growth, 4)}, "final_metrics": final}


def run(seconds: float, concurrency: int, model_dir: str | None = None, seed: int = 0,
        catalog_first: bool = False) -> dict:
    """Start the server child, soak it, stop it; the result (with `passed` and `exit_status`). catalog_first:
    fire bench.hostile's catalog once before the load (its failures fail the run)."""
    if model_dir is None:
        from rawserve.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    child = Child(model_dir)
    try:
        result = asyncio.run(soak(child, seconds, concurrency, seed, catalog_first))
    finally:
        status = child.stop()
    result["exit_status"] = status
    result["passed"] = result["passed"] and status == 0
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve-child":
        return serve_child(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--model-dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.seconds, args.concurrency, args.model_dir, args.seed)
    result["cpus"] = os.cpu_count()
    print(json.dumps(result), flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
