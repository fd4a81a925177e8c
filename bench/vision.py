"""Image input speed on a Qwen3.5-0.8B-shaped random vision tower (depth 12, hidden 768, patch 16, merge 2, out
1024): preprocessing ms (resize, normalise, patchify in torch) and tower ms per image size, and the time to first
token with one image (preprocess + tower + the prompt's prefill + the first logits) on the random 0.8B text stack.

python -m bench.vision [--sizes 448x448,1024x768,1920x1080] [--dtype float32] [--reps 3] [--slices 2] [--ttft 448x448]:
tower ms one-shot and as the engine's resumable job in --slices slices, taking turns
python -m bench.vision --itl 1920x1080 [--streams 8] [--checkpoint DIR]: the decode inter-token gaps of 8 text
streams through a real EngineCore before and while a request with that image is prefilled (its encoding a slice per
step, charged to the step budget), each gap while it is and the encoder's part of it, and that request's time to
first token, on a random Qwen3.5-0.8B-shaped checkpoint with its vision tower (written to DIR on first use, about
3.5 GB). With --streams 0 it is a lone image's time to first token through the engine.
python -m bench.vision --server-ttft 1920x1080 [--checkpoint DIR]: the time to first token of a chat request with
one such image (a PNG data: URL, a fresh image each run, so the encoder cache never helps) through a live server
(real sockets, the core in a spawned process) on the same checkpoint: a max_tokens=1 request's whole time (the
stream's first chunk would come before any work: it carries only the role).
Prints one JSON object per line, the 1-minute load average beside each figure (the box is shared). Sizes are
resized as the published processor does (min 65,536 / max 16,777,216 pixels).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time

import torch

from bench.model_forward import rev
from rawserve.engine.loader import VisionConfig
from rawserve.engine.mm_inputs import ImageInput, image_token_count, smart_resize
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.models.vision import VisionTower
from rawserve.engine.multimodal.positions import mrope_positions
from rawserve.engine.multimodal.preprocess import PreprocessConfig, pixel_patches
from rawserve.process_stats import keep_freed_heap

VISION_0_8B = VisionConfig(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=1024,
                           num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                           image_token_id=248056)
PREPROCESS = PreprocessConfig(image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
MIN_PIXELS, MAX_PIXELS = 65536, 16777216


def image(width: int, height: int, offset: int = 0) -> ImageInput:
    rgb = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(width))
    data = rgb.numpy().tobytes()
    rh, rw = smart_resize(height, width, 32, MIN_PIXELS, MAX_PIXELS)
    return ImageInput(hashlib.sha256(data).digest(), width, height, data, rh, rw, offset,
                      image_token_count(rh, rw, 16, 2))


def random_tower(dtype: torch.dtype) -> VisionTower:
    tower = VisionTower(VISION_0_8B, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in tower.parameters():
            param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    if cpu_prepack_supported(dtype):
        tower.prepack()  # as load_vision_tower does on a CPU
    return tower.eval()


def timed_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 2)


def paired_ms(fns: list, reps: int) -> list[float]:
    """Each function's median ms over `reps`, the functions taking turns (a shared box's load hits each alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return [round(statistics.median(out), 2) for out in times]


def encode_in_slices(tower: VisionTower, patches: torch.Tensor, grid: tuple[int, int], num_slices: int) -> None:
    """The engine's path (multimodal/encode_job.py): the same forward, resumable, in `num_slices` equal slices."""
    from rawserve.engine.multimodal.encode_job import EncodeJob

    job = EncodeJob(tower, patches, grid)
    share = job.remaining_flops / num_slices
    while not job.advance(share):
        pass


def ttft_ms(tower: VisionTower, picture: ImageInput, dtype: torch.dtype, num_text: int) -> float:
    """One request's first token without the server: preprocess, encode, prefill text + image tokens, logits."""
    from bench.qwen35_forward import BLOCK, config_0_8b, random_model
    from rawserve.engine.models.gated_delta import StateBatch
    from rawserve.engine.step_plan import StepInput
    from tests.engine.test_qwen35_model import attention_metadata

    total = num_text + picture.num_tokens
    model = random_model(config_0_8b(total + 2), dtype, 64)
    model.init_rope(total + 2, torch.device("cpu"))
    kv_shape = (-(-total // BLOCK) + 1, BLOCK, model.cfg.num_kv_heads, model.cfg.head_dim)
    kv = [(torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)) for _ in range(model.num_kv_layers)]
    states = model.allocate_states(1, torch.device("cpu"))
    ids = [11] * num_text + [VISION_0_8B.image_token_id] * picture.num_tokens
    seq = StepInput(ids, 0, list(range(1, kv_shape[0])), state_slot=0)

    @torch.inference_mode()
    def first_token() -> None:
        patches, (_, gh, gw) = pixel_patches(picture, PREPROCESS)
        embeds, _ = tower(patches, [(gh, gw)])
        meta, _ = attention_metadata([seq], BLOCK)
        positions = mrope_positions((picture,), 0, total, 16, 2)
        rows = torch.arange(num_text, total)
        hidden = model(torch.tensor(ids), positions, kv, meta, states=states, state_batch=StateBatch.from_inputs([seq]),
                       embeds=(rows, embeds))
        model.compute_logits(hidden[-1:]).argmax()

    first_token()  # warm
    return timed_ms(first_token, 2)


def checkpoint_0_8b(directory: str) -> str:
    """A random Qwen3_5ForConditionalGeneration shaped as Qwen3.5-0.8B (text and tower), with the published
    processor's pixel bounds; written once."""
    import pathlib

    from tests.checkpoints import make_qwen35_vl_checkpoint

    path = pathlib.Path(directory)
    if not (path / "config.json").is_file():
        vision = {name: getattr(VISION_0_8B, name) for name in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
            "spatial_merge_size", "num_position_embeddings", "hidden_act")}
        make_qwen35_vl_checkpoint(
            path, vision={**vision, "initializer_range": 0.02},
            preprocessor={"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}},
            hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=16, linear_num_value_heads=16, max_position_embeddings=8192, initializer_range=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    return str(path)


def itl_while_image(directory: str, size: str, num_streams: int, dtype: str, num_steps: int) -> dict:
    """Step a core with `num_streams` decoding text streams: `num_steps` step gaps before the image request comes,
    then every gap until its first token. A step's gap is each stream's inter-token latency (one token each)."""
    from rawserve.config import EngineConfig
    from rawserve.engine.core import EngineCore
    from rawserve.engine.mm_inputs import MultiModalInputs
    from rawserve.engine.types import SamplingParams

    core = EngineCore(EngineConfig(model_dir=directory, device="cpu", dtype=dtype, max_model_len=4096,
                                   num_kv_blocks=1024, max_num_seqs=num_streams + 1))
    params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for i in range(num_streams):
        core.add_request(f"text{i}", [1000 + i] * 16, params)
    while any(r.num_output_tokens == 0 for r in core.requests.values()):
        core.step()

    encoder_ms: list[float] = []  # per step: the part of its gap the vision encoder took

    def gaps(until) -> list[float]:
        out: list[float] = []
        while not until(out):
            encoder_s = core.stats().extra["mm_encoder_seconds"]
            start = time.perf_counter()
            core.step()
            out.append((time.perf_counter() - start) * 1e3)
            encoder_ms.append((core.stats().extra["mm_encoder_seconds"] - encoder_s) * 1e3)
        return out

    before = gaps(lambda out: len(out) >= num_steps)
    width, height = (int(v) for v in size.split("x"))
    picture = image(width, height, offset=17)
    ids = [11] * 16 + [248053] + [VISION_0_8B.image_token_id] * picture.num_tokens + [248054] + [12] * 8
    start = time.perf_counter()
    core.add_request("image", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                     features=MultiModalInputs((picture,)))
    during = gaps(lambda _: "image" not in core.requests or core.requests["image"].num_output_tokens > 0)
    ttft = (time.perf_counter() - start) * 1e3

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return round(values[min(len(values) - 1, int(q * len(values)))], 1)

    return {"streams": num_streams, "image": size, "image_tokens": picture.num_tokens,
            "itl_p50_ms_before": pct(before, 0.5), "itl_p99_ms_before": pct(before, 0.99),
            "itl_p50_ms_during": pct(during, 0.5), "itl_p99_ms_during": pct(during, 0.99),
            "itl_max_ms_during": round(max(during), 1), "steps_during": len(during), "image_ttft_ms": round(ttft, 1),
            "gaps_ms_during": [round(v) for v in during],
            "encoder_ms_during": [round(v) for v in encoder_ms[-len(during):]],
            "encoder_s": round(core.stats().extra["mm_encoder_seconds"], 2)}


def server_ttft(directory: str, size: str, dtype: str, runs: int) -> dict:
    import base64
    import io
    import urllib.request

    from PIL import Image

    from rawserve.config import EngineConfig, ServerConfig
    from tests.api.test_openai_server import ServerThread

    width, height = (int(v) for v in size.split("x"))
    server = ServerThread(EngineConfig(model_dir=directory, device="cpu", dtype=dtype, max_model_len=4096),
                          ServerConfig(port=0, engine_mode="process", log_requests=False))

    def first_chunk_ms(seed: int, w: int, h: int) -> float:
        pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        buffer = io.BytesIO()
        Image.fromarray(pixels.numpy()).save(buffer, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        body = {"max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture."}, {"type": "image_url", "image_url": {"url": url}}]}]}
        request = urllib.request.Request(server.base + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            usage = json.loads(response.read())["usage"]
        elapsed = (time.perf_counter() - start) * 1e3
        prompt_tokens.append(usage["prompt_tokens"])
        return elapsed

    prompt_tokens: list[int] = []
    try:
        first_chunk_ms(0, 64, 64)  # warm
        times = [first_chunk_ms(seed, width, height) for seed in range(1, runs + 1)]
    finally:
        server.stop()
    return {"image": size, "runs": runs, "ttft_ms_median": round(statistics.median(times), 1),
            "ttft_ms": [round(t, 1) for t in times], "prompt_tokens": prompt_tokens[-1]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="448x448,1024x768,1920x1080")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slices", type=int, default=2, help="slices of the resumable encode timed beside the "
                        "one-shot tower (2: a lone image in the engine, a part beside its text, then the rest)")
    parser.add_argument("--ttft", default="448x448", help="image size for the time to first token ('' to skip)")
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--itl", default="", help="image size prefilled beside decoding text streams (see above)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--itl-steps", type=int, default=20, help="decode steps measured before the image comes")
    parser.add_argument("--checkpoint", default="/tmp/rawserve-bench-qwen35-0.8b-vl")
    parser.add_argument("--server-ttft", default="", help="image size sent through a live server (see above)")
    args = parser.parse_args()
    keep_freed_heap()
    dtype = getattr(torch, args.dtype)
    if args.server_ttft:
        figures = server_ttft(checkpoint_0_8b(args.checkpoint), args.server_ttft, args.dtype, args.reps)
        print(json.dumps({"bench": "vision_server_ttft", "model": "qwen3.5-0.8b-vl-random", "dtype": args.dtype,
                          "rev": rev(), **figures, "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
        return
    if args.itl:
        figures = itl_while_image(checkpoint_0_8b(args.checkpoint), args.itl, args.streams, args.dtype,
                                  args.itl_steps)
        print(json.dumps({"bench": "vision_itl", "model": "qwen3.5-0.8b-vl-random", "dtype": args.dtype,
                          "threads": torch.get_num_threads(), "rev": rev(), **figures,
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
        return
    tower = random_tower(dtype)
    base = {"bench": "vision", "tower": "qwen3.5-0.8b-shape-random", "dtype": args.dtype,
            "threads": torch.get_num_threads(), "rev": rev()}
    for size in args.sizes.split(","):
        width, height = (int(v) for v in size.split("x"))
        picture = image(width, height)
        patches, (_, gh, gw) = pixel_patches(picture, PREPROCESS)
        with torch.inference_mode():
            tower(patches, [(gh, gw)])  # warm
        pre = timed_ms(lambda: pixel_patches(picture, PREPROCESS), args.reps)
        enc, sliced = paired_ms([lambda: tower(patches, [(gh, gw)]),
                                 lambda: encode_in_slices(tower, patches, (gh, gw), args.slices)], args.reps)
        print(json.dumps({**base, "image": size, "resized": f"{picture.resized_width}x{picture.resized_height}",
                          "patches": gh * gw, "tokens": picture.num_tokens, "preprocess_ms": pre, "tower_ms": enc,
                          "slices": args.slices, "sliced_tower_ms": sliced,
                          "sliced_over_one_shot": round(sliced / enc, 3),
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    if args.ttft:
        width, height = (int(v) for v in args.ttft.split("x"))
        picture = image(width, height, offset=args.text_tokens)
        ms = ttft_ms(tower, picture, dtype, args.text_tokens)
        print(json.dumps({**base, "model": "qwen3.5-0.8b-random", "ttft_image": args.ttft,
                          "prompt_tokens": args.text_tokens + picture.num_tokens, "ttft_ms": ms,
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
