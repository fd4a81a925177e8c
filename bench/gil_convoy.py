"""The GIL convoy: what a step made of many short torch ops pays while the guided mask helper walks in Python
beside it, in one process.

python -m bench.gil_convoy [--ops 800] [--width 256] [--steps 15] [--switch-intervals 0.005,0.0005,0.00005]
                           [--threads 1]

The step stands in for a GPU box's host side (kernel launches, the sampler's small ops) or a small model's CPU
forward: `--ops` matrix-vector products of `--width`, each of which releases the GIL (`--ops 8 --width 4096`:
a few long ops, a large model's CPU forward). The helper is the real mask work (matcher.GrammarRuntime), walking
cold nested20 variants one after another, as the guided helper thread does for new schemas. torch runs
`--threads` threads (1 by default: a core left to the helper, as a GPU box leaves them), so what the step pays
beside the helper is the GIL's hand-overs, not a shared core.

One JSON line per switch interval: the step's median ms alone and beside the helper, the helper's own CPU ms
over the steps beside it, and the step's extra ms per helper CPU ms: ~0 where the two overlap as a spare core
allows, 1 where the step paid the helper's work as if it ran in line, more where each op's return waited for
the helper to hand the GIL back (a convoy).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time

import torch

from bench.engine import rev

log = logging.getLogger("bench.gil_convoy")


class ColdWalker:
    """A thread walking cold grammars' first passes (compile, then each position's mask) until stopped."""

    def __init__(self, ours, schema: dict, instance: dict, tokenizer) -> None:
        self._ours, self._schema, self._instance, self._tokenizer = ours, schema, instance, tokenizer
        self._stop = threading.Event()
        self.num_masks = 0
        self._thread = threading.Thread(target=self._run, name="cold-walker", daemon=True)

    def _run(self) -> None:
        import bench.guided as bg
        from rawserve.engine.guided.matcher import GuidedState

        round_no = 0
        while not self._stop.is_set():
            round_no += 1
            variant, instance = bg.cold_round_variant(self._schema, self._instance, f"c{round_no}x{time.monotonic_ns()}")
            tokens = self._tokenizer.encode(bg.output_text(variant, instance), add_special_tokens=False)
            runtime, _, _ = self._ours.compile(variant, f"convoy-{round_no}-{time.monotonic_ns()}")
            state = GuidedState(runtime)
            for token in tokens:
                if self._stop.is_set():
                    return
                state.mask()
                state.advance(token)
                self.num_masks += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_s(self) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=800, help="torch ops per step (each releases the GIL)")
    parser.add_argument("--width", type=int, default=256, help="the matrices' side")
    parser.add_argument("--steps", type=int, default=15, help="steps timed per condition (the median is kept)")
    parser.add_argument("--switch-intervals", default="0.005,0.0005,0.00005",
                        help="sys.setswitchinterval values to run beside the helper (0.005 is CPython's default)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads for the step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if not hasattr(time, "pthread_getcpuclockid"):
        sys.exit("bench.gil_convoy needs per-thread CPU clocks (Linux, macOS)")

    import bench.guided as bg
    from bench.checkpoints import ensure_qwen3_06b_shape
    from rawserve.text.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model_dir = str(ensure_qwen3_06b_shape("float32", shape="tiny"))  # its tokenizer: Qwen3's vocabulary
    tokenizer = Tokenizer.from_dir(model_dir)
    ours = bg.Ours(model_dir, tokenizer)
    schema, instance = bg.CASES["nested20"]
    x, w = torch.randn(1, args.width), torch.randn(args.width, args.width)

    def step_ms() -> float:
        began = time.perf_counter()
        y = x
        for _ in range(args.ops):
            y = torch.nn.functional.linear(y, w).tanh_()
        return (time.perf_counter() - began) * 1e3

    def timed_steps() -> list[float]:
        return [step_ms() for _ in range(args.steps)]

    base = {"rev": rev(), "bench": "gil_convoy", "ops_per_step": args.ops, "width": args.width, "torch_threads": args.threads,
            "cpus": len(os.sched_getaffinity(0)), "helper_schema": "nested20"}
    saved = sys.getswitchinterval()
    try:
        for interval in (float(v) for v in args.switch_intervals.split(",")):
            sys.setswitchinterval(interval)
            alone = timed_steps()
            walker = ColdWalker(ours, schema, instance, tokenizer)
            walker.start()
            while walker.num_masks < 20:  # past the first compile: the helper walks masks now
                time.sleep(0.01)
            cpu_before, masks_before = walker.cpu_s(), walker.num_masks
            beside = timed_steps()
            helper_cpu_ms = (walker.cpu_s() - cpu_before) * 1e3
            masks = walker.num_masks - masks_before
            walker.stop()
            alone_ms, beside_ms = statistics.median(alone), statistics.median(beside)
            print(json.dumps({**base, "switch_interval_s": interval, "step_ms_alone": round(alone_ms, 2),
                              "step_ms_beside_helper": round(beside_ms, 2),
                              "helper_cpu_ms_per_step": round(helper_cpu_ms / args.steps, 2),
                              "helper_masks_per_step": round(masks / args.steps, 1),
                              "step_extra_ms_per_helper_cpu_ms": round(
                                  (sum(beside) - sum(alone)) / helper_cpu_ms, 2) if helper_cpu_ms > 0 else None,
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        sys.setswitchinterval(saved)


if __name__ == "__main__":
    main()
