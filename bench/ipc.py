"""Per-step frontend<->core overhead at N concurrent streams, for each transport, side by side.

A fake core (no model) in a spawned child runs the real core loop and emits one RequestOutput per
stream per step. It stamps the step's end (time.monotonic_ns, system-wide on Linux) into the first
output's num_cached_tokens; the frontend measures from that stamp until every output of the step
has been handed to its request state.

  "transport" rows: the pump thread + event-loop hand-off alone (a dict of per-request buffers);
    core_cpu_ms_per_step is the child's CPU per step (core loop, encoding, a Queue's feeder thread).
  "async_llm" rows: the real AsyncLLM in process mode with N concurrent generate() consumers; its
    hand-off also detokenizes and checks stop strings for every output, so it costs more.

Run: python -m bench.ipc [--streams 256] [--steps 300] [--warmup 50] [--step-ms 3]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import logging
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time

import orjson

from rawserve.engine.core_loop import run_core
from rawserve.engine.ipc import TRANSPORTS, make_channel
from rawserve.engine.messages import MsgKind
from rawserve.engine.types import AddRequest, EngineStats, RequestOutput, SamplingParams

log = logging.getLogger("bench.ipc")


class FakeStepCore:
    """EngineCore's interface with no model: every running request gets one token per step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.max_model_len = 1 << 20
        self.num_blocks = 1024
        self.vocab_size = 256
        self.steps = 0
        self.running: dict[str, list[int]] = {}  # rid -> [num_prompt_tokens, max_tokens, num_output_tokens]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def add_request(self, rid, prompt_ids, params, priority=0, *, lora=None, features=None, cache_salt=None):
        self.running[rid] = [len(prompt_ids), params.max_tokens, 0]

    def abort_request(self, rid: str) -> None:
        self.running.pop(rid, None)

    def take_queue_times(self) -> list[tuple[str, float]]:
        return []  # nothing waits: every request runs from its first step

    def step(self) -> list[RequestOutput]:
        if self.step_s:
            time.sleep(self.step_s)  # the model's share of a step; releases the GIL like a GPU wait
        self.steps += 1
        outs = []
        for rid, counts in list(self.running.items()):
            counts[2] += 1
            finished = counts[2] >= counts[1]
            outs.append(RequestOutput(rid, [65 + counts[2] % 26], finished, "length" if finished else None,
                                      num_prompt_tokens=counts[0], num_output_tokens=counts[2]))
            if finished:
                del self.running[rid]
        if outs:
            outs[0].num_cached_tokens = time.monotonic_ns()  # the stamp: step done, send begins
        return outs

    def stats(self) -> EngineStats:
        # process_time: this process's CPU (core loop, pickling, a Queue's feeder thread), for per-step cost
        return EngineStats(num_running=len(self.running), steps=self.steps,
                           extra={"cpu_s": time.process_time()})


def make_fake_core(step_s: float) -> FakeStepCore:
    return FakeStepCore(step_s)


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(latencies_ns: list[int]) -> dict:
    ms = sorted(x / 1e6 for x in latencies_ns)
    return {"step_overhead_ms_p50": round(statistics.median(ms), 4),
            "step_overhead_ms_p99": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
            "step_overhead_ms_mean": round(statistics.fmean(ms), 4)}


async def run_transport(transport: str, args: argparse.Namespace) -> dict:
    """The transport plus the hand-off AsyncLLM does: pump thread -> call_soon_threadsafe -> per-rid state."""
    context = multiprocessing.get_context("spawn")
    in_tx, in_rx = make_channel(transport, context, threaded_sender=True)
    out_tx, out_rx = make_channel(transport, context)
    child = context.Process(target=run_core, args=(functools.partial(make_fake_core, args.step_ms / 1000),
                                                   in_rx, out_tx), daemon=True)
    child.start()
    in_rx.detach()
    out_tx.detach()
    loop = asyncio.get_running_loop()
    states: dict[str, collections.deque] = {}
    latencies: list[int] = []
    steps_seen = 0
    done = loop.create_future()
    ready = loop.create_future()
    cpu = {}

    def handle(msgs: list) -> None:
        nonlocal steps_seen
        for kind, payload in msgs:
            if kind == MsgKind.READY:
                ready.set_result(payload)
            elif kind == MsgKind.OUTPUTS:
                for out in payload:
                    states[out.request_id].append(out)
                steps_seen += 1
                if steps_seen > args.warmup:
                    latencies.append(time.monotonic_ns() - payload[0].num_cached_tokens)
                if payload[0].finished and not done.done():
                    done.set_result(None)
            elif kind == MsgKind.STATS:
                cpu[payload.steps] = payload.extra["cpu_s"]

    def pump() -> None:
        while True:
            try:
                msgs = out_rx.recv(0.1, watch=child.sentinel)
            except EOFError:
                return
            if msgs:
                loop.call_soon_threadsafe(handle, msgs)

    threading.Thread(target=pump, daemon=True).start()
    await ready
    params = SamplingParams(max_tokens=args.steps + args.warmup)
    for i in range(args.streams):
        rid = f"cmpl-{i:032x}-0"
        states[rid] = collections.deque()
        in_tx.send([(MsgKind.ADD, AddRequest(rid, list(range(16)), params))])
    await done
    await asyncio.sleep(0.2)  # the idle stats message carries the child's final CPU time
    in_tx.send([(MsgKind.SHUTDOWN, None)])
    in_tx.close()
    await asyncio.to_thread(child.join, 5)
    assert all(len(q) == args.steps + args.warmup for q in states.values()), "lost outputs"
    total_steps = args.steps + args.warmup
    row = {"bench": "ipc", "level": "transport", "transport": transport, "streams": args.streams,
           "steps": args.steps, "warmup_steps": args.warmup, "step_ms": args.step_ms, **summarize(latencies)}
    if cpu:
        busy_cpu_s = cpu[max(cpu)] - cpu[min(cpu)]
        row["core_cpu_ms_per_step"] = round(busy_cpu_s * 1000 / total_steps, 4)
    return row


async def run_async_llm(transport: str, args: argparse.Namespace) -> dict:
    """The real AsyncLLM: its pump, its hand-off into per-request state, N concurrent consumers."""
    from rawserve.engine.frontend.async_llm import AsyncLLM

    llm = AsyncLLM(functools.partial(make_fake_core, args.step_ms / 1000), _byte_tokenizer(), mode="process",
                   transport=transport, max_pending=args.streams)
    latencies: list[int] = []
    steps_seen = 0
    handle = llm._handle_messages  # timed from outside: the hand-off is the thing measured

    def timed(msgs: list) -> None:
        nonlocal steps_seen
        handle(msgs)
        now = time.monotonic_ns()
        for kind, payload in msgs:
            if kind == MsgKind.OUTPUTS:
                steps_seen += 1
                if steps_seen > args.warmup:
                    latencies.append(now - payload[0].num_cached_tokens)

    llm._handle_messages = timed
    await llm.start()
    params = SamplingParams(max_tokens=args.steps + args.warmup)

    async def consume(i: int) -> int:
        n = 0
        async for out in llm.generate(list(range(16)), params, request_id=f"cmpl-{i:032x}-0"):
            n += len(out.new_token_ids)
        return n

    started = time.perf_counter()
    counts = await asyncio.gather(*(consume(i) for i in range(args.streams)))
    elapsed = time.perf_counter() - started
    await llm.stop(5)
    assert all(c == args.steps + args.warmup for c in counts), "lost tokens"
    return {"bench": "ipc", "level": "async_llm", "transport": transport, "streams": args.streams,
            "steps": args.steps, "warmup_steps": args.warmup, "step_ms": args.step_ms, **summarize(latencies),
            "wall_ms_per_step_incl_warmup": round(elapsed * 1000 / (args.steps + args.warmup), 4)}


def _byte_tokenizer():
    """A 256-id byte-level tokenizer: the fake core's ids decode to letters, as a real model's would."""
    import tokenizers

    from rawserve.text.tokenizer import CHAR_TO_BYTE, Tokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=dict(CHAR_TO_BYTE), merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(tok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=50, help="steps excluded from the figures")
    parser.add_argument("--step-ms", type=float, default=3.0, help="simulated model time per step")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--levels", default="transport,async_llm")
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    rev = git_rev()
    transports = args.transports.split(",")
    for level in args.levels.split(","):
        rows = {}
        for transport in transports:
            runner = run_transport if level == "transport" else run_async_llm
            rows[transport] = {**asyncio.run(runner(transport, args)), "rev": rev}
            print(orjson.dumps(rows[transport]).decode(), flush=True)
        if "pipe" in rows and "queue" in rows:
            print(orjson.dumps({
                "bench": "ipc", "level": level, "ratio": "queue_over_pipe", "streams": args.streams,
                "step_overhead_p50_ratio": round(rows["queue"]["step_overhead_ms_p50"]
                                                 / rows["pipe"]["step_overhead_ms_p50"], 3),
                "step_overhead_mean_ratio": round(rows["queue"]["step_overhead_ms_mean"]
                                                  / rows["pipe"]["step_overhead_ms_mean"], 3),
                "rev": rev}).decode(), flush=True)


if __name__ == "__main__":
    main()
