"""Replicas behind a real router, on loopback: N rawserve replicas (demo model) with smg in front.

    python -m bench.replicas [--replicas 4] [--users 16] [--turns 4] [--concurrency 8] [--quick]

A shared-prefix chat workload (each user a long system prompt of its own and several turns, every turn resending
the whole conversation) runs three ways: on one replica alone, through `smg --policy random`, and through
`smg --policy cache_aware`. Each prints a JSON line: the aggregate prefix-cache hit rate (from the replicas'
/metrics), TTFT p50/p99 and output tok/s. Then a failover run through cache_aware: one replica is SIGKILLed
mid-run (how many requests failed, and how long after the kill the last one did), later another is SIGTERMed
(its in-flight requests at the signal, how many requests failed while it drained: the target is 0).
Each phase uses system prompts of its own, so no phase finds another's blocks in the cache.
"""
from __future__ import annotations

import argparse
import http.client
import itertools
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.http import free_port, git_rev
from bench.spawn import Replica, wait_until

WORDS = ("river stone lantern harbor meadow copper violet engine garden signal ember canyon orbit velvet marble "
         "falcon prairie glacier thunder willow beacon saffron compass timber quartz nebula cedar ripple summit "
         "anchor").split()


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def system_prompt(phase: str, user: int, words: int) -> str:
    rng = random.Random(f"{phase}/{user}")
    return f"You are assistant {phase}-{user}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(port: int, messages: list[dict], max_tokens: int, timeout: float = 120.0) -> dict:
    """One streamed chat completion: {ok, status, ttft, tokens, prompt_tokens, cached_tokens, text, start, end}."""
    started = time.monotonic()
    result = {"ok": False, "status": None, "ttft": None, "tokens": 0, "prompt_tokens": 0, "cached_tokens": 0,
              "text": "", "start": started, "end": None}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": "demo", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}), {"content-type": "application/json"})
        response = conn.getresponse()
        result["status"] = response.status
        if response.status != 200:
            response.read()
            return result
        parts = []
        for line in response:
            if line.startswith(b"data: [DONE]"):
                result["ok"] = True
                break
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage")
            if usage:
                result["tokens"], result["prompt_tokens"] = usage["completion_tokens"], usage["prompt_tokens"]
                result["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in event.get("choices") or ():
                if choice["delta"].get("content"):
                    if result["ttft"] is None:
                        result["ttft"] = time.monotonic() - started
                    parts.append(choice["delta"]["content"])
        result["text"] = "".join(parts)
        result["ok"] = result["ok"] and result["tokens"] == max_tokens
    except (OSError, http.client.HTTPException, ValueError) as error:
        result["error"] = repr(error)
    finally:
        result["end"] = time.monotonic()
        conn.close()
    return result


def conversation(port: int, phase: str, user: int, args: argparse.Namespace, results: list[dict],
                              ) -> None:
    messages = [{"role": "system", "content": system_prompt(phase, user, args.system_words)}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Question {turn}: what does the {WORDS[turn]} mean?"})
        out = chat(port, messages, args.max_tokens)
        out["user"], out["turn"] = user, turn
        results.append(out)
        # a failed turn keeps the conversation going with a stand-in answer, as a retrying client would
        messages.append({"role": "assistant", "content": out["text"] or "..."})


def cache_counters(replicas: list[Replica]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the live replicas, once each is idle (its counters current)."""
    hits = queries = 0.0
    for replica in replicas:
        if replica.proc.poll() is not None:
            continue
        wait_until(lambda: _gauge(replica.metrics(), "rawserve:requests_in_flight") == 0, 30)
        time.sleep(0.3)  # the core's STATS when it went idle
        page = replica.metrics()
        hits += _gauge(page, "rawserve:prefix_cache_hits_total")
        queries += _gauge(page, "rawserve:prefix_cache_queries_total")
    return hits, queries


def _gauge(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(results: list[dict], wall_s: float) -> dict:
    ttfts = [r["ttft"] for r in results if r["ok"] and r["ttft"] is not None]
    return {"requests": len(results), "failed": sum(not r["ok"] for r in results),
            "ttft_p50_ms": _ms(percentile(ttfts, 0.5)), "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
            "tok_per_s": round(sum(r["tokens"] for r in results if r["ok"]) / wall_s, 1), "wall_s": round(wall_s, 2)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run_workload(port: int, phase: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    results: list[dict] = []
    began = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for future in [pool.submit(conversation, port, phase, u, args, results) for u in range(args.users)]:
            future.result()
    return results, time.monotonic() - began


class Router:
    """`smg launch` in front of the replicas' URLs, with one routing policy."""

    def __init__(self, replicas: list[Replica], policy: str, extra: list[str] = ()) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["smg", "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn",
             "--worker-urls", *(r.url for r in replicas), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = [{"role": "user", "content": "ping"}]
        if not wait_until(lambda: self.proc.poll() is not None or chat(self.port, probe, 1, 10)["ok"], 60, 0.5) \
                or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"smg ({policy}) did not start routing")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # the router is not under test; its own graceful exit takes 5 s
        self.proc.wait()


def replica_args(args: argparse.Namespace) -> list[str]:
    return ["--served-model-name", "demo", "--max-model-len", "4096", "--num-kv-blocks", str(args.kv_blocks),
            "--shutdown-timeout", "30", "--metrics-compat", "vllm", "--no-log-requests",
            "--engine-mode", args.engine_mode]


def start_replicas(count: int, args: argparse.Namespace) -> list[Replica]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: Replica(replica_args(args), name=f"replica-{i}"), range(count)))


def measure(name: str, port: int, replicas: list[Replica], args: argparse.Namespace) -> dict:
    hits0, queries0 = cache_counters(replicas)
    results, wall_s = run_workload(port, name, args)
    hits1, queries1 = cache_counters(replicas)
    line = {"bench": "replicas", "routing": name, "replicas": len(replicas),
            "hit_rate": round((hits1 - hits0) / max(1.0, queries1 - queries0), 4), **summarize(results, wall_s)}
    print(json.dumps(line), flush=True)
    return line


def failover(replicas: list[Replica], args: argparse.Namespace) -> dict:
    """cache_aware routing under steady traffic (new users keep arriving) while one replica is SIGKILLed and,
    once the router routes around it, another is SIGTERMed with requests in flight."""
    router = Router(replicas, "cache_aware")
    results: list[dict] = []
    stop = threading.Event()
    users = itertools.count()

    def client() -> None:
        while not stop.is_set():
            conversation(router.port, "failover", next(users), args, results)

    pool = ThreadPoolExecutor(args.concurrency)
    futures = [pool.submit(client) for _ in range(args.concurrency)]
    try:
        wait_until(lambda: len(results) >= args.concurrency, 300)
        victim, drained = replicas[0], replicas[1]
        killed_at = time.monotonic()
        victim.kill()
        # routed around once requests sent a second after the kill succeed
        wait_until(lambda: sum(r["ok"] for r in results if r["start"] > killed_at + 1) >= args.concurrency, 300)
        readings = [0.0]  # the reading that saw requests in flight (a second read may come after they finish)
        wait_until(lambda: readings.append(_gauge(drained.metrics(), "rawserve:requests_in_flight")) or readings[-1] > 0,
                   60, 0.01)
        in_flight = readings[-1]
        signalled_at = time.monotonic()
        drained.terminate()
        exit_status = drained.wait(60)
        exited_at = time.monotonic()
        done = len(results)
        wait_until(lambda: len(results) >= done + args.concurrency, 300)  # and the rest carry on
    finally:
        stop.set()
        for future in futures:
            future.result()
        pool.shutdown()
        router.stop()
    after_kill = [r for r in results if r["end"] > killed_at and r["start"] < signalled_at]
    failed_kill = [r for r in after_kill if not r["ok"]]
    failed_later = [r for r in failed_kill if r["start"] > killed_at]  # sent after the kill, not caught in it
    during_drain = [r for r in results if r["end"] > signalled_at and r["start"] < exited_at]
    line = {"bench": "replicas", "routing": "cache_aware", "phase": "failover", "replicas": len(replicas),
            "killed": {"failed": len(failed_kill), "failed_sent_after_kill": len(failed_later),
                       "requests": len(after_kill),
                       "last_failure_after_s": round(max((r["end"] for r in failed_kill), default=killed_at)
                                                     - killed_at, 2)},
            "sigterm": {"in_flight_at_signal": int(in_flight), "exit_status": exit_status,
                        "drain_s": round(exited_at - signalled_at, 2), "requests_during_drain": len(during_drain),
                        "lost": sum(not r["ok"] for r in during_drain)},
            **summarize(results, max(r["end"] for r in results) - min(r["start"] for r in results))}
    print(json.dumps(line), flush=True)
    return line


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--engine-mode", default="process", choices=("process", "thread"))
    parser.add_argument("--no-failover", action="store_true", help="skip the kill/SIGTERM run")
    parser.add_argument("--quick", action="store_true", help="CI size: 3 replicas, 6 users, 3 turns")
    args = parser.parse_args(argv)
    if args.quick:
        args.replicas, args.users, args.turns, args.system_words, args.concurrency = 3, 6, 3, 120, 6
    if args.replicas < 3 and not args.no_failover:
        parser.error("--replicas: the failover run needs at least 3 (one killed, one SIGTERMed, one left)")
    print(json.dumps({"bench": "replicas", "rev": git_rev(), "config": vars(args)}), flush=True)
    lines = []
    single = start_replicas(1, args)
    try:
        lines.append(measure("single", single[0].port, single, args))
    finally:
        single[0].stop()
    replicas = start_replicas(args.replicas, args)
    try:
        for policy in ("random", "cache_aware"):
            router = Router(replicas, policy)
            try:
                lines.append(measure(policy, router.port, replicas, args))
            finally:
                router.stop()
        single_rate, random_rate, aware_rate = (line["hit_rate"] for line in lines)
        summary = {"bench": "replicas", "cache_aware_vs_single": round(aware_rate / max(single_rate, 1e-9), 3),
                   "cache_aware_vs_random": round(aware_rate / max(random_rate, 1e-9), 3),
                   "targets": {"cache_aware_vs_single": ">= 0.8", "cache_aware_vs_random": ">= 2.0"}}
        print(json.dumps(summary), flush=True)
        lines.append(summary)
        if not args.no_failover:
            lines.append(failover(replicas, args))
    finally:
        for replica in replicas:
            replica.stop()
    return lines


if __name__ == "__main__":
    main()
