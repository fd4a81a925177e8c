"""The GIL convoy: what a step made of many short torch ops pays while the guided mask helper walks in Python
beside it, in one process.

python -m bench.gil_convoy [--ops 800] [--width 256] [--steps 15] [--switch-intervals 0.005,0.0005,0.00005]
                           [--threads 1] [--device-wait-ms 0]

The step stands in for a GPU box's host side (kernel launches, the sampler's small ops) or a small model's CPU
forward: `--ops` matrix-vector products of `--width`, each of which releases the GIL (`--ops 8 --width 4096`:
a few long ops, a large model's CPU forward). The helper is the real mask work (matcher.GrammarRuntime), walking
cold nested20 variants one after another (compiled before the clock starts), as the guided helper thread does for
new schemas. torch runs
`--threads` threads (1 by default: a core left to the helper, as a GPU box leaves them), so what the step pays
beside the helper is the GIL's hand-overs, not a shared core.

`--device-wait-ms W` splits the step's ops in two halves with W ms of waiting between them, the GIL released (a
GPU step's wait for its forward's results), and adds a third condition: the helper yielding, which starts a mask
only while the step waits (between masks it waits for the step's wait to begin; a mask under way runs on). That
is the choice a helper thread leaves on a GPU box: build whenever, and stretch the step's host code, or build only
in the step's waits, and build less.

One JSON line per switch interval: the step's median ms alone and beside the helper, the helper's own CPU ms
over the steps beside it, and the step's extra ms per helper CPU ms: ~0 where the two overlap as a spare core
allows, 1 where the step paid the helper's work as if it ran in line, more where each op's return waited for
the helper to hand the GIL back (a convoy). With a device wait, the same for the yielding helper beside them.
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
    """A thread walking cold grammars' first passes (each position's mask) until stopped. The grammars are compiled
    before it starts (`rounds`), as the engine's come compiled from the server's workers; past them it compiles more
    itself (`make_round`), which no step's wait bounds."""

    def __init__(self, rounds: list, make_round) -> None:
        self._rounds, self._make_round = rounds, make_round  # (GrammarRuntime, tokens) each
        self._may_build: threading.Event | None = None  # yielding: a mask starts only while it is set
        self._stop = threading.Event()
        self.num_masks = 0
        self.num_compiled = 0  # rounds it had to compile itself
        self._thread = threading.Thread(target=self._run, name="cold-walker", daemon=True)

    def _run(self) -> None:
        from rawserve.engine.guided.matcher import GuidedState

        while not self._stop.is_set():
            if self._rounds:
                runtime, tokens = self._rounds.pop()
            else:
                runtime, tokens = self._make_round()
                self.num_compiled += 1
            state = GuidedState(runtime)
            for token in tokens:
                while self._may_build is not None and not self._may_build.wait(0.05):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                state.mask()
                state.advance(token)
                self.num_masks += 1

    def start(self) -> None:
        self._thread.start()

    def yield_to(self, may_build: threading.Event) -> None:
        """From now on start a mask only while may_build is set (the step waits on its device)."""
        self._may_build = may_build

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
    parser.add_argument("--rounds", type=int, default=12,
                        help="cold nested20 variants compiled before each condition for the helper to walk (~430 "
                             "masks each)")
    parser.add_argument("--device-wait-ms", type=float, default=0.0,
                        help="ms the step waits between its two halves of ops, the GIL released (a GPU step's wait "
                             "for its results); with it, a yielding helper is run too")
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

    waiting = threading.Event()  # set while the step waits on its "device": a yielding helper builds then
    wait_s = args.device_wait_ms / 1e3

    def step_ms() -> float:
        began = time.perf_counter()
        y = x
        for i in range(args.ops):
            if wait_s and i == args.ops // 2:
                waiting.set()
                time.sleep(wait_s)
                waiting.clear()
            y = torch.nn.functional.linear(y, w).tanh_()
        return (time.perf_counter() - began) * 1e3

    def timed_steps() -> list[float]:
        return [step_ms() for _ in range(args.steps)]

    made = [0]

    def make_round() -> tuple:
        """A cold nested20 variant compiled (as the engine gets it) and its output's tokens."""
        made[0] += 1
        variant, variant_instance = bg.cold_round_variant(schema, instance, f"c{made[0]}x{time.monotonic_ns()}")
        tokens = tokenizer.encode(bg.output_text(variant, variant_instance), add_special_tokens=False)
        runtime, _, _ = ours.compile(variant, f"convoy-{made[0]}-{time.monotonic_ns()}")
        return runtime, tokens

    def beside_walker(may_build: threading.Event | None) -> tuple[list[float], float, int]:
        """The steps timed beside a cold walker (yielding to the step's host code when may_build is given) -> (step ms,
        the walker's CPU ms over them, its masks)."""
        walker = ColdWalker([make_round() for _ in range(args.rounds)], make_round)
        walker.start()
        while walker.num_masks < 20:
            time.sleep(0.01)
        if may_build is not None:
            walker.yield_to(may_build)
        cpu_before, masks_before = walker.cpu_s(), walker.num_masks
        beside = timed_steps()
        helper_cpu_ms = (walker.cpu_s() - cpu_before) * 1e3
        masks = walker.num_masks - masks_before
        walker.stop()
        if walker.num_compiled:
            log.warning("the walker compiled %d grammars beside the steps: raise --rounds", walker.num_compiled)
        return beside, helper_cpu_ms, masks

    base = {"rev": rev(), "bench": "gil_convoy", "ops_per_step": args.ops, "width": args.width, "torch_threads": args.threads,
            "cpus": len(os.sched_getaffinity(0)), "helper_schema": "nested20"}
    saved = sys.getswitchinterval()
    try:
        for interval in (float(v) for v in args.switch_intervals.split(",")):
            sys.setswitchinterval(interval)
            alone = timed_steps()
            row = {**base, "switch_interval_s": interval, "device_wait_ms": args.device_wait_ms,
                   "step_ms_alone": round(statistics.median(alone), 2)}
            conditions = [("helper", None)] + ([("yielding_helper", waiting)] if wait_s else [])
            for name, may_build in conditions:
                beside, helper_cpu_ms, masks = beside_walker(may_build)
                row.update({f"step_ms_beside_{name}": round(statistics.median(beside), 2),
                            f"{name}_cpu_ms_per_step": round(helper_cpu_ms / args.steps, 2),
                            f"{name}_masks_per_step": round(masks / args.steps, 1),
                            f"step_extra_ms_per_{name}_cpu_ms": round(
                                (sum(beside) - sum(alone)) / helper_cpu_ms, 2) if helper_cpu_ms > 0 else None})
            print(json.dumps({**row, "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        sys.setswitchinterval(saved)


if __name__ == "__main__":
    main()
