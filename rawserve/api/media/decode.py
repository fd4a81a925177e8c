"""Encoded image bytes -> RGB pixels with Pillow (the optional `vision` extra, imported at the first image):
PNG, JPEG, WebP and GIF (the first frame), transparency composited onto white as transformers' processors do.
The size is checked from the header, before a pixel is decoded. Blocking: callers run it in a thread."""
from __future__ import annotations

import functools
import hashlib
import io
import struct
from dataclasses import dataclass

from rawserve.errors import APIError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
EXTRA_HINT = 'pip install "rawserve[vision]"'


@dataclass(frozen=True, slots=True)
class DecodedImage:
    width: int
    height: int
    rgb: bytes  # height * width * 3, row-major
    content_hash: bytes


@functools.cache
def pillow():
    """The PIL.Image module, or an APIError 400 naming the extra. Pillow's own decompression-bomb guard stays
    on (Image.MAX_IMAGE_PIXELS); the server's cap (max_pixels, below it by default) refuses first."""
    try:
        from PIL import Image
    except ImportError:
        raise APIError(400, f"This server cannot decode images: Pillow is not installed ({EXTRA_HINT}).",
                       code="images_unsupported") from None
    return Image


def require_pillow(param: str) -> None:
    """Fail fast (before a fetch) when images cannot be decoded."""
    try:
        pillow()
    except APIError as error:
        error.param = param
        raise


def decode(data: bytes, param: str, max_pixels: int) -> DecodedImage:
    """The first frame of `data` as RGB; a 400 naming `param` for anything Pillow cannot or may not decode."""
    image_module = pillow()
    try:
        # Image.open reads the header only: the size is known, and refused, before any pixel is decoded.
        with image_module.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size
            if width < 1 or height < 1:
                raise APIError(400, f"The image is {width}x{height} pixels: empty.", param=param,
                               code="invalid_image")
            if width * height > max_pixels:
                raise APIError(400, f"The image is {width}x{height} = {width * height} pixels; the most this "
                                    f"server decodes is {max_pixels}.", param=param, code="image_too_large")
            rgb = _to_rgb(image_module, image).tobytes()
    except APIError:
        raise
    except image_module.DecompressionBombError as error:
        raise APIError(400, f"The image is too large to decode: {error}", param=param,
                       code="image_too_large") from None
    except image_module.UnidentifiedImageError:
        raise APIError(400, f"The image data is not a supported image ({', '.join(FORMATS)}) or is corrupt.",
                       param=param, code="invalid_image_format") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
        # Pillow's decoders report truncated or corrupt data as any of these.
        raise APIError(400, f"The image data is corrupt: {error}.", param=param, code="invalid_image") from None
    return _decoded(width, height, rgb)


def from_pil(image) -> DecodedImage:
    """An image already decoded by the caller (a PIL.Image, as the offline LLM's multi_modal_data takes it) as
    RGB, converted as `decode` converts; ValueError for anything else."""
    image_module = pillow()
    if not isinstance(image, image_module.Image):
        raise ValueError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"the image is {width}x{height} pixels: empty")
    return _decoded(width, height, _to_rgb(image_module, image).tobytes())


def _decoded(width: int, height: int, rgb: bytes) -> DecodedImage:
    digest = hashlib.sha256(struct.pack("<II", width, height))
    digest.update(rgb)
    return DecodedImage(width, height, rgb, digest.digest())


def _to_rgb(image_module, image):
    """As transformers' convert_to_rgb: an image with transparency (an alpha band, or a palette's transparent
    colour) is laid onto white; any other mode is converted directly."""
    image.seek(0)  # a GIF's (or an animated WebP's) first frame
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = image_module.new("RGBA", rgba.size, (255, 255, 255, 255))
        return image_module.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
