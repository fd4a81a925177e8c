"""The vision tower's working memory, measured against the memory plan's estimate (multimodal/budget.py's
tower_step_bytes): peak RSS rise of preprocessing one image and encoding it as the engine does (EncodeJob advanced a
step's budget at a time), Qwen3.5-0.8B's tower shape (hidden 768, intermediate 4304, 16 heads) cut to --depth
blocks (every block makes the same transients), each case in a fresh process so no kept heap hides a peak.

python -m bench.vision_memory [--sizes 1024x1024,2048x2048,128x16384] [--dtypes float32,bfloat16] [--depth 2]
  [--step-flops 2.25e12]
--step-flops: a step's budget in FLOPs (2,048 prompt tokens of the 0.8B text model: about 2.25e12); 0 runs each
pass whole in one call (still SLICE_ROWS rows a slice). Prints one JSON line a case: patches, the peak after
preprocessing, after the job is made, at the end, the estimate, and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import torch

from rawserve.engine import memory
from rawserve.engine.loader import VisionConfig
from rawserve.engine.mm_inputs import ImageInput, image_token_count, smart_resize
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.models.vision import VisionTower
from rawserve.engine.multimodal.budget import tower_step_bytes
from rawserve.engine.multimodal.encode_job import EncodeJob
from rawserve.engine.multimodal.preprocess import PreprocessConfig, pixel_patches
from rawserve.process_stats import keep_freed_heap, release_free_heap

TOWER_0_8B = VisionConfig(depth=12, hidden_size=768, intermediate_size=4304, num_heads=16, patch_size=16,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=1024,
                          num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                          image_token_id=248056)


def measure(width: int, height: int, dtype: torch.dtype, depth: int, step_flops: float) -> dict:
    """One case, in this process: it must be a fresh one (the kept heap of an earlier case would hide the peak)."""
    keep_freed_heap()
    cfg = dataclasses.replace(TOWER_0_8B, depth=depth)
    tower = VisionTower(cfg, dtype, torch.device("cpu"))
    with torch.no_grad():
        for param in tower.parameters():
            param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    if cpu_prepack_supported(dtype):
        tower.prepack()
    tower.eval()
    # the largest image is this one: the plan's estimate is for max_patches
    pre = PreprocessConfig(image_mean=(0.5,) * 3, image_std=(0.5,) * 3, min_pixels=4096, max_pixels=width * height)
    rgb = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8).numpy().tobytes()
    rh, rw = smart_resize(height, width, 32, pre.min_pixels, pre.max_pixels)
    picture = ImageInput(hashlib.sha256(rgb).digest(), width, height, rgb, rh, rw, 0, image_token_count(rh, rw, 16, 2))
    warm = ImageInput(b"w" * 32, 64, 64, bytes(64 * 64 * 3), 64, 64, 0, 4)
    patches, (_, gh, gw) = pixel_patches(warm, pre)
    job = EncodeJob(tower, patches, (gh, gw))
    job.advance(job.remaining_flops)  # kernels and thread pools outside the measure
    del patches, job
    release_free_heap()
    if not memory.reset_peak_rss():
        raise SystemExit("no /proc/self/clear_refs: the peak cannot be measured here")
    before = memory.rss_bytes()
    started = time.perf_counter()
    patches, (_, gh, gw) = pixel_patches(picture, pre)
    preprocessed = memory.rss_bytes("VmHWM") - before
    job = EncodeJob(tower, patches, (gh, gw))
    del patches
    made = memory.rss_bytes("VmHWM") - before
    while not job.advance(step_flops or job.remaining_flops):
        pass
    peak = memory.rss_bytes("VmHWM") - before
    estimate = tower_step_bytes(cfg, pre, dtype)
    return {"size": f"{width}x{height}", "dtype": str(dtype).removeprefix("torch."), "patches": gh * gw,
            "grid": [gh, gw], "preprocessed_mib": preprocessed >> 20, "job_made_mib": made >> 20,
            "peak_mib": peak >> 20, "estimate_mib": estimate >> 20, "estimate_over_peak": round(estimate / peak, 2),
            "seconds": round(time.perf_counter() - started, 1), "load_avg": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024x1024,2048x2048,128x16384")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--step-flops", type=float, default=2.25e12)
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # WIDTHxHEIGHT:dtype, run in this process
    args = parser.parse_args()
    if args.one:
        size, dtype = args.one.split(":")
        width, height = map(int, size.split("x"))
        print(json.dumps(measure(width, height, getattr(torch, dtype), args.depth, args.step_flops)), flush=True)
        return
    for dtype in args.dtypes.split(","):
        for size in args.sizes.split(","):
            subprocess.run([sys.executable, "-m", "bench.vision_memory", "--one", f"{size}:{dtype}",
                            "--depth", str(args.depth), "--step-flops", str(args.step_flops)], check=True)


if __name__ == "__main__":
    main()
