"""Host time around the model: the sampler at a real vocabulary, and one batch-1 decode step by phase.

python -m bench.host_time [--part sampler,step] [--rows 256] [--vocab 151936] [--baseline REV] [--reps 7]
                          [--model tiny | --model-dir DIR] [--steps 100] [--threads N]
sampler: Sampler.sample on [rows, vocab] float32 logits per sampling mode, this tree's sampler against the one
at git revision --baseline (default: main) when given, the two interleaved call by call; wall and process CPU
(all threads) per call, medians. step: a batch-1 decode on --model (tiny: 2 layers, Qwen3's 152k vocabulary),
each phase of EngineCore.step timed (schedule, plan, runner metadata, model, LM head, sampler, update).
One JSON line per row; every line carries the 1-minute load average: on a shared box compare CPU times.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch

from bench.engine import resolve_model_dir, rev
from rawserve.engine.request import Request
from rawserve.engine.types import SamplingParams

# Sampling modes: (SamplingParams fields, what it stands for)
MODES = {
    "greedy": dict(temperature=0),
    "sampled": dict(temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's published defaults
    "top_p": dict(temperature=1.0, top_p=0.9),
    "temperature": dict(temperature=1.0),  # OpenAI's defaults: the whole vocabulary
    "min_p": dict(temperature=0.8, min_p=0.05),
    "penalties": dict(temperature=0, repetition_penalty=1.1, presence_penalty=0.5),
    "logprobs": dict(temperature=0, logprobs=5),
}


def baseline_sampler(revision: str) -> type:
    """The Sampler class as it was at `revision` (its module's source from git, run as a module)."""
    source = subprocess.run(["git", "show", f"{revision}:rawserve/engine/sampler.py"], capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType(f"sampler_at_{revision}")
    module.__file__ = f"<git {revision}>"
    sys.modules[module.__name__] = module  # dataclasses look the module up by name
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own file at a revision
    return module.Sampler


def peaked_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """A language model's shape of row: a few likely tokens above a long flat tail (top_p 0.9 within ~100)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    head = torch.randint(0, vocab, (rows, 32), generator=g)
    logits.scatter_(1, head, 9.0 + 3 * torch.rand(rows, 32, generator=g))
    return logits


def time_call(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def sampler_part(args, base: dict) -> None:
    from rawserve.engine.sampler import Sampler

    samplers = {"new": Sampler}
    if args.baseline:
        samplers["baseline"] = baseline_sampler(args.baseline)
    logits = peaked_logits(args.rows, args.vocab)
    for mode in args.modes.split(","):
        prompt = list(range(64))
        made = {name: (cls(args.vocab, seed=0), [Request(f"{name}{i}", prompt, SamplingParams(max_tokens=64,
                                                         seed=i if i % 2 else None, **MODES[mode]))
                                                 for i in range(args.rows)])
                for name, cls in samplers.items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in made}
        for rep in range(args.reps + 1):
            for name, (sampler, reqs) in made.items():  # interleaved: a burst of load hits both alike
                work = logits.clone()  # the engine hands over fresh logits it may overwrite
                wall_cpu = time_call(lambda: sampler.sample(work, reqs, may_overwrite=True))
                if rep:  # the first call builds penalty state and warms the allocator
                    times[name].append(wall_cpu)
        row = {**base, "part": "sampler", "mode": mode, "rows": args.rows, "vocab": args.vocab}
        for name, pairs in times.items():
            row[f"{name}_wall_ms_p50"] = round(statistics.median(w for w, _ in pairs), 2)
            row[f"{name}_cpu_ms_p50"] = round(statistics.median(c for _, c in pairs), 2)
        if "baseline" in times:
            row["cpu_speedup"] = round(row["baseline_cpu_ms_p50"] / max(row["new_cpu_ms_p50"], 1e-3), 1)
        row["load_avg_1m"] = round(os.getloadavg()[0], 2)
        print(json.dumps(row), flush=True)


class Phases:
    """Wall time per named phase of one step, by wrapping the bound methods that make it up."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def wrap(self, owner: object, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.ms.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        setattr(owner, attr, timed)


def step_part(args, base: dict) -> None:
    from rawserve.config import EngineConfig
    from rawserve.engine import core as core_module
    from rawserve.engine.core import EngineCore

    model_dir = resolve_model_dir(args.model, args.model_dir)
    core = EngineCore(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64, max_num_seqs=4,
                                   max_model_len=args.steps + 64))
    phases = Phases()
    phases.wrap(core.scheduler, "schedule", "schedule")
    phases.wrap(core.runner, "_metadata", "runner_metadata")
    phases.wrap(core.runner.model, "forward", "model_layers")
    phases.wrap(core.runner.model, "compute_logits", "lm_head")
    phases.wrap(core.runner, "execute", "execute")
    phases.wrap(core.sampler, "sample", "sampler")
    phases.wrap(core, "_update", "update")
    original_plan = core_module.StepPlan

    def plan(scheduled):
        start = time.perf_counter()
        made = original_plan(scheduled)
        phases.ms.setdefault("plan", []).append((time.perf_counter() - start) * 1e3)
        return made
    core_module.StepPlan = plan
    try:
        for mode in args.modes.split(","):
            if mode not in ("greedy", "sampled"):
                continue
            params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, **MODES[mode])
            core.add_request(f"warm-{mode}", list(range(1, 33)), params)
            core.step()  # the prefill, kept out of the figures
            phases.ms.clear()
            steps, cpu = [], []
            while core.has_unfinished:
                wall_cpu = time_call(core.step)
                steps.append(wall_cpu[0])
                cpu.append(wall_cpu[1])
            row = {**base, "part": "step", "mode": mode, "model_dir": model_dir, "batch": 1, "steps": len(steps),
                   "step_ms_p50": round(statistics.median(steps), 3),
                   "step_cpu_ms_p50": round(statistics.median(cpu), 3)}
            for name, values in phases.ms.items():
                row[f"{name}_ms_p50"] = round(statistics.median(values), 3)
            row["host_ms_p50"] = round(row["step_ms_p50"] - row["execute_ms_p50"], 3)
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            print(json.dumps(row), flush=True)
    finally:
        core_module.StepPlan = original_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="sampler,step")
    parser.add_argument("--modes", default="greedy,sampled,top_p,temperature,min_p,penalties,logprobs")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--baseline", default=None, help="A git revision whose sampler to time beside this one.")
    parser.add_argument("--model", default="tiny", choices=["demo", "qwen3-0.6b", "tiny"])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default).")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        parser.error(f"--modes: unknown {bad}; known: {sorted(MODES)}")
    base = {"bench": "host_time", "rev": rev(), "threads": torch.get_num_threads()}
    parts = args.part.split(",")
    if "sampler" in parts:
        sampler_part(args, base)
    if "step" in parts:
        step_part(args, base)


if __name__ == "__main__":
    main()
