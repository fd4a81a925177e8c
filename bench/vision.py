"""Image input speed on a Qwen3.5-0.8B-shaped random vision tower (depth 12, hidden 768, patch 16, merge 2, out
1024): preprocessing ms (resize, normalise, patchify in torch) and tower ms per image size, and the time to first
token with one image (preprocess + tower + the prompt's prefill + the first logits) on the random 0.8B text stack.

python -m bench.vision [--sizes 448x448,1024x768,1920x1080] [--dtype float32] [--reps 3] [--ttft 448x448]
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
from rawserve.engine.models.decoder import cpu_prepack_supported
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="448x448,1024x768,1920x1080")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ttft", default="448x448", help="image size for the time to first token ('' to skip)")
    parser.add_argument("--text-tokens", type=int, default=32)
    args = parser.parse_args()
    keep_freed_heap()
    dtype = getattr(torch, args.dtype)
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
        enc = timed_ms(lambda: tower(patches, [(gh, gw)]), args.reps)
        print(json.dumps({**base, "image": size, "resized": f"{picture.resized_width}x{picture.resized_height}",
                          "patches": gh * gw, "tokens": picture.num_tokens, "preprocess_ms": pre, "tower_ms": enc,
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
