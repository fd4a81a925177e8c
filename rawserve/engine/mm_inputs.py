"""Images as they cross from the server process to the core: decoded pixels, their content hash, and where their
placeholder tokens sit in the prompt. Plain data and arithmetic, no torch: this module is part of the seam."""
from __future__ import annotations

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
