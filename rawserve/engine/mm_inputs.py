"""Images as they cross from the server process to the core: decoded pixels, their content hash, and where their
placeholder tokens sit in the prompt. Plain data and arithmetic, no torch: this module is part of the seam."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One decoded image of one request. The server decodes (Pillow) and decides the resized grid, so it knows
    how many placeholder tokens to put in the prompt; the core resizes, normalises and patchifies in torch."""

    content_hash: bytes  # sha256 over (width, height, rgb): the encoder cache's key, mixed into prefix-cache keys
    width: int  # as decoded, before the processor's resize
    height: int
    rgb: bytes  # height * width * 3 uint8, row-major RGB
    resized_height: int  # the processor's target size: multiples of patch_size * merge_size
    resized_width: int
    offset: int  # index in the prompt's token ids of the image's first placeholder token
    num_tokens: int  # placeholder tokens: (resized_height / patch) * (resized_width / patch) / merge**2


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    """What `AddRequest.features` carries for a request with images: the images in prompt order, their
    placeholder runs disjoint."""

    images: tuple[ImageInput, ...]

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)


class ImageTooOdd(ValueError):
    """An image the processor cannot resize: an aspect ratio past its limit, or an empty side."""


# The Qwen2-VL family's processors refuse an aspect ratio past this (their smart_resize raises).
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL / Qwen3-VL / Qwen3.5 processors' target size for a height x width image: each side a multiple
    of `factor` (patch_size * merge_size), the area within [min_pixels, max_pixels], the aspect ratio kept as
    nearly as the grid allows. -> (resized_height, resized_width).

    Python's round() (half to even) on purpose: the processors use it, and a .5 case rounded the other way
    would change the number of placeholder tokens."""
    if height < 1 or width < 1:
        raise ImageTooOdd(f"an image needs at least one pixel a side, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageTooOdd(f"the aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}")
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        resized_height = max(factor, math.floor(height / scale / factor) * factor)
        resized_width = max(factor, math.floor(width / scale / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * scale / factor) * factor
        resized_width = math.ceil(width * scale / factor) * factor
    return resized_height, resized_width


def max_resized_pixels(factor: int, min_pixels: int, max_pixels: int) -> int:
    """The largest area smart_resize can give: max_pixels, unless a side is held at one factor (a very wide image
    under a small max_pixels) or the round-up to min_pixels overshoots (min_pixels near max_pixels). The core
    bounds one vision-tower forward by it."""
    clamped = factor * max(factor, math.isqrt(MAX_ASPECT_RATIO * max_pixels) + 1)  # the short side held at factor
    # rounding both sides up from (a, b), a * b = min_pixels: < min_pixels + factor * (a + b) + factor ** 2, and
    # a + b is largest at the widest aspect ratio
    spread = math.isqrt(min_pixels * (MAX_ASPECT_RATIO + 1) ** 2 // MAX_ASPECT_RATIO) + 1
    return max(max_pixels, clamped, min_pixels + factor * spread + factor * factor)


def image_token_count(resized_height: int, resized_width: int, patch_size: int, merge_size: int) -> int:
    """Placeholder tokens of one image: its patches, merge_size x merge_size of them to a token."""
    return (resized_height // patch_size) * (resized_width // patch_size) // (merge_size * merge_size)


def expand_placeholders(token_ids: Sequence[int], image_token_id: int,
                        images: Sequence[ImageInput]) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A rendered prompt holds one `image_token_id` per image, in the images' order: each becomes the image's
    num_tokens copies, and each image gets its offset there. -> (expanded ids, images with offsets).

    ValueError when the prompt's placeholders and the images differ in number (a template that does not render
    images, or a prompt text that spells the placeholder itself)."""
    found = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(found) != len(images):
        raise ValueError(f"the prompt holds {len(found)} image placeholder(s) for {len(images)} image(s)")
    out: list[int] = []
    placed = []
    start = 0
    for at, image in zip(found, images):
        out.extend(token_ids[start:at])
        placed.append(dataclasses.replace(image, offset=len(out)))
        out.extend([image_token_id] * image.num_tokens)
        start = at + 1
    out.extend(token_ids[start:])
    return out, tuple(placed)
