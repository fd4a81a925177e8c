"""M-RoPE positions (temporal, height, width) of a prompt with images, as transformers' get_rope_index lays them
out for Qwen3.5 and Qwen3-VL: text counts up in all three streams; an image's tokens share its start in time and
count rows and columns of its merged grid from there; text after an image resumes past the larger side.

Pure arithmetic over a token range, so a chunk, a decode step or a resumed request computes its own slice alone.
"""
from __future__ import annotations

import torch

from rawserve.engine.mm_inputs import ImageInput


def merged_grid(image: ImageInput, patch_size: int, merge_size: int) -> tuple[int, int]:
    """(rows, columns) of the image's tokens: its patch grid merged merge_size x merge_size."""
    unit = patch_size * merge_size
    return image.resized_height // unit, image.resized_width // unit


def mrope_positions(images: tuple[ImageInput, ...], start: int, end: int, patch_size: int,
                    merge_size: int) -> torch.Tensor:
    """int64 [3, end - start] positions of tokens start..end-1 (prompt or output) of a sequence whose prompt holds
    `images` (in prompt order)."""
    positions = torch.arange(start, end, dtype=torch.int64).expand(3, -1).clone()
    shift = 0  # how far positions run ahead of indices after the images seen so far (negative: behind)
    for image in images:
        rows, cols = merged_grid(image, patch_size, merge_size)
        first, last = image.offset, image.offset + image.num_tokens  # the image's tokens [first, last)
        base = first + shift
        lo, hi = max(first, start), min(last, end)
        if lo < hi:  # this range holds some of the image's tokens
            j = torch.arange(lo - first, hi - first, dtype=torch.int64)
            positions[0, lo - start:hi - start] = base
            positions[1, lo - start:hi - start] = base + j // cols
            positions[2, lo - start:hi - start] = base + j % cols
        shift += max(rows, cols) - image.num_tokens
        if last < end:  # tokens after this image move by its shift
            after = max(last, start) - start
            positions[:, after:] += max(rows, cols) - image.num_tokens
    return positions


def rope_delta(images: tuple[ImageInput, ...], patch_size: int, merge_size: int) -> int:
    """What every token after the last image adds to its index (transformers' mrope_position_deltas)."""
    total = 0
    for image in images:
        rows, cols = merged_grid(image, patch_size, merge_size)
        total += max(rows, cols) - image.num_tokens
    return total
