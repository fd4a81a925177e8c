"""What a vision tower adds to the core's memory plan: its weights (model.visual.*, which the text loader sets
aside) and the working memory of its worst forward, the largest image the checkpoint's processor can give (the
manager refuses larger ones and never puts more patches than that in one forward). Headers and shapes only."""
from __future__ import annotations

import math
import pathlib
from collections.abc import Mapping

import torch

from rawserve.engine.loader import VisionConfig, read_safetensors_header, safetensors_files
from rawserve.engine.multimodal import encode_job
from rawserve.engine.multimodal.preprocess import PreprocessConfig

VISION_PREFIX = "model.visual."


def vision_weight_bytes(model_dir: str | pathlib.Path, dtype: torch.dtype) -> int:
    """Bytes the tower's weights take once loaded at `dtype` (load_vision_tower casts every one; a CPU's
    pre-packed matmul weights replace the plain ones, so they count once)."""
    size = torch.finfo(dtype).bits // 8
    return sum(entry.num_bytes // entry.dtype.itemsize * size for file in safetensors_files(model_dir)
               for entry in read_safetensors_header(file)
               if entry.name.startswith(VISION_PREFIX) and entry.dtype.is_floating_point)


def text_flops_per_token(model_dir: str | pathlib.Path) -> float:
    """A prompt token's matmul FLOPs in the text model, 2 per weight of its layers (the embedding, a lookup, and the
    head, which runs on sampled rows only, left out): the rate at which the scheduler's token budget buys vision
    encoder work (encode_job.encode_flops)."""
    left_out = (VISION_PREFIX, "mtp.", "model.mtp.", "lm_head.")
    return 2.0 * sum(entry.num_bytes // entry.dtype.itemsize for file in safetensors_files(model_dir)
                     for entry in read_safetensors_header(file)
                     if len(entry.shape) >= 2 and not entry.name.startswith(left_out)
                     and not entry.name.endswith("embed_tokens.weight"))


def tower_step_bytes(vision: VisionConfig, preprocess: PreprocessConfig, dtype: torch.dtype) -> int:
    """Working memory of encoding the largest image (preprocess.max_patches patches) as the engine does it
    (encode_job.EncodeJob: a pass a slice of SLICE_ROWS rows at most), per patch unless said:
    - held through the whole encoding: the block input x (hidden) and the rotary tables (cos, sin: 2 of head_dim,
      float32); per merged token (4 patches), the merger's output and each DeepStack merger's;
    - the larger of two phases' own:
      - preprocessing and the patch embedding: the resized uint8 pixels, the float32 patches (patch_dim: the frame
        twice in time, normalised in place), their cast to the model's dtype, the embedding before the position
        is added (hidden), the position tables (two float32 copies and their cast) and the rotary tables' float32
        temporaries (4 of head_dim). The decoded image's own copy (3 bytes a pixel before the resize) is bounded by
        the server's --max-image-pixels, which the core does not see;
      - the encoding's q, k, v (3 of hidden), kept between a block's two passes, and the contiguous copies of
        k and v attention may make (2);
    - one slice's rows (at most SLICE_ROWS): all of a block's allocations, as if none reused another's freed
      memory (the heap a CPU core keeps, process_stats.keep_freed_heap, does not reliably hand a freed piece to the
      next allocation within a block). Of hidden width: the normed inputs (2), qkv (3), the rotated q and k (2),
      the copies attention may make of q, k, v (3), its output and reshaped output (2), the projection, the MLP's
      output, the two residual sums (4); the rotation's float32 temporaries (4 each for q and k); fc1 before and
      after the activation (2 of intermediate);
    - once: the learned position grid resampled along the image's shorter axis first (at most sqrt(patches) rows
      x the grid's side x hidden, float32).
    Attention runs fused (torch's flash kernels; models/vision.py passes 4-D inputs for it), so nothing grows with
    patches squared. Measured (bench/vision_memory.py: peak RSS rise of preprocessing and the encoding at the
    engine's step budget, Qwen3.5-0.8B's tower cut to 2 blocks, CPU), peak / this: float32 473 / 515 MiB at
    1024x1024, 545 / 774 at 2048x2048, 467 / 602 at 128x16384; bfloat16 278 / 355, 338 / 627, 242 / 447."""
    n = preprocess.max_patches
    e = torch.finfo(dtype).bits // 8
    hidden, inter = vision.hidden_size, vision.intermediate_size
    head_dim = hidden // vision.num_heads
    patch_dim = preprocess.patch_dim
    held = hidden * e + 2 * head_dim * 4
    cast = e if e != 4 else 0  # a float32 model's casts of float32 tensors are the tensors themselves
    pixels = patch_dim // preprocess.temporal_patch_size  # uint8, 3 channels x patch_size ** 2
    embedding = pixels + patch_dim * (4 + cast) + hidden * e + hidden * (8 + cast) + 4 * head_dim * 4
    attention = 5 * hidden * e
    block = 16 * hidden * e + 8 * hidden * 4 + 2 * inter * e
    merged = (n // preprocess.merge_size ** 2) * vision.out_hidden_size * e * (1 + len(vision.deepstack_indexes))
    side = math.isqrt(vision.num_position_embeddings)
    resample = math.isqrt(n - 1) + 1 if n > 1 else 1
    rows = min(n, encode_job.SLICE_ROWS)
    return n * (held + max(embedding, attention)) + rows * block + merged + resample * side * hidden * 4


def image_rows_bytes(vision: VisionConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """The encoded rows a step holds while the text forward runs: `num_tokens` image tokens' embeddings and
    DeepStack features (the whole image's: a chunk takes its slice of the cached entry)."""
    return num_tokens * vision.out_hidden_size * (torch.finfo(dtype).bits // 8) * (1 + len(vision.deepstack_indexes))


def step_bytes_with_images(model_dir: str | pathlib.Path, vision: VisionConfig, dtype: torch.dtype, text_step: int,
                           num_batched_tokens: int, cache_bytes: int,
                           pixel_bounds: Mapping[str, int] | None = None) -> int:
    """A step's working memory for a vision checkpoint, from its text step's (estimated or measured): the encoder
    cache, full; the larger of the tower's worst forward and the text step; and the image rows either holds (the
    step's image tokens, and a worst image's fresh encoding, kept whole when the cache cannot take it).
    pixel_bounds: --mm-processor-kwargs's (EngineConfig.mm_pixel_bounds): a lower max_pixels, a smaller worst."""
    preprocess = PreprocessConfig.read(model_dir, pixel_bounds=pixel_bounds)
    worst_tokens = preprocess.max_patches // preprocess.merge_size ** 2
    rows = image_rows_bytes(vision, num_batched_tokens + worst_tokens, dtype)
    return cache_bytes + max(tower_step_bytes(vision, preprocess, dtype), text_step) + rows
