"""A step's working memory on the CPU: the real Sampler's peak over --rows logit rows of a --vocab vocabulary for
each kind of request mix, beside the mix the start-up profile step runs (model_runner.sampler_worst_case).

python -m bench.step_memory [--rows 32] [--vocab 151936]
One JSON line per case: the rise of a fresh process's peak RSS (VmHWM) over its RSS before the step, the float32
logits' own bytes included, on a fresh heap (the profile step, after its forward, reuses some of what that freed).
The profile step's margin sizes the KV pool's cap, so a case well above `profile_model` is a step the cap does not
leave room for.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.checkpoints import rev

MIB = 1 << 20
CASES = {
    "greedy": dict(temperature=0),
    "greedy_logprobs": dict(temperature=0, logprobs=5),
    "top_p_min_p_logprobs": dict(temperature=0.8, top_p=0.9, min_p=0.05, logprobs=5),  # sorts every row
    "penalties_logprobs": dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                               frequency_penalty=0.5, presence_penalty=0.5, logprobs=5),
}


def run_case(case: str, rows: int, vocab: int) -> float:
    """In this process: MiB the step's peak RSS rises by."""
    import torch

    from rawserve.engine import memory
    from rawserve.engine.request import Request
    from rawserve.engine.sampler import Sampler
    from rawserve.engine.model_runner import sampler_worst_case
    from rawserve.engine.types import SamplingParams
    from rawserve.process_stats import release_free_heap

    logits = torch.randn(rows, vocab)
    if case == "profile_model":  # ModelRunner._profile_step's sampler half
        step = sampler_worst_case
    else:
        sampler = Sampler(vocab)
        reqs = [Request(str(i), [1, 2, 3 + i], SamplingParams(**CASES[case])) for i in range(rows)]
        sampler.sample(logits.clone(), reqs, may_overwrite=True)  # once first: the penalty state is grown

        def step(x: torch.Tensor) -> None:
            sampler.sample(x, reqs, may_overwrite=True)
    release_free_heap()
    memory.reset_peak_rss()
    before = memory.rss_bytes()
    step(logits.clone())  # the engine's logits are fresh each step: their bytes count
    return (memory.rss_bytes("VmHWM") - before) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a fresh process
    args = parser.parse_args()
    if args.case:
        print(run_case(args.case, args.rows, args.vocab))
        return
    logits_mib = args.rows * args.vocab * 4 / MIB
    for case in ["profile_model", *CASES]:
        out = subprocess.run([sys.executable, "-m", "bench.step_memory", "--case", case, "--rows", str(args.rows),
                              "--vocab", str(args.vocab)], capture_output=True, text=True, check=True, timeout=600)
        peak = float(out.stdout.split()[-1])
        print(json.dumps({"bench": "step_memory", "case": case, "rows": args.rows, "vocab": args.vocab,
                          "peak_rise_mib": round(peak, 1), "logits_copies": round(peak / logits_mib, 1),
                          "rev": rev()}), flush=True)


if __name__ == "__main__":
    main()
