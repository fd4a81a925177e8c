"""Speculative decoding's speed against its acceptance: decode ITL and output tok/s through EngineCore with the
synthetic method at mean acceptance lengths L and draft lengths k, beside plain decoding, at 1 / 8 / 32 streams.

python -m bench.spec [--model-dir DIR | --shape 0.6b|tiny] [--dtype bfloat16] [--streams 1,8,32] [--k 4]
                     [--lengths 1,2,3,4] [--input-len 64] [--output-len 48] [--disable-by-batch-size 8]
                     [--num-threads 1] [--rounds 3] [--ngram] [--mtp]
One JSON line per scenario on stdout, then one with the issue's targets (L = 3 at one stream >= 2.0x plain; at 32
streams never below 0.95x); logs on stderr. One model load: each scenario swaps the core's SpecDecoder. The
synthetic method forces its drafts accepted at mean L (tokens per verified step, the target's own included), so
random weights measure what a proposer of that quality would buy; decode time only (after every first token).
--mtp (a Qwen3.5 --model-dir with mtp.* tensors, e.g. the peers' qwen35-0.8b-random): also the MTP layer drafting
k, never paused; on random weights its drafts are rarely accepted, so that row is MTP's cost at its measured L.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

import torch

from rawserve.config import EngineConfig, SpeculativeConfig
from rawserve.engine.core import EngineCore, make_engine_core
from rawserve.engine.spec.verify import SpecDecoder
from rawserve.engine.types import SamplingParams

log = logging.getLogger("bench.spec")

TARGET_L3_BATCH1 = 2.0
TARGET_32_FLOOR = 0.95


def decode_run(core: EngineCore, streams: int, input_len: int, output_len: int, seed: int,
               repeat: bool = False) -> dict:
    """`streams` requests at once; returns decode tok/s (after every request has its first token) and the
    per-request ITL (decode time / tokens after the first). `repeat`: each prompt repeats an 8-token phrase."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(streams):
        ids = torch.randint(1000, 100000, (8 if repeat else input_len,), generator=g).tolist()
        core.add_request(f"s{seed}-{i}", (ids * input_len)[:input_len], params)
    counts: dict[str, int] = {}
    while len(counts) < streams:  # prefill: every request to its first token
        for out in core.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    began = time.perf_counter()
    steps0 = core.steps
    step_s = []
    while core.has_unfinished:
        t = time.perf_counter()
        for out in core.step():
            counts[out.request_id] += len(out.new_token_ids)
        step_s.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - began
    decoded = sum(counts.values()) - streams
    return {"tok_s": decoded / elapsed, "itl_ms": 1000 * elapsed * streams / decoded,
            "steps": core.steps - steps0, "median_step_ms": 1000 * statistics.median(step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir")
    parser.add_argument("--shape", default="0.6b", choices=("0.6b", "tiny"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--k", default="4", help="draft lengths, a comma list")
    parser.add_argument("--lengths", default="1,2,3,4", help="mean acceptance lengths L, a comma list")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    parser.add_argument("--disable-by-batch-size", type=int, default=defaults["disable_by_batch_size"],
                        help="a fixed batch size with no drafts; default: measured at run time (BatchPolicy)")
    parser.add_argument("--num-threads", default="auto")
    parser.add_argument("--ngram", action="store_true", help="also n-gram (its defaults) on prompts repeating a "
                        "phrase; every scenario then gets those prompts")
    parser.add_argument("--mtp", action="store_true", help="also Qwen3.5's MTP layer (needs its mtp.* tensors)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every scenario, interleaved; medians compared")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    model_dir = args.model_dir
    if model_dir is None:
        from bench.checkpoints import ensure_qwen3_06b_shape

        model_dir = str(ensure_qwen3_06b_shape(args.dtype, shape=args.shape))
    streams_list = [int(s) for s in args.streams.split(",")]
    # Twice the streams: a hybrid (Qwen3.5) drafts only where a spare state slot holds its rollback snapshot
    config = EngineConfig(model_dir=model_dir, dtype=args.dtype, max_num_seqs=2 * max(streams_list),
                          max_model_len=args.input_len + args.output_len + 32, num_threads=args.num_threads,
                          enable_prefix_caching=False)
    core = make_engine_core(config)
    mtp = None
    if args.mtp:
        from rawserve.engine.spec.mtp import MTPProposer

        mtp = MTPProposer(core.runner, core.blocks)
    load0 = os.getloadavg()[0]
    results = {}
    seed = 0
    for streams in streams_list:
        scenarios = [(None, None)] + [(k, length) for k in (int(x) for x in args.k.split(","))
                                      for length in (float(x) for x in args.lengths.split(",")) if length <= k + 1]
        if args.ngram:  # n-gram with its defaults (pauses included) on prompts that repeat a phrase
            scenarios += [(int(args.k.split(",")[0]), "ngram")]
        if mtp is not None:
            scenarios += [(int(k), "mtp") for k in args.k.split(",")]
        runs: dict[tuple, list[dict]] = {}
        for round_index in range(args.rounds):  # scenarios interleaved round by round: the box's load drifts
            for k, length in scenarios:
                seed += 1
                if length == "ngram":
                    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
                elif length == "mtp":
                    spec = {"method": "mtp", "num_speculative_tokens": k, "min_acceptance": 0}
                else:
                    spec = {"method": "synthetic", "num_speculative_tokens": k, "acceptance_length": length,
                            "min_acceptance": 0, "seed": seed}
                if args.disable_by_batch_size is not None:
                    spec["disable_by_batch_size"] = args.disable_by_batch_size
                core.spec = None if k is None else SpecDecoder(SpeculativeConfig.from_dict(spec), core.blocks,
                                                               core.max_model_len, core.states,
                                                               mtp if length == "mtp" else None)
                run = decode_run(core, streams, args.input_len, args.output_len, seed, repeat=args.ngram)
                method = "plain" if k is None else length if length in ("ngram", "mtp") else "synthetic"
                line = {"streams": streams, "method": method, "k": k, "L": None if method != "synthetic" else length,
                        "round": round_index, **{key: round(value, 2) for key, value in run.items()},
                        "load_avg_1m": os.getloadavg()[0]}
                if core.spec is not None:
                    c = core.spec.counters
                    line["measured_L"] = round(1 + c.num_accepted_tokens / c.num_drafts, 2) if c.num_drafts else None
                    line["steps_off_by_batch"] = c.num_steps_off_by_batch
                    if core.spec.policy is not None:
                        line["policy"] = core.spec.policy.stats()
                runs.setdefault((streams, k, length), []).append(run)
                print(json.dumps(line), flush=True)
        for key, group in runs.items():
            results[key] = {"tok_s": statistics.median(r["tok_s"] for r in group)}
    summary = {"metric": "targets", "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0]}
    k0 = int(args.k.split(",")[0])
    if (1, None, None) in results and (1, k0, 3.0) in results:
        ratio = results[(1, k0, 3.0)]["tok_s"] / results[(1, None, None)]["tok_s"]
        summary.update(l3_batch1_ratio=round(ratio, 2), l3_batch1_target=TARGET_L3_BATCH1,
                       l3_batch1_ok=ratio >= TARGET_L3_BATCH1)
    if (1, None, None) in results and (1, k0, "ngram") in results:
        summary["ngram_batch1_ratio"] = round(results[(1, k0, "ngram")]["tok_s"] / results[(1, None, None)]["tok_s"], 2)
    if (1, None, None) in results and (1, k0, "mtp") in results:
        summary["mtp_batch1_ratio"] = round(results[(1, k0, "mtp")]["tok_s"] / results[(1, None, None)]["tok_s"], 2)
    if (32, None, None) in results:
        worst = min(run["tok_s"] for (s, k, _), run in results.items() if s == 32 and k is not None) \
            / results[(32, None, None)]["tok_s"]
        summary.update(streams32_worst_ratio=round(worst, 2), streams32_floor=TARGET_32_FLOOR,
                       streams32_ok=worst >= TARGET_32_FLOOR)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
