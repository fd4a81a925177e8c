"""--mm-processor-kwargs (vLLM's; HF's size form too) overriding the checkpoint's image-processor pixel bounds: the
flag's parsing and its startup errors, the server's resize rules and the core's preprocessing bound taking it, the
memory reserved for the tower's worst forward falling with max_pixels, and greedy ids through the real EngineCore
equal to transformers' with the processor given the same max_pixels."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rawserve.api.media import ImageProcessorRules, ProcessorConfigError
from rawserve.config import EngineConfig, build_parser, configs_from_args
from rawserve.engine.loader import VisionConfig
from rawserve.engine.mm_inputs import ImageInput, MultiModalInputs
from rawserve.engine.multimodal.budget import step_bytes_with_images
from rawserve.engine.multimodal.preprocess import PreprocessConfig
from tests.checkpoints import hf_image_processor, make_qwen35_vl_checkpoint

# Qwen3.5-0.8B's tower (bench/vision.py) and its published processor bounds
VISION_0_8B = VisionConfig(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=1024,
                           num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
                           image_token_id=248056)
PUBLISHED = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
             "image_std": [0.5] * 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
MAX_PIXELS = 96 * 96  # the tests' checkpoint publishes 192 * 192


def bounds(kwargs: dict | str | None) -> dict:
    return EngineConfig(mm_processor_kwargs=kwargs if kwargs is None or isinstance(kwargs, str)
                        else json.dumps(kwargs)).mm_pixel_bounds()


def test_both_spellings_give_the_same_bounds_and_a_flag_sets_them():
    assert bounds(None) == {}
    assert bounds({"max_pixels": 1003520}) == {"max_pixels": 1003520}
    assert bounds({"max_pixels": 1003520, "min_pixels": 3136}) == bounds(
        {"size": {"longest_edge": 1003520, "shortest_edge": 3136}}) == {"min_pixels": 3136, "max_pixels": 1003520}
    assert bounds({"max_pixels": 5000, "size": {"longest_edge": 5000}}) == {"max_pixels": 5000}  # said twice, alike
    assert EngineConfig(mm_processor_kwargs={"max_pixels": 5000}).mm_pixel_bounds() == {"max_pixels": 5000}  # Python
    engine, _ = configs_from_args(build_parser(environ={}).parse_args(
        ["--mm-processor-kwargs", '{"max_pixels": 1003520}']))
    assert engine.mm_pixel_bounds() == {"max_pixels": 1003520}


@pytest.mark.parametrize("bad,said", [
    ("max_pixels=5", "not JSON"), ("[1]", "JSON object"), ('{"fps": 2}', "'fps'"),
    ('{"max_pixels": 0}', "positive integer"), ('{"max_pixels": 1.5}', "positive integer"),
    ('{"max_pixels": true}', "positive integer"), ('{"size": 3}', "size must be an object"),
    ('{"size": {"height": 3}}', "'height'"), ('{"max_pixels": 5, "size": {"longest_edge": 6}}', "differ"),
    ('{"min_pixels": 10, "max_pixels": 5}', "exceeds")])
def test_bad_values_are_a_startup_error_naming_the_flag(bad, said):
    with pytest.raises(ValueError, match="--mm-processor-kwargs") as error:
        EngineConfig(mm_processor_kwargs=bad)
    assert said in str(error.value)


def test_a_bound_crossing_the_checkpoints_other_bound_stops_the_server_and_the_core(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 16}, "image_token_id": 7}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))
    too_low = bounds({"max_pixels": 32 * 32})  # under the checkpoint's min_pixels 65536
    with pytest.raises(ProcessorConfigError, match="mm-processor-kwargs"):
        ImageProcessorRules.from_dir(tmp_path, too_low)
    with pytest.raises(ValueError, match="mm-processor-kwargs"):
        PreprocessConfig.read(tmp_path, pixel_bounds=too_low)
    text_only = tmp_path / "text"
    text_only.mkdir()
    (text_only / "config.json").write_text("{}")
    with pytest.raises(ProcessorConfigError, match="no vision tower"):
        ImageProcessorRules.from_dir(text_only, {"max_pixels": 1003520})


def test_the_server_and_the_core_take_the_same_bounds(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 16}, "image_token_id": 7}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))
    override = bounds({"size": {"longest_edge": 1003520, "shortest_edge": 3136}})
    rules = ImageProcessorRules.from_dir(tmp_path, override)
    core = PreprocessConfig.read(tmp_path, pixel_bounds=override)
    assert (rules.min_pixels, rules.max_pixels) == (core.min_pixels, core.max_pixels) == (3136, 1003520)
    assert rules.grid(1080, 1920) == (736, 1312, 943)  # 2,040 tokens at the published bounds
    assert ImageProcessorRules.from_dir(tmp_path).grid(1080, 1920)[2] == 2040
    assert PreprocessConfig.read(tmp_path, pixel_bounds={"min_pixels": 3136}).max_pixels == 16777216  # one bound


def test_a_lower_max_pixels_lowers_the_towers_reserve(tmp_path):
    """The 0.8B tower's worst encoding at the published 16.7M pixels (65,536 patches, the image's activations and
    one slice's transients: about 1.8 GiB at float32) is what the core reserves on a CPU; max_pixels 1,003,520
    (vLLM's usual cap) brings it under 0.5 GiB, about a quarter of it."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED))

    def reserve(pixel_bounds) -> int:
        return step_bytes_with_images(tmp_path, VISION_0_8B, torch.float32, text_step=0, num_batched_tokens=2048,
                                      cache_bytes=0, pixel_bounds=pixel_bounds)

    published, capped = reserve(None), reserve(bounds({"max_pixels": 1003520}))
    assert 1 << 30 < published < 3 << 30
    assert capped < 512 << 20 and 3 * capped < published
    assert reserve(bounds({"size": {"longest_edge": 1003520}})) == capped


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl"))


def test_greedy_ids_equal_transformers_with_the_same_max_pixels(checkpoint):
    """The server's rules (with the override) size the image; the core (with the same flag) encodes it; transformers'
    processor given max_pixels makes its pixels: the ids agree, and the image has fewer tokens than unbounded."""
    from PIL import Image

    from tests.checkpoints import load_hf_vl
    from tests.engine.stepping import greedy, step_to_end

    kwargs = json.dumps({"max_pixels": MAX_PIXELS})
    override = EngineConfig(mm_processor_kwargs=kwargs).mm_pixel_bounds()
    rules = ImageProcessorRules.from_dir(checkpoint, override)
    # Smooth, not noise: shrunk 3x, noise meets the resize's one-level rounding differences from PIL (as at any
    # bound), which can flip this random model's later greedy picks.
    ramp = Image.linear_gradient("L").resize((300, 200))
    image = Image.merge("RGB", (ramp, ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT), ramp.rotate(90)))
    height, width, num_tokens = rules.grid(image.height, image.width)
    assert num_tokens < ImageProcessorRules.from_dir(checkpoint).grid(image.height, image.width)[2]
    out = hf_image_processor(checkpoint)(images=[image], return_tensors="pt", size={
        "longest_edge": MAX_PIXELS, "shortest_edge": rules.min_pixels})
    assert out["image_grid_thw"].tolist() == [[1, height // 16, width // 16]]
    hf = load_hf_vl(checkpoint)
    cfg = hf.config
    ids = [101, 202, 303, cfg.vision_start_token_id]
    rgb = image.tobytes()
    inputs = MultiModalInputs((ImageInput(hashlib.sha256(rgb).digest(), image.width, image.height, rgb, height, width,
                                          len(ids), num_tokens),))
    ids += [cfg.image_token_id] * num_tokens + [cfg.vision_end_token_id, 404, 505]
    from rawserve.engine.core import EngineCore

    core = EngineCore(EngineConfig(model_dir=str(checkpoint), device="cpu", dtype="float32", block_size=4,
                                   num_kv_blocks=256, max_num_batched_tokens=256, max_model_len=512,
                                   mm_processor_kwargs=kwargs))
    assert core.runner.multimodal.preprocess.max_pixels == MAX_PIXELS
    core.add_request("r", ids, greedy(), features=inputs)
    tokens, _ = step_to_end(core)
    t = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(t, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                           pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                           mm_token_type_ids=(t == cfg.image_token_id).int())[0, len(ids):].tolist()
    assert tokens["r"] == want
