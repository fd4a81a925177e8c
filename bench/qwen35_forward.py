"""Qwen3.5 (hybrid) forward speed on a random Qwen3.5-0.8B-shaped model built in memory: prefill tok/s per prompt
length and delta-rule chunk size, and a decode step's ms after a given context.

python -m bench.qwen35_forward [--prefill 512,4096] [--context 1024,8192,32768] [--rows 1,32] [--chunks 32,64,128]
    [--dtype bfloat16] [--decode-attention auto,sdpa] [--prefill-chunk 2048,0] [--threads 1] [--wave 32x128,32x16@112]
OpenMP waits as a spawned engine core's do (cpu_budget.wait_environment, unless the environment sets its own:
`omp_waits` in each row). Prints one JSON object per line (the 1-minute load average beside each figure: the box
is shared; decode rows
also give the process CPU time per step and the step's top-level torch op count, which the load does not move). A
decode's cost does not depend on the values in its context, so the decode rows fill the KV cache and the states
with random values rather than prefilling them (32k prefill on a 2-core CPU takes minutes: pass it to --prefill
explicitly when wanted). Not zeros: from zero states this random model's decode steps run into float32 subnormals
(a 1-row step took 300-1,000 ms against 60, every op slowed, the linears too), which a prompt's states do not.
Memory per sequence (states + KV) is computed from the shapes. --decode-attention auto,sdpa times each decode row
both ways, alternating (auto: the engine's pick, long_decode.takes_long_path: the long-context
path from long_decode.LONG_DECODE_TOKENS on, or for a large enough batch; sdpa: the batched SDPA at every length;
long: the long-context path at every length).
--wave times steps of many prompts at once, as a wave of new requests reaches the engine: NxL is N fresh prompts
of L tokens in one step, NxL@S their L tokens after S already computed (carried states: the 16-token tails the
prefix cache's save edge leaves a 128-token prompt, 32x16@112); each row gives the step's ms and the delta rule's
ms and share of it (the layers' gated_delta_rule calls, timed in place), the waves in interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from rawserve.engine.cpu_budget import wait_environment

# OpenMP's waits as a spawned engine core has them (GOMP_SPINCOUNT=30000), set before torch loads OpenMP: libgomp's
# default 300,000 turns keep a finished region's teammate spinning on the CPU long_decode's helper thread needs
# (the 32k decode step at two threads: 152 against 115 ms, load 1.4-1.9).
os.environ.update(wait_environment(os.environ))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile

from bench.model_forward import rev
from rawserve.engine.attention import long_decode
from rawserve.engine.loader import HybridConfig, ModelConfig
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.models.gated_delta import StateBatch
from rawserve.engine.models import qwen35
from rawserve.engine.models.qwen35 import Qwen35Model
from rawserve.engine.step_plan import StepInput
from rawserve.process_stats import keep_freed_heap
from tests.engine.test_qwen35_model import attention_metadata  # the runner's torch-backend metadata, no runner

BLOCK = 16


def config_0_8b(max_positions: int) -> ModelConfig:
    """Qwen3.5-0.8B's text stack as published (../shared/notes/qwen35.md)."""
    hybrid = HybridConfig(layer_types=("linear_attention",) * 3 + ("full_attention",), linear_num_key_heads=16,
                          linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4, partial_rotary_factor=0.25, mrope_section=(11, 11, 10),
                          tensor_prefix="model.", set_aside_prefixes=())
    hybrid.layer_types = hybrid.layer_types * 6
    return ModelConfig(family="qwen3_5", architecture="Qwen3_5ForConditionalGeneration", vocab_size=248320,
                       hidden_size=1024, intermediate_size=3584, num_layers=24, num_heads=8, num_kv_heads=2,
                       head_dim=256, rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, hybrid=hybrid)


def random_model(cfg: ModelConfig, dtype: torch.dtype, chunk_size: int) -> Qwen35Model:
    with torch.device("meta"):
        model = Qwen35Model(cfg, dtype, "torch", chunk_size)
    model.materialize(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 16, generator=gen).log())
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.finish_load()
    if cpu_prepack_supported(dtype):
        model.prepack()
    return model.eval()


class Harness:
    """The model, a KV pool of random values, `rows` state slots, and the runner's CPU setup: freed heap kept
    (process_stats.keep_freed_heap), one reused gather buffer pair, a lone decode's consecutive blocks read in
    place (metadata.decode_block_run)."""

    def __init__(self, model: Qwen35Model, max_tokens: int, dtype: torch.dtype, rows: int = 1) -> None:
        cfg = model.cfg
        self.model = model
        self.blocks_per_row = -(-max_tokens // BLOCK) + 1
        self.num_blocks = rows * self.blocks_per_row + 1
        shape = (self.num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(model.num_kv_layers)]
        self.gather_out = None
        self.states = model.allocate_states(rows, torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for conv, recurrent, _ in self.states:  # as a prompt leaves them (module docstring: not zeros)
            conv.copy_(torch.randn(conv.shape, generator=gen))
            recurrent.copy_(0.01 * torch.randn(recurrent.shape, generator=gen))
        model.init_rope(max_tokens + 1, torch.device("cpu"))

    def table(self, row: int, tokens: int) -> list[int]:
        first = 1 + row * self.blocks_per_row
        return list(range(first, first + -(-tokens // BLOCK)))

    @torch.inference_mode()
    def step(self, ids: list[int], start: int, rows: int = 1) -> None:
        """`rows` sequences, each with `ids` after `start` tokens of context, in state slots 0..rows - 1."""
        seqs = [StepInput(ids, start, self.table(r, start + len(ids)), state_slot=r) for r in range(rows)]
        meta, positions = attention_metadata(seqs, BLOCK)
        if rows == 1 and len(ids) == 1:
            meta.decode_block_run = seqs[0].block_table[0]
        most = meta.decode_blocks.numel() if meta.decode_block_run is None else 0
        most = max([most] + [len(seqs[i].block_table) for i in meta.prefill_seq_ids])
        row_elems = BLOCK * self.model.cfg.num_kv_heads * self.model.cfg.head_dim
        if most and (self.gather_out is None or self.gather_out[0].numel() < most * row_elems):
            self.gather_out = None
            self.gather_out = tuple(torch.empty(most * row_elems, dtype=self.kv[0][0].dtype) for _ in range(2))
        meta.gather_out = self.gather_out if most else None
        hidden = self.model(torch.tensor(ids * rows), positions, self.kv, meta, states=self.states,
                            state_batch=StateBatch.from_inputs(seqs))
        ends = torch.arange(len(ids) - 1, len(ids) * rows, len(ids))
        self.model.compute_logits(hidden[ends])


def step_cost(step, reps: int, warmup: int = 2) -> dict:
    """A step's wall ms (median, min), process CPU ms (median: what the load moves least) and top-level torch ops
    (one profiled step: deterministic)."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(reps):
        cpu_start, started = time.process_time(), time.perf_counter()
        step()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {"decode_ms_median": round(statistics.median(wall) * 1e3, 2), "decode_ms_min": round(min(wall) * 1e3, 2),
            "cpu_ms_median": round(statistics.median(cpu) * 1e3, 2),
            "top_level_ops": sum(1 for e in prof.events() if e.cpu_parent is None)}


class RuleClock:
    """Wall seconds spent in the Gated DeltaNet layers' gated_delta_rule calls while entered (qwen35's name for
    it wrapped, restored on exit)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.real = qwen35.gated_delta_rule

    def __enter__(self) -> RuleClock:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return self.real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        qwen35.gated_delta_rule = timed
        return self

    def __exit__(self, *exc) -> None:
        qwen35.gated_delta_rule = self.real


def parse_wave(spec: str) -> tuple[int, int, int]:
    """NxL or NxL@S -> (prompts, new tokens each, tokens computed before them)."""
    rows, _, rest = spec.partition("x")
    tokens, _, start = rest.partition("@")
    return int(rows), int(tokens), int(start or 0)


def wave_rows(model: Qwen35Model, dtype: torch.dtype, specs: list[str], reps: int, base: dict) -> None:
    """Each wave (parse_wave) as one step on its own slots, the waves in interleaved rounds after a warm-up round:
    the step's ms and the delta rule's (medians, and the step's best)."""
    waves = [parse_wave(spec) for spec in specs]
    harness = Harness(model, max(n + start for _, n, start in waves) + 2, dtype, max(rows for rows, _, _ in waves))
    ids = torch.randint(0, 1000, (max(n for _, n, _ in waves),)).tolist()
    steps = {spec: [] for spec in specs}
    rules = {spec: [] for spec in specs}
    for round_index in range(1 + reps):
        for spec, (rows, n, start) in zip(specs, waves):
            with RuleClock() as clock:
                started = time.perf_counter()
                harness.step(ids[:n], start, rows)
                elapsed = time.perf_counter() - started
            if round_index:
                steps[spec].append(elapsed)
                rules[spec].append(clock.seconds)
    for spec, (rows, n, start) in zip(specs, waves):
        step_ms, rule_ms = statistics.median(steps[spec]) * 1e3, statistics.median(rules[spec]) * 1e3
        print(json.dumps({**base, "kind": "wave", "wave": spec, "prompts": rows, "tokens_each": n,
                          "computed_before": start, "step_ms_median": round(step_ms, 1),
                          "step_ms_min": round(min(steps[spec]) * 1e3, 1), "rule_ms_median": round(rule_ms, 1),
                          "rule_share": round(rule_ms / step_ms, 3), "reps": reps,
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    del harness


def memory_per_sequence(cfg: ModelConfig, model: Qwen35Model, context: int, dtype: torch.dtype) -> dict:
    """Bytes one sequence holds: the hybrid's states (fixed) and KV (6 of 24 layers), against dense decoders'
    KV: the same 24 layers all full attention, and Qwen3-0.6B (28 layers, 8 KV heads of 128)."""
    item = dtype.itemsize
    kv = model.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item * context
    state = model.state_bytes_per_slot()
    dense_same = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item * context
    qwen3_0_6b = 28 * 2 * 8 * 128 * item * context
    mib = 1 << 20
    return {"context_tokens": context, "state_mib": round(state / mib, 2), "kv_mib": round(kv / mib, 2),
            "total_mib": round((state + kv) / mib, 2), "dense_24_layer_kv_mib": round(dense_same / mib, 2),
            "qwen3_0_6b_kv_mib": round(qwen3_0_6b / mib, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", default="512,4096")
    parser.add_argument("--context", default="1024,8192,32768")
    parser.add_argument("--rows", default="1,32", help="decode batch sizes (at the first context)")
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-attention", default="auto", help="auto, sdpa, long, or several: auto,sdpa")
    parser.add_argument("--prefill-chunk", default="0",
                        help="prefill in steps of this many tokens (--max-num-batched-tokens; 0: one step), or "
                             "several: 2048,0")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    parser.add_argument("--wave", default="", help="steps of many prompts: NxL (N fresh prompts of L tokens in one "
                                                   "step) or NxL@S (after S tokens each), several: 32x128,32x16@112")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_heap()  # as the engine's runner does on a CPU
    dtype = getattr(torch, args.dtype)
    prefills = [int(n) for n in args.prefill.split(",") if n]
    waves = [spec for spec in args.wave.split(",") if spec]
    prefill_chunks = [int(n) for n in args.prefill_chunk.split(",") if n]
    contexts = [int(n) for n in args.context.split(",") if n]
    batch_rows = [int(n) for n in args.rows.split(",") if n]
    modes = args.decode_attention.split(",")
    thresholds = {"auto": (long_decode.LONG_DECODE_TOKENS, long_decode.BATCH_LONG_TOKENS),
                  "sdpa": (1 << 62, 1 << 62), "long": (0, 0)}

    def use(mode: str) -> None:
        long_decode.LONG_DECODE_TOKENS, long_decode.BATCH_LONG_TOKENS = thresholds[mode]

    def attention_path(mode: str, ctx: int, rows: int = 1) -> str:
        use(mode)
        return "chunked" if long_decode.takes_long_path(rows, ctx + 1) else "sdpa"

    most = max(prefills + contexts + [n + start for _, n, start in map(parse_wave, waves)]) + 2
    cfg = config_0_8b(most)
    base = {"bench": "qwen35_forward", "model": "qwen3.5-0.8b-random", "dtype": args.dtype,
            "threads": torch.get_num_threads(), "rev": rev(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "omp_waits": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
    ids = torch.randint(0, 1000, (max(prefills + [1]),)).tolist()
    for chunk in (int(c) for c in args.chunks.split(",")):
        model = random_model(cfg, dtype, chunk)
        if waves:
            wave_rows(model, dtype, waves, args.reps, {**base, "chunk_size": chunk})
        harness = Harness(model, most, dtype)
        # Each prompt length at each step size (chunked prefill: one step per chunk, as the engine runs it), in
        # interleaved rounds after one warm-up round
        prefill_cases = [(n, step_tokens or n) for n in prefills for step_tokens in prefill_chunks]
        prefill_times = {case: [] for case in prefill_cases}
        for round_index in range(1 + (1 if max(prefills, default=0) > 2048 else args.reps)):
            for n, step_tokens in prefill_cases:
                started = time.perf_counter()
                for start in range(0, n, step_tokens):
                    harness.step(ids[start:min(n, start + step_tokens)], start)
                if round_index:
                    prefill_times[n, step_tokens].append(time.perf_counter() - started)
        for (n, step_tokens), times in prefill_times.items():
            best = min(times)
            print(json.dumps({**base, "kind": "prefill", "chunk_size": chunk, "prompt_tokens": n,
                              "step_tokens": min(n, step_tokens), "prefill_tok_s": round(n / best, 1),
                              "prefill_ms": round(best * 1e3, 1), "reps": len(times),
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
        if chunk == int(args.chunks.split(",")[0]):
            # Contexts and modes in interleaved rounds, so a change in the box's load hits every row alike and the
            # ratios between rows hold (the box is shared)
            cases = [(ctx, mode) for ctx in contexts for mode in modes]
            times = {case: [] for case in cases}
            cpu_times = {case: [] for case in cases}
            for round_index in range(2 + max(5, args.reps)):
                for ctx, mode in cases:
                    use(mode)
                    cpu_start, started = time.process_time(), time.perf_counter()
                    harness.step([7], ctx)
                    if round_index >= 2:  # two warm-up rounds
                        times[ctx, mode].append(time.perf_counter() - started)
                        cpu_times[ctx, mode].append(time.process_time() - cpu_start)
            for ctx, mode in cases:
                use(mode)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    harness.step([7], ctx)
                first = times[contexts[0], mode]
                print(json.dumps({**base, "kind": "decode", "rows": 1, "context_tokens": ctx,
                                  "decode_attention": attention_path(mode, ctx),
                                  "decode_ms_median": round(statistics.median(times[ctx, mode]) * 1e3, 2),
                                  "decode_ms_min": round(min(times[ctx, mode]) * 1e3, 2),
                                  f"median_over_{contexts[0]}": round(statistics.median(times[ctx, mode])
                                                                      / statistics.median(first), 3),
                                  f"min_over_{contexts[0]}": round(min(times[ctx, mode]) / min(first), 3),
                                  "cpu_ms_median": round(statistics.median(cpu_times[ctx, mode]) * 1e3, 2),
                                  "top_level_ops": sum(1 for e in prof.events() if e.cpu_parent is None),
                                  "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
            del harness
            ctx = contexts[0] if contexts else 1024
            for rows in (r for r in batch_rows if r > 1):
                harness = Harness(model, ctx + 2, dtype, rows)
                for mode in modes:
                    use(mode)
                    cost = step_cost(lambda: harness.step([7], ctx, rows), reps=max(5, args.reps))
                    print(json.dumps({**base, "kind": "decode", "rows": rows, "context_tokens": ctx,
                                      "decode_attention": attention_path(mode, ctx, rows), **cost,
                                      "tok_s": round(rows / cost["decode_ms_median"] * 1e3, 1),
                                      "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
                del harness
            use("auto")
            for ctx in contexts:
                print(json.dumps({**base, "kind": "memory_per_sequence", **memory_per_sequence(cfg, model, ctx,
                                                                                            dtype)}), flush=True)
        del model
        print(f"chunk {chunk} done", file=sys.stderr)


if __name__ == "__main__":
    main()
