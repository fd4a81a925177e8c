"""A request's image parts -> the ImageInputs the core takes: the server's limits (images per prompt, pixels per
image and per request), the bytes from their sources, Pillow's decode in a worker thread (a few at a time, so
a burst of images neither stalls the event loop nor piles decoded pixels up), the processor's resize grid."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass

from rawserve.api.media.decode import DecodedImage, decode, require_pillow
from rawserve.api.media.processor import IMAGE_PLACEHOLDER, ImageProcessorRules, ProcessorConfigError
from rawserve.api.media.sources import SourcePolicy, image_bytes
from rawserve.config import ServerConfig
from rawserve.engine.mm_inputs import ImageInput, ImageTooOdd
from rawserve.errors import APIError

# Decodes running at once, server-wide: each holds an image's encoded and decoded bytes.
DECODE_SLOTS = 2
# Image fetches in flight at once, server-wide: each may buffer up to --max-image-bytes.
FETCH_SLOTS = 16


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image a client sent: its URL and the part's path in the request (messages.1.content.2)."""
    url: str
    param: str


@dataclass(frozen=True, slots=True)
class MediaLimits:
    max_images: int  # per prompt (--limit-mm-per-prompt image=N)
    max_image_pixels: int  # decoded, per image
    max_request_pixels: int  # decoded, all of a request's images together
    sources: SourcePolicy

    @classmethod
    def from_config(cls, config: ServerConfig) -> MediaLimits:
        return cls(max_images=config.mm_limits().get("image", 0), max_image_pixels=config.max_image_pixels,
                   max_request_pixels=config.max_request_image_pixels,
                   sources=SourcePolicy(max_bytes=config.max_image_bytes, fetch_timeout_s=config.media_fetch_timeout_s,
                                        allowed_domains=tuple(d.lower() for d in config.allowed_media_domains),
                                        allowed_local_path=config.allowed_local_media_path))


class ImageReader:
    """The server's one reader of images. `rules` None: the model takes no images, and a request with one gets
    a 400 naming its first image part."""

    def __init__(self, rules: ImageProcessorRules | None, image_token_id: int | None, limits: MediaLimits,
                 model_name: str = "the model") -> None:
        self.rules = rules
        self.image_token_id = image_token_id
        self.limits = limits
        self.model_name = model_name
        self._slots = asyncio.Semaphore(DECODE_SLOTS)
        self._fetches = asyncio.Semaphore(FETCH_SLOTS)

    @classmethod
    def for_checkpoint(cls, model_dir: str | os.PathLike, token_to_id, limits: MediaLimits,
                       model_name: str = "the model", pixel_bounds: Mapping[str, int] | None = None) -> ImageReader:
        """The reader for a checkpoint: its processor rules (pixel bounds overridden by --mm-processor-kwargs),
        and its placeholder id from config.json (else the tokenizer's `<|image_pad|>`). ProcessorConfigError when
        a vision checkpoint has no placeholder token."""
        rules = ImageProcessorRules.from_dir(model_dir, pixel_bounds)
        token_id = None
        if rules is not None:
            token_id = rules.image_token_id if rules.image_token_id is not None else token_to_id(IMAGE_PLACEHOLDER)
            if token_id is None:
                raise ProcessorConfigError(f"{model_dir}: a vision checkpoint, but neither config.json's "
                                           f"image_token_id nor a {IMAGE_PLACEHOLDER} token in its tokenizer")
        return cls(rules, token_id, limits, model_name)

    def check(self, parts: list[ImagePart]) -> None:
        """What can be refused before any byte is fetched: a text-only model, too many images, no Pillow."""
        if not parts:
            return
        if self.rules is None:
            raise APIError(400, f"{self.model_name} takes no images: its checkpoint has no vision tower. Send "
                                "text only, or serve a vision model.", param=parts[0].param, code="images_unsupported")
        if len(parts) > self.limits.max_images:
            raise APIError(400, f"This request has {len(parts)} images; the server takes at most "
                                f"{self.limits.max_images} per prompt (--limit-mm-per-prompt).",
                           param=parts[self.limits.max_images].param, code="too_many_images")
        require_pillow(parts[0].param)

    async def read(self, parts: list[ImagePart]) -> tuple[ImageInput, ...]:
        """Every part's image, in order, offsets 0 (expand_placeholders places them). The first refusal is
        raised and the other fetches are cancelled."""
        self.check(parts)
        if not parts:
            return ()
        sources = [asyncio.ensure_future(self._bytes(part)) for part in parts]
        try:
            await asyncio.wait(sources, return_when=asyncio.FIRST_EXCEPTION)
            for task in sources:  # in request order: the first bad part is the one named
                if task.done() and task.exception() is not None:
                    raise task.exception()
            encoded = [task.result() for task in sources]
        finally:
            for task in sources:
                task.cancel()
        del sources
        images = []
        budget = self.limits.max_request_pixels
        for k, part in enumerate(parts):
            data, encoded[k] = encoded[k], b""  # each encoded image is freed once it is decoded
            image = await self._decode(data, part.param, budget)
            budget -= image.width * image.height
            images.append(self._sized(image, part.param))
            del image
        return tuple(images)

    async def _bytes(self, part: ImagePart) -> bytes:
        async with self._fetches:
            return await image_bytes(part.url, part.param, self.limits.sources)

    async def _decode(self, data: bytes, param: str, budget: int) -> DecodedImage:
        async with self._slots:
            try:
                return await asyncio.to_thread(decode, data, param, min(self.limits.max_image_pixels, budget))
            except APIError as error:
                if error.code == "image_too_large" and budget < self.limits.max_image_pixels:
                    error.message += (f" This request's images may hold {self.limits.max_request_pixels} pixels "
                                      "together; this one is past what the images before it left.")
                raise

    def _sized(self, image: DecodedImage, param: str) -> ImageInput:
        assert self.rules is not None
        try:
            height, width, num_tokens = self.rules.grid(image.height, image.width)
        except ImageTooOdd as error:
            raise APIError(400, f"The image cannot be processed: {error}.", param=param, code="invalid_image") from None
        return ImageInput(content_hash=image.content_hash, width=image.width, height=image.height, rgb=image.rgb,
                          resized_height=height, resized_width=width, offset=0, num_tokens=num_tokens)
