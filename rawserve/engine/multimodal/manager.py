"""MultiModalManager: what a step of a vision-language model needs beyond token ids. It owns the vision tower,
the encoder cache and the encode queue (images encoded a slice per step, before any of their tokens run), checks a
request's images against its prompt, and lays out the step's M-RoPE positions and the embedding rows that replace
the placeholders. ModelRunner holds one and asks it once per step; who runs is the scheduler's decision.
"""
from __future__ import annotations

import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rawserve.engine.loader import ModelConfig
from rawserve.engine.mm_inputs import ImageInput, MultiModalInputs
from rawserve.engine.models.vision import VisionTower, load_vision_tower
from rawserve.engine.multimodal.budget import text_flops_per_token
from rawserve.engine.multimodal.encode_queue import EncodeQueue
from rawserve.engine.multimodal.encoder_cache import EncoderCache
from rawserve.engine.multimodal.positions import merged_grid, mrope_positions
from rawserve.engine.multimodal.prefix_keys import image_key
from rawserve.engine.multimodal.preprocess import PreprocessConfig
from rawserve.engine.step_plan import StepInput


@dataclass(slots=True)
class StepEmbeds:
    """A step's image rows: positions [3, T] for the whole batch, the flattened rows [R] that images fill, their
    embeddings [R, hidden] and DeepStack features (one [R, hidden] per fed layer; empty for Qwen3.5). rows and
    embeds are None in a step that reaches no placeholder (decodes after an image)."""

    positions: torch.Tensor
    rows: torch.Tensor | None
    embeds: torch.Tensor | None
    deepstack: list[torch.Tensor]


class MultiModalManager:
    def __init__(self, tower: VisionTower, preprocess: PreprocessConfig, image_token_id: int,
                 cache_bytes: int, text_flops_per_token: float) -> None:
        """cache_bytes: the encoder cache's bound (--encoder-cache-mb); 0 keeps nothing. text_flops_per_token: a
        prompt token's cost in the text model, the rate at which the step budget buys encoder work."""
        self.tower = tower
        self.preprocess = preprocess
        self.image_token_id = image_token_id
        self.cache = EncoderCache(cache_bytes)
        # the scheduler's hook (Scheduler.encoder): which chunks may run, the budget encoding takes, drops
        self.encodes = EncodeQueue(tower, preprocess, self.cache, text_flops_per_token)
        self.device = tower.patch_weight.device

    @classmethod
    def load(cls, model_dir: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             cache_bytes: int, pixel_bounds: Mapping[str, int] | None = None) -> MultiModalManager:
        """pixel_bounds: --mm-processor-kwargs's min/max pixels, over preprocessor_config.json's."""
        vision = cfg.vision
        preprocess = PreprocessConfig.read(model_dir, PreprocessConfig(
            patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size), pixel_bounds)
        if (preprocess.patch_size, preprocess.merge_size, preprocess.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ValueError(f"{model_dir}: preprocessor_config.json's patch/merge/temporal sizes "
                             f"{preprocess.patch_size}/{preprocess.merge_size}/{preprocess.temporal_patch_size} differ "
                             f"from the vision tower's {vision.patch_size}/{vision.spatial_merge_size}/"
                             f"{vision.temporal_patch_size}")
        tower = load_vision_tower(model_dir, cfg, dtype, device)
        return cls(tower, preprocess, vision.image_token_id, cache_bytes, text_flops_per_token(model_dir))

    @property
    def has_deepstack(self) -> bool:
        return bool(self.tower.cfg.deepstack_indexes)

    def check(self, prompt_ids: list[int], features: object) -> None:
        """ValueError (the request fails alone) unless `features` are images that fit this prompt: each one's
        placeholder run in place and as long as its grid, nothing else spelling the placeholder."""
        if not isinstance(features, MultiModalInputs) or not features.images:
            raise ValueError(f"features: expected MultiModalInputs with images, got {type(features).__name__}")
        p, m = self.preprocess.patch_size, self.preprocess.merge_size
        end = 0
        for i, image in enumerate(features.images):
            if not isinstance(image, ImageInput):
                raise ValueError(f"features.images[{i}]: expected ImageInput, got {type(image).__name__}")
            if image.width < 1 or image.height < 1 or len(image.rgb) != image.width * image.height * 3:
                raise ValueError(f"features.images[{i}]: {len(image.rgb)} bytes is not "
                                 f"{image.width}x{image.height} RGB")
            if image.resized_height < p * m or image.resized_width < p * m or image.resized_height % (p * m) \
                    or image.resized_width % (p * m):
                raise ValueError(f"features.images[{i}]: resized {image.resized_width}x{image.resized_height} must be "
                                 f"positive multiples of {p * m}")
            if image.resized_height * image.resized_width > self.preprocess.max_patches * p * p:
                raise ValueError(f"features.images[{i}]: resized {image.resized_width}x{image.resized_height} is "
                                 f"larger than the image processor gives (max_pixels {self.preprocess.max_pixels})")
            rows, cols = merged_grid(image, p, m)
            if image.num_tokens != rows * cols:
                raise ValueError(f"features.images[{i}]: {image.num_tokens} tokens for a {cols}x{rows} merged grid")
            if image.offset < end or image.offset + image.num_tokens > len(prompt_ids):
                raise ValueError(f"features.images[{i}]: its tokens at {image.offset} overlap another image's or "
                                 "run past the prompt")
            if any(t != self.image_token_id for t in prompt_ids[image.offset:image.offset + image.num_tokens]):
                raise ValueError(f"features.images[{i}]: the prompt does not hold its {image.num_tokens} placeholder "
                                 f"tokens ({self.image_token_id}) at {image.offset}")
            end = image.offset + image.num_tokens
        if sum(1 for t in prompt_ids if t == self.image_token_id) != features.num_image_tokens:
            raise ValueError("the prompt holds image placeholder tokens that no image fills")

    def step(self, seqs: list[StepInput]) -> StepEmbeds | None:
        """The step's image rows and positions; None for a step without images. Every image a chunk reaches is
        encoded already (the scheduler runs no chunk past an image the encode queue has not finished)."""
        if all(seq.features is None for seq in seqs):
            return None
        p, m = self.preprocess.patch_size, self.preprocess.merge_size
        positions = []
        wanted: list[tuple[int, ImageInput, int, int]] = []  # (flattened row, image, first, last token of it)
        offset = 0
        for seq in seqs:
            n, start = len(seq.token_ids), seq.num_computed_tokens
            if seq.features is None:
                positions.append(torch.arange(start, start + n, dtype=torch.int64).expand(3, -1))
            else:
                images = seq.features.images
                positions.append(mrope_positions(images, start, start + n, p, m))
                for image in images:
                    lo, hi = max(image.offset, start), min(image.offset + image.num_tokens, start + n)
                    if lo < hi:
                        wanted.append((offset + lo - start, image, lo - image.offset, hi - image.offset))
            offset += n
        rows, embeds = [], []
        deepstack: list[list[torch.Tensor]] = [[] for _ in self.tower.cfg.deepstack_indexes]
        for row, image, first, last in wanted:
            entry = self.encodes.entry(image_key(image))
            rows.append(torch.arange(row, row + last - first, dtype=torch.int64))
            embeds.append(entry.embeds[first:last])
            for layer, features in enumerate(entry.deepstack):
                deepstack[layer].append(features[first:last])
        dev = self.device
        if not rows:
            return StepEmbeds(torch.cat(positions, dim=1).to(dev), None, None, [])
        return StepEmbeds(torch.cat(positions, dim=1).to(dev), torch.cat(rows).to(dev), torch.cat(embeds),
                          [torch.cat(parts) for parts in deepstack])

    def stats(self) -> dict[str, float]:
        """EngineStats.extra's multimodal counters (the /metrics encoder time and cache hits)."""
        encodes = self.encodes
        return {"mm_images_encoded": encodes.num_images_encoded, "mm_encoder_seconds": encodes.encoder_seconds,
                "mm_preprocess_seconds": encodes.preprocess_seconds, "mm_encoder_cache_hits": encodes.hits,
                "mm_encoder_cache_misses": encodes.misses, "mm_encoder_cache_bytes": self.cache.num_bytes}
