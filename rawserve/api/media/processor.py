"""A vision checkpoint's image-processor rules, as the server needs them to size an image's placeholder run:
patch and merge sizes, the pixel bounds of the resize (preprocessor_config.json), and the placeholder token id
(config.json). Reads JSON only; the core does the pixel work in torch."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from rawserve.engine.mm_inputs import image_token_count, smart_resize

# Qwen2-VL's image processor's own defaults, which a preprocessor_config.json without them falls back to.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# The text the Qwen-VL family's templates render for each image: one token in their vocabularies.
IMAGE_PLACEHOLDER = "<|image_pad|>"


class ProcessorConfigError(ValueError):
    """The checkpoint's vision files are unreadable or inconsistent: the server does not start."""


@dataclass(frozen=True, slots=True)
class ImageProcessorRules:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int | None  # None: found in the tokenizer instead (ServingContext resolves it)

    @property
    def factor(self) -> int:
        """Each resized side is a multiple of this: a merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """-> (resized_height, resized_width, placeholder tokens) for a height x width image; ImageTooOdd (a
        ValueError) for one the processor refuses."""
        resized_height, resized_width = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return resized_height, resized_width, image_token_count(resized_height, resized_width, self.patch_size,
                                                                self.merge_size)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, pixel_bounds: Mapping[str, int] | None = None
                 ) -> ImageProcessorRules | None:
        """The rules of a checkpoint with a vision tower (config.json has a vision_config); None for a text-only
        one. preprocessor_config.json wins where it speaks; min_pixels/max_pixels there override size's
        shortest_edge/longest_edge, as transformers' processor does. `pixel_bounds` (--mm-processor-kwargs,
        EngineConfig.mm_pixel_bounds) override both, as kwargs to transformers' processor do."""
        config = _read_json(os.path.join(model_dir, "config.json")) or {}
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            if pixel_bounds:
                raise ProcessorConfigError(f"--mm-processor-kwargs: {model_dir} has no vision tower, so no image "
                                           "processor to override")
            return None
        pre = _read_json(os.path.join(model_dir, "preprocessor_config.json")) or {}
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        min_pixels = pre.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
        max_pixels = pre.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS))
        pixel_bounds = pixel_bounds or {}
        min_pixels = pixel_bounds.get("min_pixels", min_pixels)
        max_pixels = pixel_bounds.get("max_pixels", max_pixels)
        rules = cls(patch_size=pre.get("patch_size", vision.get("patch_size", 14)),
                    merge_size=pre.get("merge_size", vision.get("spatial_merge_size", 2)),
                    temporal_patch_size=pre.get("temporal_patch_size", vision.get("temporal_patch_size", 2)),
                    min_pixels=min_pixels, max_pixels=max_pixels,
                    image_token_id=config.get("image_token_id"))
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels"):
            value = getattr(rules, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProcessorConfigError(f"{model_dir}: the image processor's {name} must be a positive integer, "
                                           f"got {value!r}")
        if rules.min_pixels > rules.max_pixels:
            by = " (with --mm-processor-kwargs)" if pixel_bounds else ""
            raise ProcessorConfigError(f"{model_dir}: the image processor's min_pixels {rules.min_pixels} exceeds "
                                       f"max_pixels {rules.max_pixels}{by}")
        if rules.image_token_id is not None and (not isinstance(rules.image_token_id, int)
                                                 or isinstance(rules.image_token_id, bool)):
            raise ProcessorConfigError(f"{model_dir}: config.json's image_token_id must be an integer")
        return rules


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise ProcessorConfigError(f"cannot read {path}: {error}") from None
    return data if isinstance(data, dict) else None
