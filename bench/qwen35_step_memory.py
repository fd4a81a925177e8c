"""Where a Qwen3.5 worst-case step's working memory goes: the runner's profile step (one fresh prompt of
--tokens tokens, --rows logit rows, the sampler's modelled worst case) on a random Qwen3.5-0.8B-shaped text stack,
its peak RSS rise measured as ModelRunner._profile_step does (freed heap kept), then each part of each layer alone
(the C heap trimmed before it, so a part's rise is what it holds at its peak over what was live).

python -m bench.qwen35_step_memory [--dtype float32] [--tokens 8192] [--rows 256] [--layers 4] [--threads 0]
python -m bench.qwen35_step_memory --model-dir DIR [--dtype float32] [--quantization int8] [--tokens 2048]
Prints JSON lines (MiB; the 1-minute load average beside them). --layers 4 keeps one full-attention layer after
three DeltaNet layers: every layer of a kind makes the same transients, so the peak of 24 is that of 4.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.qwen35_forward import BLOCK, config_0_8b, random_model
from rawserve.engine import memory
from rawserve.engine.attention import torch_backend
from rawserve.engine.model_runner import sampler_worst_case
from rawserve.engine.models import qwen35
from rawserve.engine.models.gated_delta import StateBatch
from rawserve.engine.step_plan import StepInput
from rawserve.process_stats import keep_freed_heap, release_free_heap
from tests.engine.test_qwen35_model import attention_metadata

MIB = 1 << 20


class Parts:
    """Wraps named functions so that each call's peak RSS rise is recorded (the largest per name)."""

    def __init__(self) -> None:
        self.rise: dict[str, int] = {}
        self.undo: list = []

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def measured(*args, **kwargs):
            release_free_heap()
            memory.reset_peak_rss()
            before = memory.rss_bytes()
            out = fn(*args, **kwargs)
            self.rise[name] = max(self.rise.get(name, 0), memory.rss_bytes("VmHWM") - before)
            return out

        setattr(owner, attr, measured)
        self.undo.append((owner, attr, fn))

    def restore(self) -> None:
        for owner, attr, fn in reversed(self.undo):
            setattr(owner, attr, fn)
        self.undo.clear()


def step(model, kv, states, ids: list[int], rows: int) -> None:
    """One fresh prompt in state slot 0, logits for `rows` rows spread over it, then the sampler's worst case."""
    seqs = [StepInput(ids, 0, list(range(-(-len(ids) // BLOCK))), state_slot=0)]
    meta, positions = attention_metadata(seqs, BLOCK)
    hidden = model(torch.tensor(ids), positions, kv, meta, states=states, state_batch=StateBatch.from_inputs(seqs))
    picks = torch.tensor([len(ids) - 1 - i * (len(ids) // rows) for i in range(rows)][::-1])
    logits = model.compute_logits(hidden[picks])
    sampler_worst_case(logits)


def runner_margin(args: argparse.Namespace) -> None:
    """ModelRunner's own profile step on a checkpoint (--model-dir): the text step it measures and the margin it
    plans with (a vision checkpoint's: multimodal/budget.py's step_bytes_with_images around it)."""
    from rawserve.config import EngineConfig
    from rawserve.engine.model_runner import ModelRunner

    seen: list[int] = []
    real = ModelRunner._profile_step

    def profiled(self: ModelRunner) -> int:
        with_images = self._with_images
        self._with_images = lambda text: (seen.append(text), with_images(text))[1]
        return real(self)

    ModelRunner._profile_step = profiled
    config = EngineConfig(model_dir=args.model_dir, dtype=args.dtype, quantization=args.quantization,
                          max_model_len=args.max_model_len or None, max_num_batched_tokens=args.tokens,
                          max_num_seqs=args.rows, mm_processor_kwargs=args.mm_processor_kwargs)
    started = time.perf_counter()
    runner = ModelRunner(config)
    print(json.dumps({"bench": "qwen35_step_memory", "kind": "runner", "model_dir": args.model_dir,
                      "dtype": args.dtype, "quantization": args.quantization, "tokens": args.tokens,
                      "rows": args.rows, "text_step_mib": round(seen[0] / MIB),
                      "margin_mib": round(runner._with_images(seen[0]) / MIB), "kv_plan": runner.kv_plan.reason,
                      "start_s": round(time.perf_counter() - started, 1),
                      "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", help="ModelRunner's profile step on this checkpoint instead")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--max-model-len", type=int, default=8192, help="0: the checkpoint's")
    parser.add_argument("--mm-processor-kwargs", help="JSON, as the server's flag")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--parts", type=int, default=1, help="0: the whole step only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model_dir:
        runner_margin(args)
        return
    dtype = getattr(torch, args.dtype)
    cfg = config_0_8b(args.tokens + 1)
    cfg.num_layers = args.layers
    cfg.hybrid.layer_types = cfg.hybrid.layer_types[:args.layers]
    model = random_model(cfg, dtype, qwen35.CHUNK_SIZE)
    model.init_rope(args.tokens + 1, torch.device("cpu"))
    blocks = -(-args.tokens // BLOCK)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(model.num_kv_layers)]
    states = model.allocate_states(1, torch.device("cpu"))
    ids = torch.randint(0, 1000, (args.tokens,)).tolist()
    base = {"bench": "qwen35_step_memory", "dtype": args.dtype, "tokens": args.tokens, "rows": args.rows,
            "layers": args.layers, "threads": torch.get_num_threads()}
    keep_freed_heap()  # as the runner does on a CPU: the profile step's conditions
    with torch.inference_mode():
        release_free_heap()
        memory.reset_peak_rss()
        before = memory.rss_bytes()
        started = time.perf_counter()
        step(model, kv, states, ids, args.rows)
        print(json.dumps({**base, "kind": "step", "rise_mib": round((memory.rss_bytes("VmHWM") - before) / MIB),
                          "step_s": round(time.perf_counter() - started, 2),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
        if not args.parts:
            return
        parts = Parts()
        for fn in ("causal_conv", "l2_normalize", "gated_delta_rule"):
            parts.wrap(qwen35, fn, f"delta.{fn}")
        parts.wrap(torch_backend, "paged_attention", "attention.paged_attention")
        parts.wrap(qwen35.Qwen35Layer, "mlp_block", "mlp_block")
        parts.wrap(model, "compute_logits", "lm_head")
        parts.wrap(sys.modules[__name__], "sampler_worst_case", "sampler_worst_case")
        release_free_heap()
        step(model, kv, states, ids, args.rows)
        parts.restore()
        layers = Parts()
        for kind in (qwen35.GatedDeltaNetLayer, qwen35.GatedAttentionLayer):
            layers.wrap(kind, "forward", f"layer.{kind.__name__}")
        step(model, kv, states, ids, args.rows)
        layers.restore()
        for name, rise in {**parts.rise, **layers.rise}.items():
            print(json.dumps({**base, "kind": "part", "part": name, "rise_mib": round(rise / MIB),
                              "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
