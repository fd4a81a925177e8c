"""A vision tower in the core's memory plan: its weights count in the up-front check, its worst forward (the
largest image the processor gives) bounds the step's working memory and is measured to stay under that bound,
the resize's largest area is never exceeded, and the manager neither takes a larger image nor encodes more than
one image at a time."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine import memory
from rawserve.engine.core import EngineCore
from rawserve.engine.loader import VisionConfig, read_model_config
from rawserve.engine.mm_inputs import (ImageInput, ImageTooOdd, MultiModalInputs, image_token_count,
                                       max_resized_pixels, smart_resize)
from rawserve.engine.model_runner import weight_bytes
from rawserve.engine.models.vision import VisionTower, load_vision_tower
from rawserve.engine.multimodal.budget import tower_step_bytes, vision_weight_bytes
from rawserve.engine.multimodal import encode_job
from rawserve.engine.multimodal.encode_job import EncodeJob, encode_flops
from rawserve.engine.multimodal.manager import MultiModalManager
from rawserve.engine.multimodal.prefix_keys import image_key
from rawserve.engine.multimodal.preprocess import PreprocessConfig, pixel_patches
from rawserve.process_stats import keep_freed_heap, release_free_heap
from tests.checkpoints import TINY_PREPROCESSOR, make_qwen35_vl_checkpoint

TOWER = VisionConfig(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
                     hidden_act="gelu_pytorch_tanh", rope_theta=10000.0, image_token_id=7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl"))


def image(width: int, height: int, pre: PreprocessConfig, offset: int = 0) -> ImageInput:
    rgb = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(width)).numpy().tobytes()
    factor = pre.patch_size * pre.merge_size
    rh, rw = smart_resize(height, width, factor, pre.min_pixels, pre.max_pixels)
    return ImageInput(hashlib.sha256(rgb).digest(), width, height, rgb, rh, rw, offset,
                      image_token_count(rh, rw, pre.patch_size, pre.merge_size))


def random_tower() -> VisionTower:
    tower = VisionTower(TOWER, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for param in tower.parameters():
            param.copy_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    return tower.eval()


@pytest.mark.parametrize("factor,min_pixels,max_pixels", [
    (32, 64 * 64, 192 * 192),  # the tests' processor: very wide images hold a side at one factor, past max_pixels
    (32, 65536, 16777216),  # the published Qwen3.5 / Qwen3-VL processor
    (28, 56 * 56, 28 * 28 * 1280),  # Qwen2-VL's defaults
    (32, 36000, 36864)])  # min_pixels near max_pixels: the round-up overshoots
def test_smart_resize_never_passes_the_largest_area(factor, min_pixels, max_pixels):
    bound = max_resized_pixels(factor, min_pixels, max_pixels)
    worst = 0
    for height in [*range(1, 300, 3), 997, 4000, 9000]:
        for width in {max(1, height // 200), height // 7 + 1, height, height * 3, height * 200, height * 37 // 5}:
            try:
                rh, rw = smart_resize(height, width, factor, min_pixels, max_pixels)
            except ImageTooOdd:
                continue
            worst = max(worst, rh * rw)
    assert 0 < worst <= bound


def test_weight_bytes_counts_the_vision_tower(checkpoint):
    cfg = read_model_config(checkpoint)
    tower = load_vision_tower(checkpoint, cfg, torch.float32, torch.device("cpu"))
    loaded = sum(t.numel() * t.element_size() for t in [*tower.parameters(), *(
        w for module in tower.modules() for w in getattr(module, "packed", {}).values())])
    assert vision_weight_bytes(checkpoint, torch.float32) == loaded
    text_only = weight_bytes(checkpoint, torch.float32, dataclasses.replace(cfg, vision=None), torch.device("cpu"))
    assert weight_bytes(checkpoint, torch.float32, cfg, torch.device("cpu")) == text_only + loaded


def test_the_worst_image_is_in_the_up_front_check(checkpoint, monkeypatch):
    """A room that holds the weights and a text step but not the tower's worst image is refused at startup."""
    pre = PreprocessConfig.read(checkpoint)
    cfg = read_model_config(checkpoint)
    small = tower_step_bytes(cfg.vision, pre, torch.float32)
    large_pre = {**TINY_PREPROCESSOR, "size": {"shortest_edge": 64 * 64, "longest_edge": 4096 * 4096}}
    large = tower_step_bytes(cfg.vision, dataclasses.replace(pre, max_pixels=4096 * 4096), torch.float32)
    assert large > small + (256 << 20)
    monkeypatch.setattr(memory, "headroom", lambda: memory.Headroom(large, "test's room"))
    config = dict(model_dir=str(checkpoint), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=256, encoder_cache_mb=0)
    EngineCore(EngineConfig(**config))  # the tests' small images: it starts, the KV pool sized in what is left
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(large_pre))
    try:
        with pytest.raises(ValueError, match="not enough memory for the weights"):
            EngineCore(EngineConfig(**config))
    finally:
        (checkpoint / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))


def encoding_peak(tower: VisionTower, picture: ImageInput, pre: PreprocessConfig, step_flops: float) -> int:
    """Peak RSS rise of preprocessing `picture` and encoding it as the engine does (EncodeJob advanced a step's
    budget at a time), with the heap kept as the core keeps it."""
    keep_freed_heap()
    small = image(64, 64, pre)
    patches, (_, gh, gw) = pixel_patches(small, pre)
    job = EncodeJob(tower, patches, (gh, gw))  # warm: kernels and thread pools outside the measure
    job.advance(job.remaining_flops)
    del patches, job
    release_free_heap()  # what earlier tests left in the kept heap could hold this encoding without a peak
    if not memory.reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs: the peak cannot be measured")
    before = memory.rss_bytes()
    patches, (_, gh, gw) = pixel_patches(picture, pre)
    job = EncodeJob(tower, patches, (gh, gw))
    del patches
    while not job.advance(step_flops or job.remaining_flops):
        pass
    return memory.rss_bytes("VmHWM") - before


@pytest.mark.parametrize("step_flops", [0.0, 2e9])  # each pass whole (still sliced), and a step's budget at a time
def test_encoding_the_largest_image_stays_under_its_estimate(step_flops):
    """The estimate leaves out nothing that grows with the image, so a change that holds more (attention falling
    back to a [heads, patches, patches] score matrix: 530 MB here) fails."""
    pre = dataclasses.replace(PreprocessConfig(), min_pixels=65536, max_pixels=1920 * 1088)
    picture = image(1920, 1080, pre)
    assert picture.resized_width * picture.resized_height // 256 == pre.max_patches  # the largest image
    peak = encoding_peak(random_tower(), picture, pre, step_flops)
    assert 0 < peak <= tower_step_bytes(TOWER, pre, torch.float32)


def test_a_pass_runs_a_slice_of_rows_at_a_time_whatever_the_budget(monkeypatch):
    """At the 0.8B tower's width one block's transients are 108 KB a row: a whole pass over 4,096 rows would hold
    about 420 MiB of them, far more than the estimate's 512-row slice allows, so the cap's loss fails here."""
    monkeypatch.setattr(encode_job, "SLICE_ROWS", 512)
    wide = dataclasses.replace(TOWER, depth=1, hidden_size=768, intermediate_size=4304, num_heads=16)
    tower = VisionTower(wide, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for param in tower.parameters():
            param.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    pre = dataclasses.replace(PreprocessConfig(), min_pixels=65536, max_pixels=1024 * 1024)
    estimate = tower_step_bytes(wide, pre, torch.float32)
    assert pre.max_patches == 4096 and estimate < 4096 * (16 * 768 + 8 * 768 + 2 * 4304) * 4 // 2
    assert 0 < encoding_peak(tower.eval(), image(1024, 1024, pre), pre, 0.0) <= estimate


def test_the_manager_refuses_a_larger_image_and_encodes_one_image_at_a_time(monkeypatch):
    from rawserve.engine.multimodal import encode_queue
    from rawserve.engine.request import Request
    from rawserve.engine.types import SamplingParams

    pre = dataclasses.replace(PreprocessConfig(), min_pixels=64 * 64, max_pixels=512 * 512)
    tower = random_tower()
    manager = MultiModalManager(tower, pre, TOWER.image_token_id, cache_bytes=0, text_flops_per_token=1e6)
    a = image(500, 400, pre)
    b = image(400, 500, pre, offset=a.num_tokens + 1)
    c = image(64, 64, pre, offset=b.offset + b.num_tokens + 1)
    ids = [TOWER.image_token_id] * a.num_tokens + [1] + [TOWER.image_token_id] * b.num_tokens + [1] + \
        [TOWER.image_token_id] * c.num_tokens
    features = MultiModalInputs((a, b, c))
    manager.check(ids, features)
    assert a.num_tokens * 4 <= pre.max_patches < 2 * a.num_tokens * 4
    rows = []

    class Recorded(encode_queue.EncodeJob):
        def __init__(self, tower, patches, grid) -> None:
            rows.append(len(patches))
            super().__init__(tower, patches, grid)

    monkeypatch.setattr(encode_queue, "EncodeJob", Recorded)
    req = Request("r", ids, SamplingParams(max_tokens=1), features=features)
    encodes = manager.encodes
    assert encodes.ready_tokens(req, 0, len(ids)) == 0 and encodes.num_wanted == 3
    for done, x in enumerate((a, b, c), 1):  # each step's budget just one image's forward: that image, whole
        assert encodes.charge(math.ceil(encode_flops(tower.cfg, x.num_tokens * 4) / 1e6)) > 0
        encodes.advance()
        assert encodes.num_jobs == 0 and encodes.num_wanted == 3 - done and len(rows) == done
    assert max(rows) <= pre.max_patches  # one image in flight: at most the forward the memory plan counts
    assert encodes.ready_tokens(req, 0, len(ids)) == len(ids)
    assert [encodes.entry(image_key(x)).embeds.shape[0] for x in (a, b, c)] == [a.num_tokens, b.num_tokens,
                                                                                 c.num_tokens]
    encodes.drop(req)
    assert encodes.num_held == 0  # the cache is off: nothing is kept once the request lets go
    huge = dataclasses.replace(a, resized_width=1024, resized_height=1024, num_tokens=1024)
    ids = [TOWER.image_token_id] * 1024
    with pytest.raises(ValueError, match="larger than the image processor gives"):
        manager.check(ids, MultiModalInputs((huge,)))
    manager.check(ids[:a.num_tokens], MultiModalInputs((dataclasses.replace(a, offset=0),)))
