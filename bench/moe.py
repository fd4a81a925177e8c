"""Mixture-of-experts on a CPU, Qwen3-30B-A3B-shaped (hidden 2048, 128 experts of 768, top-8, GQA 32/4 x 128) with
its 48 layers cut to --layers (4: about 3B parameters with the embedding and head, 0.5B active per token).

python -m bench.moe micro [--tokens 1,32] [--rounds 10] [--threads N] [--quantization none|int8|int4]
    one MoE layer's experts, ms per call for each way of running them, interleaved, each call on experts of its own (a
    step's are not in cache): Experts.forward over the served experts (pre-packed, or quantized; at one token its
    one-token path), the same experts sorted by expert (the path of any batch), the dense stack's views sorted, and
    index_select of the chosen experts' weights then one bmm; at one token also the one-token path before
    (per_expert_loop: each expert whole, weighted, added), the chosen experts' 2k matmuls alone (the floor: GB/s
    alone against in the layer), and the router's matmul dense and pre-packed. {"bench": "moe_micro", "tokens",
    "way", "ms", "gb_s"}
python -m bench.moe decode [--model-dir DIR] [--configs bfloat16,bfloat16+int8] [--streams 1,8,32] [--tokens 16]
    writes the random checkpoint first when DIR holds none (bf16 safetensors, one shard per layer); then per config
    decode tok/s through EngineCore, its threads sized as a served core's (--threads auto: the ThreadGovernor, which
    a busy box takes down to 1; or a count), and at one stream the bytes of weights the step's matmuls read
    (attention, routers, the experts each layer ran, the LM head) against the active parameters' bytes (the same,
    with top_k experts of average size per layer). {"bench": "moe_decode", "config", "streams", "tok_s", "step_ms",
    "threads", "loadavg_1m"} and {"bench": "moe_bytes", "config", "read_bytes", "active_bytes", "ratio"}.
python -m bench.moe step [--config bfloat16|bfloat16+int8] [--threads N] [--rounds 10] [--steps 8] [--prompt 128]
    one stream through EngineCore at fixed threads, where its step's time goes (the model's forward, the LM head, the
    MoE MLPs, their experts: ms a step, medians) for four variants interleaved in rounds: served, per_expert_loop
    (the one-token path before: each expert whole, weighted, added), router_f_linear (the routers dense through
    F.linear, as before) and before (both). {"bench": "moe_step", "variant", "step_ms", "forward_ms", "lm_head_ms",
    "moe_ms", "experts_ms", "loadavg_1m"}
python -m bench.moe serve [--model-dir DIR] [--pairs bf16,int8] [--streams 1,8,32] [--llama-threads N] [--keep]
    side by side with llama.cpp's server through HTTP: the checkpoint (written when absent, with the Qwen3 tokenizer)
    converted to GGUF bf16 and q8_0 by llama.cpp's convert_hf_to_gguf.py, then per pair (rawserve bf16 against
    llama-server bf16, rawserve --quantization int8 against q8_0) both servers up at once (each idle while the other
    is measured) and the peers' loadgen.py (../shared/peers: 128-token prompts, 64 tokens, temperature 0,
    ignore_eos, 2C requests) run against each in turn at every stream count, interleaved. {"bench": "moe_serve",
    "pair", "streams", "rawserve_tok_s", "llama_tok_s", "ratio", "loadavg_1m_before", ...}. The checkpoint and GGUFs
    are deleted afterwards unless --keep (about 16 GB: 6.2 GB safetensors, 6.2 GB bf16 and 3.3 GB q8_0 GGUF).
Each config runs in a subprocess of its own, so one's memory is gone before the next loads. The machine is shared:
figures are as loaded as it was.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
             num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, norm_topk_prob=True,
             tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=151643,
             eos_token_id=151645)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# ---- micro ---------------------------------------------------------------------------------------------------------

def micro(args: argparse.Namespace) -> None:
    from rawserve.engine.loader import ModelConfig, MoEConfig
    from rawserve.engine.models.moe import Experts, SparseMoe

    e, i, h, k = SHAPE["num_experts"], SHAPE["moe_intermediate_size"], SHAPE["hidden_size"], 8
    cfg = ModelConfig("qwen3_moe", "Qwen3MoeForCausalLM", 256, h, i, 1, 32, 4, 128, 1e-6, 1e6, 4096, False, False,
                      True, moe=MoEConfig(e, k, i, "softmax_topk", True, (True,)))
    torch.manual_seed(0)
    views = Experts(cfg, torch.bfloat16)  # the dense stacks, each expert a view of them
    views.gate_up.data.normal_(0, 0.02)
    views.down.data.normal_(0, 0.02)
    packed = SparseMoe(cfg, torch.bfloat16)  # the served form: router and experts pre-packed
    packed.router.data.zero_()
    packed.experts.gate_up.data.copy_(views.gate_up)
    packed.experts.down.data.copy_(views.down)
    packed.prepack()
    experts = packed.experts
    # 48 routers (a 48-layer model's), each way's call on the next: a step's router is as cold as its experts
    routers = [torch.randn(e, h, dtype=torch.bfloat16) for _ in range(48)]
    routers_packed = [torch.ops.mkldnn._reorder_linear_weight(r) for r in routers]
    calls = {"router_f_linear": 0, "router_prepacked": 0}

    def router_way(name: str, x: torch.Tensor) -> None:
        n = calls[name] = calls[name] + 1
        if name == "router_f_linear":
            F.linear(x, routers[n % 48])
        else:
            torch.ops.mkldnn._linear_pointwise(x, routers_packed[n % 48], None, "none", [], "")

    if args.quantization != "none":  # the experts as --quantization holds them (the router stays packed)
        from rawserve.engine.quant import probe_plan

        experts.quant_plan = probe_plan(args.quantization, 128, torch.device("cpu"))
        experts.quant = [(experts._quantize(views.gate_up[x].float()), experts._quantize(views.down[x].float()))
                         for x in range(e)]
        experts.packed = None
    lp = torch.ops.mkldnn._linear_pointwise

    def per_expert_loop(x, weights, ids):  # the one-token path before: the whole expert, weighted, k times over
        out = None
        for j, expert in enumerate(ids[0].tolist()):
            y = experts.expert(x, expert) * weights[0, j]
            out = y if out is None else out + y
        return out

    def matmuls_alone(x, weights, ids):  # the floor of any way: the chosen experts' 2k matmuls and nothing else
        if experts.quant is not None:
            x = x.float() if experts.quant[0][0].kernel == "w8a8" else x
            hidden = torch.zeros(1, i, dtype=x.dtype)
            for expert in ids[0].tolist():
                experts.quant[expert][0](x)
                experts.quant[expert][1](hidden)
            return None
        hidden = torch.zeros(1, i, dtype=x.dtype)
        for expert in ids[0].tolist():
            lp(x, experts.packed[expert][0], None, "none", [], "")
            lp(hidden, experts.packed[expert][1], None, "none", [], "")
        return None

    def gather_bmm(x, weights, ids):
        flat = ids.flatten()
        gate_up = views.gate_up.index_select(0, flat)  # [T k, 2I, H]: a copy of the chosen experts
        down = views.down.index_select(0, flat)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(2)  # [T k, H, 1]
        gate, up = torch.bmm(gate_up, xs).squeeze(2).split(i, dim=-1)
        ys = torch.bmm(down, (F.silu(gate) * up).unsqueeze(2)).squeeze(2) * weights.flatten().unsqueeze(1)
        return ys.view(-1, k, h).sum(1)

    every = {"forward": lambda x, w, ids: experts(x, w, ids),
            "sorted": lambda x, w, ids: experts.sorted_by_expert(x, w, ids),
            "sorted_views": lambda x, w, ids: views(x, w, ids), "gather_bmm": gather_bmm}
    with torch.inference_mode():
        for tokens in args.tokens:
            ways = dict(every)
            if tokens == 1:  # the one-token ways, and the router's matmul either way
                ways.update(per_expert_loop=per_expert_loop, matmuls_alone=matmuls_alone,
                            router_f_linear=lambda x, w, ids: router_way("router_f_linear", x),
                            router_prepacked=lambda x, w, ids: router_way("router_prepacked", x))
            times: dict[str, list[float]] = {name: [] for name in ways}
            gen = torch.Generator().manual_seed(tokens)
            for r in range(args.rounds):  # ways interleaved, the order flipped each round; each call on experts of
                # its own, read cold as in a step
                for name, way in (list(ways.items()) if r % 2 else list(ways.items())[::-1]):
                    x = torch.randn(tokens, h, dtype=torch.bfloat16, generator=gen)
                    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
                    w = torch.rand(tokens, k, generator=gen).softmax(-1).bfloat16()
                    start = time.perf_counter()
                    got = way(x, w, ids)
                    times[name].append((time.perf_counter() - start) * 1000)
                    want = views(x, w, ids).float()  # checked after the clock stops
                    if got is not None and got.shape == want.shape:  # int8 experts: within their error
                        tolerance = 1e-2 if args.quantization == "none" or name.endswith("views") else 0.1
                        assert (got.float() - want).abs().max() < tolerance * want.abs().max() + 1e-3, name
            active = experts.top_k * experts.expert_bytes(0)
            for name, ms in times.items():
                row = {"bench": "moe_micro", "quantization": args.quantization, "tokens": tokens, "way": name,
                       "ms": round(statistics.median(ms), 3)}
                if tokens == 1 and name in ("forward", "sorted", "per_expert_loop", "matmuls_alone"):
                    # the served experts' chosen bytes over the time
                    row["gb_s"] = round(active / statistics.median(ms) / 1e6, 1)
                emit({**row, "threads": torch.get_num_threads(), "loadavg_1m": round(os.getloadavg()[0], 2)})


# ---- checkpoint ----------------------------------------------------------------------------------------------------

def make_checkpoint(model_dir: pathlib.Path, num_layers: int) -> None:
    """Random bf16 weights under Qwen3-MoE's per-expert names, one safetensors shard per layer (never the whole model
    in memory), plus config.json and the index."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    h, i, e = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    q, kv, hd = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"], \
        SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).bfloat16()

    weight_map = {}
    shards = [("embed", {"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h),
                         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                         "lm_head.weight": rand(SHAPE["vocab_size"], h)})]
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        t = {f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
             f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, q),
             f"{p}.self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             f"{p}.self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
             f"{p}.mlp.gate.weight": rand(e, h, std=0.5)}
        for x in range(e):
            t[f"{p}.mlp.experts.{x}.gate_proj.weight"] = rand(i, h)
            t[f"{p}.mlp.experts.{x}.up_proj.weight"] = rand(i, h)
            t[f"{p}.mlp.experts.{x}.down_proj.weight"] = rand(h, i)
        shards.append((f"layer{layer}", t))
    for name, tensors in shards:
        file = f"model-{name}.safetensors"
        save_file(tensors, str(model_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {**SHAPE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "num_hidden_layers": num_layers, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))


# ---- decode --------------------------------------------------------------------------------------------------------

def decode_one(args: argparse.Namespace) -> None:
    """One config in this process: tok/s per stream count, then the one-stream step's bytes."""
    from rawserve.config import EngineConfig
    from rawserve.engine.core import make_engine_core
    from rawserve.engine.models import moe
    from rawserve.engine.types import SamplingParams

    dtype, _, scheme = args.config.partition("+")
    # as a served core sizes its threads: auto brings the ThreadGovernor, which a busy box takes down to 1
    core = make_engine_core(EngineConfig(model_dir=str(args.model_dir), device="cpu", dtype=dtype,
                                         quantization=scheme or "none", max_num_seqs=max(args.streams),
                                         max_num_batched_tokens=2048, max_model_len=1024, num_kv_blocks=1024,
                                         num_threads=args.threads))
    model = core.runner.model
    for streams in args.streams:
        for s in range(streams):
            ids = torch.randint(10, 150000, (args.prompt,), generator=torch.Generator().manual_seed(s)).tolist()
            core.add_request(f"{streams}-{s}", ids, SamplingParams(temperature=0, max_tokens=args.tokens + 1,
                                                                  ignore_eos=True))
        core.step()  # every prompt (and the first token)
        steps, start = 0, time.perf_counter()
        while core.has_unfinished:
            core.step()
            steps += 1
        elapsed = time.perf_counter() - start
        # the threads it ran with: a served core's governor may have run fewer (the serve rows say how many)
        emit({"bench": "moe_decode", "config": args.config, "streams": streams,
              "tok_s": round(streams * steps / elapsed, 2), "step_ms": round(1000 * elapsed / steps, 1),
              "threads": torch.get_num_threads(), "loadavg_1m": round(os.getloadavg()[0], 2)})
    # the one-stream step's weight bytes, from what the matmuls are handed
    read = {"experts": 0}
    gate_up, down = moe.Experts.gate_up_proj, moe.Experts.down_proj

    def counting(part, proj):
        def run(module, x, index):
            read["experts"] += module.weight_bytes(index, part)
            return proj(module, x, index)
        return run

    moe.Experts.gate_up_proj, moe.Experts.down_proj = counting("gate_up", gate_up), counting("down", down)
    core.add_request("bytes", [11] * args.prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()
    read["experts"] = 0
    core.step()
    moe.Experts.gate_up_proj, moe.Experts.down_proj = gate_up, down
    dense = 0
    blocks = []
    for layer in model.layers:
        for name in layer.linear_names:  # every attention matmul reads its whole weight each step
            q = layer.quant.get(name)
            dense += q.num_bytes if q is not None else _packed_bytes(layer, name)
        blocks.append(layer.moe)
        dense += layer.moe.router_bytes()
    head = model.quant_head.num_bytes if model.quant_head is not None else \
        model.cfg.vocab_size * model.cfg.hidden_size * model.norm.element_size()
    active = dense + head + moe.active_expert_bytes(blocks)
    total = dense + head + read["experts"]
    emit({"bench": "moe_bytes", "config": args.config, "read_bytes": total, "active_bytes": active,
          "ratio": round(total / active, 3), "expert_bytes_read": read["experts"]})


def _packed_bytes(layer, name: str) -> int:
    packed = layer.packed.get(name)
    weight = getattr(layer, name)
    return packed.numel() * packed.element_size() if packed is not None else weight.numel() * weight.element_size()


def _ensure_checkpoint(args: argparse.Namespace) -> pathlib.Path:
    """args.model_dir, written first (random weights, args.layers layers) when it holds no checkpoint yet."""
    model_dir = pathlib.Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        start = time.perf_counter()
        make_checkpoint(model_dir, args.layers)
        emit({"bench": "moe_checkpoint", "dir": str(model_dir), "layers": args.layers,
              "write_s": round(time.perf_counter() - start, 1)})
    return model_dir


def decode(args: argparse.Namespace) -> None:
    model_dir = _ensure_checkpoint(args)
    for config in args.configs:
        cmd = [sys.executable, "-m", "bench.moe", "decode-one", "--model-dir", str(model_dir), "--config", config,
               "--streams", ",".join(map(str, args.streams)), "--tokens", str(args.tokens),
               "--prompt", str(args.prompt), "--threads", str(args.threads)]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


# ---- step: where a one-stream step's time goes, and the one-token path against the one before ------------------------

def step(args: argparse.Namespace) -> None:
    """One stream through EngineCore at fixed threads: per variant, interleaved in rounds of --steps steps (the order
    flipped each round), the step's ms and the parts of it (the model's forward, the LM head, the MoE MLPs, their
    experts). Variants: served (the one-token path, routers pre-packed), per_expert_loop (the experts each run whole,
    weighted and added: the path before), router_f_linear (the routers' dense weights through F.linear, as before),
    before (both)."""
    from safetensors import safe_open

    from rawserve.config import EngineConfig
    from rawserve.engine.core import make_engine_core
    from rawserve.engine.models import moe
    from rawserve.engine.types import SamplingParams

    model_dir = _ensure_checkpoint(args)
    dtype, _, scheme = args.config.partition("+")
    core = make_engine_core(EngineConfig(model_dir=str(model_dir), device="cpu", dtype=dtype,
                                         quantization=scheme or "none", max_num_seqs=4, max_num_batched_tokens=2048,
                                         max_model_len=2048, num_kv_blocks=256, num_threads=args.threads))
    model = core.runner.model
    blocks = [layer.moe for layer in model.layers]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    dense_routers = []
    for i in range(len(blocks)):
        name = f"model.layers.{i}.mlp.gate.weight"
        with safe_open(str(model_dir / index[name]), "pt") as f:
            dense_routers.append(f.get_tensor(name).to(model.norm.dtype))
    served_linear, served_forward = moe.SparseMoe.linear, moe.Experts.forward

    def router_f_linear(block, x, name, bias=None):
        if name == "router":
            return F.linear(x, dense_routers[blocks.index(block)], bias)
        return served_linear(block, x, name, bias)

    def per_expert_loop(experts, x, weights, ids):
        if ids.shape[0] != 1:
            return experts.sorted_by_expert(x, weights, ids)
        out = None
        for j, expert in enumerate(ids[0].tolist()):
            y = experts.expert(x, expert) * weights[0, j]
            out = y if out is None else out + y
        return out

    variants = {"served": (served_linear, served_forward), "per_expert_loop": (served_linear, per_expert_loop),
                "router_f_linear": (router_f_linear, served_forward), "before": (router_f_linear, per_expert_loop)}
    parts: dict[str, float] = {}

    def timed(name: str, fn):
        def run(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - start
            return out
        return run

    core.add_request("one", list(range(100, 100 + args.prompt)),
                     SamplingParams(temperature=0, max_tokens=2048 - args.prompt - 8, ignore_eos=True))
    core.step()
    for _ in range(3):
        core.step()
    model.forward, model.compute_logits = timed("forward", model.forward), timed("lm_head", model.compute_logits)
    served_moe = moe.SparseMoe.forward
    moe.SparseMoe.forward = timed("moe", served_moe)
    got: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in (list(variants) if r % 2 else list(variants)[::-1]):
            linear, forward = variants[name]
            moe.SparseMoe.linear = linear
            moe.Experts.forward = timed("experts", forward)
            for _ in range(args.steps):
                parts.clear()
                start = time.perf_counter()
                core.step()
                row = got[name]
                row.setdefault("step", []).append(time.perf_counter() - start)
                for part, seconds in parts.items():
                    row.setdefault(part, []).append(seconds)
    moe.SparseMoe.linear, moe.Experts.forward, moe.SparseMoe.forward = served_linear, served_forward, served_moe
    for name, row in got.items():
        emit({"bench": "moe_step", "config": args.config, "variant": name, "threads": torch.get_num_threads(),
              **{f"{part}_ms": round(1000 * statistics.median(v), 2) for part, v in row.items()},
              "steps": len(row["step"]), "loadavg_1m": [round(min(loads), 2), round(max(loads), 2)]})


# ---- serve: side by side with llama.cpp's server ---------------------------------------------------------------------

PEERS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "peers"
PEERS_ROOT = pathlib.Path(os.environ.get("PEERS_ROOT", pathlib.Path.home() / ".cache" / "rawserve-peers"))
# the peers' run.sh load: the same for both servers
LOADGEN = ["--max-tokens", "64", "--prompt-tokens", "128", "--temperature", "0", "--ignore-eos"]
# pair -> (rawserve flags, the GGUF type llama-server gets)
PAIRS = {"bf16": ([], "bf16"), "int8": (["--quantization", "int8"], "q8_0")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def to_gguf(args: argparse.Namespace, model_dir: pathlib.Path, outtype: str) -> pathlib.Path:
    """llama.cpp's converter on the checkpoint; the tokenizer's pre-tokenizer named qwen2, as the published Qwen3
    GGUFs have it (bench.embeddings.CONVERT: the converter knows no hash for a tokenizer it has not seen)."""
    from bench.embeddings import CONVERT

    out = model_dir.parent / f"{model_dir.name}-{outtype}.gguf"
    if not out.exists():
        start = time.perf_counter()
        partial = out.with_suffix(".partial")
        subprocess.run([args.llama_python, "-c", CONVERT, str(args.llama_source), "qwen2", str(model_dir),
                        "--outtype", outtype, "--outfile", str(partial)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        os.replace(partial, out)
        emit({"bench": "moe_gguf", "file": str(out), "bytes": out.stat().st_size,
              "convert_s": round(time.perf_counter() - start, 1)})
    return out


class Server:
    """One server in its own process group on a free port, up once it answers /health (the peers' bench.py's
    check); stop() ends that group only."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: pathlib.Path) -> None:
        import importlib.util

        # ../shared/peers/bench.py (healthy(), peak_rss_mib()), by path: this project's own package is named bench
        spec = importlib.util.spec_from_file_location("peers_bench", PEERS / "bench.py")
        peers_bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(peers_bench)
        self.peers = peers_bench
        self.name, self.port = name, port
        self.log = open(log_path, "ab")
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        while not peers_bench.healthy(port):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {log_path}")
            if time.perf_counter() - start > 600:
                self.stop()
                raise RuntimeError(f"{name} did not answer /health in 600 s; see {log_path}")
            time.sleep(1)
        self.startup_s = round(time.perf_counter() - start, 1)

    def load(self, streams: int, model: str) -> dict:
        """The peers' loadgen.py at `streams` concurrent streams (2 x streams requests): its JSON line."""
        cmd = [sys.executable, str(PEERS / "loadgen.py"), "--port", str(self.port), "--model", model,
               "--concurrency", str(streams), "--label", self.name, *LOADGEN]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = out.stdout.strip().splitlines()
        if out.returncode or not lines:
            raise RuntimeError(f"loadgen against {self.name} failed: {out.stderr[-500:]}")
        return json.loads(lines[-1])

    def engine_threads(self) -> int | None:
        """rawserve's engine_threads gauge now (its ThreadGovernor's count after the load); None for a server
        without it."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("rawserve:engine_threads"):
                return int(float(line.rsplit(" ", 1)[1]))
        return None

    def rss_mib(self) -> int | None:
        return self.peers.peak_rss_mib(self.proc.pid)

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def serve(args: argparse.Namespace) -> None:
    from bench.checkpoints import copy_qwen3_tokenizer

    model_dir = _ensure_checkpoint(args)
    if not copy_qwen3_tokenizer(model_dir):
        raise SystemExit("serve needs the Qwen3 tokenizer (../shared/fixtures/qwen3-tokenizer)")
    threads = str(args.llama_threads or os.cpu_count())  # run.sh's -t / -tb: every CPU
    made = [model_dir]
    try:
        for pair in args.pairs:
            flags, outtype = PAIRS[pair]
            gguf = to_gguf(args, model_dir, outtype)
            made.append(gguf)
            name = f"qwen3moe-{outtype}"
            rawserve_port, llama_port = free_port(), free_port()
            servers = []
            try:
                servers.append(Server("rawserve", [
                    sys.executable, "-m", "rawserve", "--model-dir", str(model_dir), "--served-model-name", name,
                    "--host", "127.0.0.1", "--port", str(rawserve_port), "--dtype", "bfloat16",
                    "--max-num-seqs", str(max(args.streams)), *flags], rawserve_port,
                    model_dir.parent / f"rawserve-{pair}.log"))
                slots = max(args.streams)
                servers.append(Server("llama-server", [
                    args.llama_server, "-m", str(gguf), "--alias", name, "--host", "127.0.0.1",
                    "--port", str(llama_port), "-t", threads, "-tb", threads, "-np", str(slots),
                    "-c", str(slots * 256), "-kvu", "--no-webui"], llama_port, model_dir.parent / f"llama-{pair}.log"))
                for streams in args.streams:
                    got, loadavg, threads_after = {}, {}, None
                    # one after the other, the order flipped each level so neither always runs second
                    order = servers if streams % 2 else servers[::-1]
                    for server in order:
                        loadavg[server.name] = round(os.getloadavg()[0], 2)
                        got[server.name] = server.load(streams, name)
                        if server.name == "rawserve":
                            threads_after = server.engine_threads()
                    rs, ll = got["rawserve"], got["llama-server"]
                    emit({"bench": "moe_serve", "pair": f"rawserve {pair} / llama-server {outtype}", "streams": streams,
                          "rawserve_tok_s": rs["tok_s"], "llama_tok_s": ll["tok_s"],
                          "ratio": round(rs["tok_s"] / ll["tok_s"], 3) if ll["tok_s"] else None,
                          "rawserve_ttft_p50_ms": rs.get("ttft_p50_ms"), "llama_ttft_p50_ms": ll.get("ttft_p50_ms"),
                          "rawserve_tpot_p50_ms": rs.get("tpot_p50_ms"), "llama_tpot_p50_ms": ll.get("tpot_p50_ms"),
                          "short": [rs.get("short"), ll.get("short")], "loadavg_1m_before": loadavg,
                          "first": order[0].name, "llama_threads": int(threads),
                          "rawserve_engine_threads_after": threads_after})
                emit({"bench": "moe_serve_servers", "pair": pair,
                      **{f"{s.name}_startup_s": s.startup_s for s in servers},
                      **{f"{s.name}_peak_rss_mib": s.rss_mib() for s in servers}})
            finally:
                for server in servers:
                    server.stop()
    finally:
        if not args.keep:
            for path in made:
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("micro", "decode", "decode-one", "step", "serve"))
    parser.add_argument("--steps", type=int, default=8, help="step: steps per variant per round")
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--model-dir", default="/tmp/rawserve-bench-moe")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--configs", default="bfloat16,bfloat16+int8")
    parser.add_argument("--config", default="bfloat16")
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                        help="micro: the experts' form (the ways over views and gather_bmm stay bf16)")
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (decode: 16, step: 128)")
    parser.add_argument("--pairs", default="bf16,int8", help="serve: rawserve bf16 vs GGUF bf16, int8 vs q8_0")
    parser.add_argument("--llama-server", default=str(PEERS_ROOT / "llama.cpp" / "build" / "bin" / "llama-server"))
    parser.add_argument("--llama-python", default=str(PEERS_ROOT / "venv" / "bin" / "python"),
                        help="a Python with gguf, for llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--keep", action="store_true", help="serve: keep the checkpoint and GGUFs")
    parser.add_argument("--threads", default="auto", help="decode: the engine's threads (auto, as served, or a "
                        "count: 1 is what a served core's governor runs beside busy neighbours)")
    parser.add_argument("--llama-threads", type=int, default=None, help="serve: llama-server's -t/-tb (default: "
                        "every CPU, as ../shared/peers/run.sh); rawserve keeps its own auto threads")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.prompt = args.prompt or (128 if args.mode == "step" else 16)
    args.configs = args.configs.split(",")
    args.pairs = args.pairs.split(",")
    args.llama_source = pathlib.Path(args.llama_server).resolve().parents[2]
    if args.mode == "micro":
        if args.threads != "auto":
            torch.set_num_threads(int(args.threads))
        args.tokens = [int(t) for t in (args.tokens or "1,32").split(",")]
        micro(args)
        return
    if args.mode == "serve":
        serve(args)
        return
    if args.mode == "step":
        step(args)
        return
    args.tokens = int(args.tokens or 16)
    (decode if args.mode == "decode" else decode_one)(args)


if __name__ == "__main__":
    main()
