"""Image preprocessing in torch equals transformers' Qwen2-VL image processor (the PIL one: the same resize,
rescale, normalise and patch order) on images of several sizes and aspect ratios, tiny and very wide included."""
from __future__ import annotations

import hashlib

import pytest
import torch

from rawserve.engine.mm_inputs import ImageInput
from rawserve.engine.multimodal.preprocess import PreprocessConfig, pixel_patches
from tests.checkpoints import TINY_PREPROCESSOR, hf_image_processor

Image = pytest.importorskip("PIL.Image")
ImageFilter = pytest.importorskip("PIL.ImageFilter")


def photo(width: int, height: int, seed: int):
    """A random image blurred a little, so resampling sees edges and gradients as in a photo."""
    noise = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(noise.numpy()).filter(ImageFilter.GaussianBlur(1))


def image_input(picture, resized: tuple[int, int], offset: int = 0, merge: int = 2, patch: int = 16) -> ImageInput:
    rgb = picture.convert("RGB").tobytes()
    h, w = resized
    return ImageInput(content_hash=hashlib.sha256(rgb).digest(), width=picture.width, height=picture.height, rgb=rgb,
                      resized_height=h, resized_width=w, offset=offset,
                      num_tokens=(h // patch) * (w // patch) // merge ** 2)


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    import json

    directory = tmp_path_factory.mktemp("processor")
    (directory / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    return directory


@pytest.mark.parametrize("size", [(96, 64), (7, 5), (640, 12), (12, 900), (300, 200), (64, 64)])
def test_pixel_patches_equal_transformers(processor_dir, size):
    hf = hf_image_processor(processor_dir)
    picture = photo(*size, seed=size[0])
    ref = hf(images=[picture], return_tensors="pt")
    _, gh, gw = ref["image_grid_thw"][0].tolist()
    cfg = PreprocessConfig.read(processor_dir)
    patches, grid = pixel_patches(image_input(picture, (gh * 16, gw * 16)), cfg)
    assert grid == (1, gh, gw)
    assert patches.shape == ref["pixel_values"].shape
    # PIL and torch round a resampled uint8 value apart by a level or two (1/255/std each), on some values when
    # upscaling far (a 12-pixel side to 32): a wrong patch order or normalisation is off by tenths everywhere
    diff = (patches - ref["pixel_values"]).abs()
    assert diff.max().item() <= 2 / 255 / 0.5 + 1e-5
    assert diff.mean().item() < 4e-3


def test_an_image_at_its_own_size_is_only_normalised_and_patchified(processor_dir):
    hf = hf_image_processor(processor_dir)
    picture = photo(128, 64, seed=3)
    ref = hf(images=[picture], return_tensors="pt")
    patches, _ = pixel_patches(image_input(picture, (64, 128)), PreprocessConfig.read(processor_dir))
    torch.testing.assert_close(patches, ref["pixel_values"], atol=1e-6, rtol=0)


def test_config_defaults_and_refusals(tmp_path):
    import json

    assert PreprocessConfig.read(tmp_path).image_mean[0] == pytest.approx(0.48145466)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 0}))
    with pytest.raises(ValueError, match="patch_size"):
        PreprocessConfig.read(tmp_path)
    picture = photo(40, 40, seed=1)
    with pytest.raises(ValueError, match="multiples of 32"):
        pixel_patches(image_input(picture, (40, 48)), PreprocessConfig())
