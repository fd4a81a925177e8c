"""RGB bytes -> the vision tower's flattened pixel patches, as the checkpoint's HF image processor makes them
(Qwen2-VL's: resize to the given size, bicubic with antialias, rescale, normalise, duplicate in time, patchify).

Torch only; the size is the server's decision (ImageInput.resized_*), so nothing here chooses one.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rawserve.engine.mm_inputs import ImageInput, max_resized_pixels

# OpenAI CLIP's, what transformers' Qwen2-VL processor uses when preprocessor_config.json names none.
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen2-VL's image processor's pixel bounds when preprocessor_config.json names none (as api/media/processor.py)
_MIN_PIXELS, _MAX_PIXELS = 56 * 56, 28 * 28 * 1280


@dataclass(frozen=True, slots=True)
class PreprocessConfig:
    """preprocessor_config.json's fields that shape the pixels. The server picks each image's size within
    min/max pixels; the core reads them only to bound what one image may cost it (max_patches)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    min_pixels: int = _MIN_PIXELS
    max_pixels: int = _MAX_PIXELS

    @property
    def max_patches(self) -> int:
        """Patches of the largest image the processor's resize can give (the vision tower's worst forward)."""
        factor = self.patch_size * self.merge_size
        return max_resized_pixels(factor, self.min_pixels, self.max_pixels) // self.patch_size ** 2

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x time x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def read(cls, model_dir: str | pathlib.Path, defaults: PreprocessConfig | None = None,
             pixel_bounds: Mapping[str, int] | None = None) -> PreprocessConfig:
        """From the checkpoint's preprocessor_config.json (ValueError naming the field when one is unusable); the
        fields it lacks, or all of them without the file, from `defaults` (the vision tower's sizes).
        `pixel_bounds` (--mm-processor-kwargs: min_pixels, max_pixels) override the file's, as the server's
        ImageProcessorRules take them, so the core's bound on one image is the size the server gives it."""
        path = pathlib.Path(model_dir) / "preprocessor_config.json"
        defaults = defaults or cls()
        if not path.is_file():
            config = defaults
        else:
            config = cls._from_file(path, defaults)
        if pixel_bounds:
            config = dataclasses.replace(config, **{k: pixel_bounds[k] for k in ("min_pixels", "max_pixels")
                                                    if k in pixel_bounds})
            if config.min_pixels > config.max_pixels:
                raise ValueError(f"--mm-processor-kwargs: min_pixels {config.min_pixels} exceeds max_pixels "
                                 f"{config.max_pixels} (one of them the checkpoint's)")
        return config

    @classmethod
    def _from_file(cls, path: pathlib.Path, defaults: PreprocessConfig) -> PreprocessConfig:
        raw = json.loads(path.read_text(encoding="utf-8"))
        fields = {}
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            value = raw.get(name, getattr(defaults, name))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
            fields[name] = value
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        for name, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            value = raw.get(name, size.get(edge, getattr(defaults, name)))  # min/max_pixels win, as in transformers
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
            fields[name] = value
        fields["rescale_factor"] = float(raw.get("rescale_factor", defaults.rescale_factor)) \
            if raw.get("do_rescale", True) else 1.0
        normalize = raw.get("do_normalize", True)
        for name in ("image_mean", "image_std"):
            value = raw.get(name, getattr(defaults, name))
            if isinstance(value, (int, float)):
                value = [value] * 3
            if not isinstance(value, list) or len(value) != 3:
                raise ValueError(f"{path}: field {name!r} must be three numbers, got {value!r}")
            fields[name] = tuple(float(v) for v in value)
        if not normalize:
            fields["image_mean"], fields["image_std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        return cls(**fields)


def resize_rgb(image: ImageInput) -> torch.Tensor:
    """The decoded image at its resized size -> uint8 [3, H, W] on the CPU.

    uint8 in, uint8 out, as PIL resizes: torch's antialiased bicubic on uint8 uses PIL's kernel (a = -0.5) and
    rounds as PIL does (measured: at most 1-2 levels apart, on 0.01% of values); a float resize rounded after
    differs by one level on about 15% of them."""
    pixels = torch.frombuffer(bytearray(image.rgb), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1).unsqueeze(0)  # [1, 3, h, w]
    size = (image.resized_height, image.resized_width)
    if size == (image.height, image.width):
        return pixels[0]
    return F.interpolate(pixels, size=size, mode="bicubic", antialias=True)[0]


def pixel_patches(image: ImageInput, cfg: PreprocessConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (float32 patches [grid_h * grid_w, patch_dim] on the CPU, its grid (t, h, w) in patches).

    Rows run over merge blocks (block row, block column, row within, column within): the merger's 2 x 2
    neighbours are consecutive rows. Columns run (channel, time, y, x), the single frame repeated in time."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width = image.resized_height, image.resized_width
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image resized to {width}x{height}: both sides must be multiples of {p * m}")
    gh, gw = height // p, width // p
    # Written straight into the patches, normalised there in place: the float32 pixels exist once (in the first
    # frame), not as an image and its temporaries beside the patches (budget.tower_step_bytes counts this)
    patches = torch.empty(gh // m, gw // m, m, m, 3, t, p, p)
    frame = patches[:, :, :, :, :, 0]  # [bh, bw, m, m, 3, p, p]
    frame.copy_(resize_rgb(image).view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6))
    frame.mul_(cfg.rescale_factor).sub_(torch.tensor(cfg.image_mean).view(3, 1, 1)).div_(
        torch.tensor(cfg.image_std).view(3, 1, 1))
    for i in range(1, t):  # the frame repeated in time
        patches[:, :, :, :, :, i] = frame
    return patches.view(gh * gw, 3 * t * p * p), (1, gh, gw)
