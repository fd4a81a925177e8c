"""Where a Qwen3.5-0.8B decode step's time goes outside its matmuls (one row, or --rows): the step with every
linear and the LM head answered from a cache of their outputs (what is left is the norms, the mixers' own ops,
attention, the states' updates, the plan), timed whole and split by method.

python -m bench.qwen35_overhead [--context 192] [--rows 1] [--dtype bfloat16] [--threads 1] [--rounds 30]
(--rows 32: a step of 32 decodes, each after --context tokens, in state slots 0..31)
Prints one JSON object: the step's median and min ms over rounds of 10 steps (the model's forward and the
harness's metadata, which stands in for the runner's: bench.host_time times the engine's own), its top-level torch
ops and every dispatched op (nested ones too: a composite such as F.rms_norm is one top-level op and ~23
dispatches, so the top-level count alone misleads), the top-level ops that took most of one profiled step by name
(calls and CPU us, children included; the profiler adds a few us to every dispatch, so a composite's figure is
inflated most: time alternatives without it), and each region's own ms per step (its callees' time taken out; the
wrappers that time them add ~1 us a call, so the regions sum above the step). Each round starts from the same
random states (bench.qwen35_forward's Harness): hundreds of steps on the faked outputs would drift into float32
subnormals. The regions move with the load less than the wall time does; compare trees in alternating runs (one
thread on a shared box: two intra-op threads there make every parallel op wait out a descheduled thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.model_forward import rev
from bench.qwen35_forward import Harness, config_0_8b, random_model
from rawserve.engine.attention import torch_backend
from rawserve.engine.models import qwen35
from rawserve.engine.models.decoder import DecoderModel
from rawserve.engine.models.packed import PackedLinears
from rawserve.process_stats import keep_freed_heap

# region name -> (owner, attribute): a method, or a module function looked up at call time
REGIONS = {
    "norms": (qwen35.Qwen35Layer, "norm"),
    "mlp_block": (qwen35.Qwen35Layer, "mlp_block"),
    "delta_layer": (qwen35.GatedDeltaNetLayer, "decode"),
    "delta_conv": (qwen35, "decode_conv"),
    "delta_l2_norm": (qwen35, "scaled_l2_normalize"),
    "delta_rule": (qwen35, "decode_rule_at"),
    "attention_layer": (qwen35.GatedAttentionLayer, "forward"),
    "write_kv": (torch_backend, "write_kv"),
    "paged_attention": (torch_backend, "paged_attention"),
    "plan_states": (qwen35.Qwen35Model, "plan_states"),
    "model_forward": (qwen35.Qwen35Model, "forward"),
    "faked_linears": (PackedLinears, "linear"),
}


class CachedLinears:
    """Every packed linear answers a copy of the output it gave first for that (layer, weight, rows), and the LM
    head a fixed float32 tensor: the step keeps its shapes and its other ops, without reading the weights."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, str, int], torch.Tensor] = {}
        self.logits: torch.Tensor | None = None
        self.saved = (PackedLinears.linear, DecoderModel.compute_logits)

    def __enter__(self) -> CachedLinears:
        real_linear = PackedLinears.linear

        def linear(layer: PackedLinears, x: torch.Tensor, name: str, bias: torch.Tensor | None = None):
            key = (id(layer), name, x.shape[0])
            if key not in self.outputs:  # the real matmul once, for its shape and a typical scale
                self.outputs[key] = real_linear(layer, x, name, bias)
            return self.outputs[key].clone()

        def compute_logits(model: DecoderModel, hidden: torch.Tensor, out: torch.Tensor | None = None):
            if self.logits is None:
                self.logits = torch.randn(hidden.shape[0], model.cfg.vocab_size)
            return self.logits

        PackedLinears.linear, DecoderModel.compute_logits = linear, compute_logits
        return self

    def __exit__(self, *exc: object) -> None:
        PackedLinears.linear, DecoderModel.compute_logits = self.saved


class Regions:
    """Each region's own time (nested regions' time taken out), summed over the calls while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Regions:
        stack: list[float] = []  # per open region: its nested regions' time so far
        for name, (owner, attr) in REGIONS.items():
            inner = getattr(owner, attr)
            self.saved.append((owner, attr, inner))

            def timed(*args, _inner=inner, _name=name, **kwargs):
                stack.append(0.0)
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    elapsed = time.perf_counter() - start
                    self.seconds[_name] += elapsed - stack.pop()
                    if stack:
                        stack[-1] += elapsed
            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, inner in reversed(self.saved):
            setattr(owner, attr, inner)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=192, help="tokens before the decoded one (1 stream, "
                                                                  "128-token prompt, 64 new: 128-191)")
    parser.add_argument("--rows", type=int, default=1, help="decodes in the step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--top-ops", type=int, default=12, help="top-level ops to list by CPU time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_heap()  # as the engine's runner does on a CPU
    dtype = getattr(torch, args.dtype)
    ctx, rows = args.context, args.rows
    harness = Harness(random_model(config_0_8b(ctx + 4), dtype, 64), ctx + 2, dtype, rows)
    start_states = [tuple(t.clone() for t in layer) for layer in harness.states]  # conv, recurrent, its scale

    def from_start() -> None:
        for layer, start in zip(harness.states, start_states):
            for t, t0 in zip(layer, start):
                t.copy_(t0)

    with CachedLinears():
        for _ in range(3):  # warm-up: the cached outputs, the allocator
            harness.step([7], ctx, rows)
        rounds = []
        for _ in range(args.rounds):
            from_start()
            started = time.perf_counter()
            for _ in range(10):
                harness.step([7], ctx, rows)
            rounds.append((time.perf_counter() - started) / 10)
        from_start()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            harness.step([7], ctx, rows)
        num_steps = 10 * args.rounds
        with Regions() as regions:
            for i in range(num_steps):
                if i % 10 == 0:
                    from_start()
                harness.step([7], ctx, rows)
    events = prof.events()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.cpu_parent is None:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.cpu_time_total
    top_ops = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top_ops]
    print(json.dumps({
        "bench": "qwen35_overhead", "model": "qwen3.5-0.8b-random", "dtype": args.dtype, "rows": rows,
        "context_tokens": ctx, "threads": torch.get_num_threads(), "rev": rev(),
        "step_ms_median": round(statistics.median(rounds) * 1e3, 3), "step_ms_min": round(min(rounds) * 1e3, 3),
        "top_level_ops": sum(1 for e in events if e.cpu_parent is None), "dispatched_ops": len(events),
        "top_ops": [{"op": name, "calls": calls, "cpu_us": round(us, 1)} for name, (calls, us) in top_ops],
        "region_ms": {name: round(s / num_steps * 1e3, 3)
                      for name, s in sorted(regions.seconds.items(), key=lambda kv: -kv[1])},
        "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
