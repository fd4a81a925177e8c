"""The server side of an image: read (base64 or a loopback http fetch), decode with Pillow and size, per image
size and format, and how long the event loop stalls meanwhile (the worst gap of a 1 ms ticker: decoding runs
in worker threads, so it should stay near the ticker's own period).

python -m bench.media [--sizes 448x448,1024x768,1920x1080] [--reps 5]
Prints one JSON object per line with the 1-minute load average (the box is shared). Needs Pillow (the vision
extra). The processor rules are the published Qwen3.5 / Qwen3-VL ones (patch 16, merge 2, 65,536 to 16,777,216
pixels)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import statistics
import time

from PIL import Image

from rawserve.api.media import ImagePart, ImageProcessorRules, ImageReader, MediaLimits, SourcePolicy
from tests.api.test_media import serve_images

RULES = ImageProcessorRules(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=65536,
                            max_pixels=16777216, image_token_id=248056)


def photo_like(width: int, height: int) -> Image.Image:
    """Smooth gradients plus noise: compresses like a photo, not like a flat test card."""
    rng = random.Random(width * height)
    base = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    noise = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    return Image.blend(base, noise, 0.25)


async def read_ms(reader: ImageReader, url: str, reps: int) -> tuple[float, float]:
    """-> (median ms of one read, the worst event-loop gap in ms seen while reading)."""
    worst_gap = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal worst_gap
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst_gap = max(worst_gap, now - last)
            last = now

    tick = asyncio.create_task(ticker())
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        await reader.read([ImagePart(url, "bench")])
        times.append(time.perf_counter() - started)
    stop = True
    await tick
    return statistics.median(times) * 1000, worst_gap * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="448x448,1024x768,1920x1080")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    limits = MediaLimits(max_images=8, max_image_pixels=1 << 26, max_request_pixels=1 << 27,
                         sources=SourcePolicy(max_bytes=64 << 20, fetch_timeout_s=30.0))
    reader = ImageReader(RULES, 248056, limits)
    for size in args.sizes.split(","):
        width, height = map(int, size.split("x"))
        image = photo_like(width, height)
        for fmt in ("PNG", "JPEG"):
            out = io.BytesIO()
            image.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            data = out.getvalue()
            media_type = f"image/{fmt.lower()}"
            routes = {"/image": (200, {"Content-Type": media_type}, data)}
            with serve_images(routes) as base:
                for source, url in (("data", f"data:{media_type};base64," + base64.b64encode(data).decode()),
                                    ("http", base + "/image")):
                    ms, gap = asyncio.run(read_ms(reader, url, args.reps))
                    print(json.dumps({"bench": "media_read", "size": size, "format": fmt, "source": source,
                                      "encoded_bytes": len(data), "tokens": RULES.grid(height, width)[2],
                                      "read_ms": round(ms, 2), "worst_loop_gap_ms": round(gap, 2),
                                      "load_1m": os.getloadavg()[0]}), flush=True)


if __name__ == "__main__":
    main()
