"""Image input through the real EngineCore on tiny random Qwen3.5 and Qwen3-VL checkpoints (CPU, float32): greedy
ids equal transformers' generate with one and with two images of different sizes, beside text-only requests,
with chunked prefill splitting an image, and after a prefix hit on the text before an image; images are part
of the prefix-cache key; a repeated image is encoded once and its cached encoding gives the same output."""
from __future__ import annotations

import hashlib

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.mm_inputs import ImageInput, MultiModalInputs
from tests.checkpoints import hf_image_processor, load_hf_vl, make_qwen3_vl_checkpoint, make_qwen35_vl_checkpoint
from tests.engine.stepping import greedy, step_to_end

Image = pytest.importorskip("PIL.Image")
BLOCK = 4


class Model:
    """A checkpoint, transformers' model and processor over it, and prompts with images built as the server
    builds them (placeholders expanded to each image's token count)."""

    def __init__(self, directory) -> None:
        self.dir = directory
        self.hf = load_hf_vl(directory)
        self.proc = hf_image_processor(directory)
        cfg = self.hf.config
        self.image_id, self.start_id, self.end_id = cfg.image_token_id, cfg.vision_start_token_id, \
            cfg.vision_end_token_id
        self._references: dict[tuple, list[int]] = {}  # several tests compare against the same prompt

    def core(self, **options) -> EngineCore:
        defaults = dict(model_dir=str(self.dir), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=512,
                        max_num_batched_tokens=256, max_num_seqs=8, max_model_len=512)
        return EngineCore(EngineConfig(**{**defaults, **options}))

    def prompt(self, pictures: list, seed: int, prefix: list[int] | None = None):
        """-> (ids, MultiModalInputs or None, transformers' processor output or None)."""
        g = torch.Generator().manual_seed(seed)
        ids = list(prefix) if prefix is not None else torch.randint(10, 5000, (5,), generator=g).tolist()
        if not pictures:
            return ids + torch.randint(10, 5000, (7,), generator=g).tolist(), None, None
        out = self.proc(images=pictures, return_tensors="pt")
        images = []
        for i, (picture, (_, gh, gw)) in enumerate(zip(pictures, out["image_grid_thw"].tolist())):
            if i:
                ids += torch.randint(10, 5000, (3,), generator=g).tolist()
            ids.append(self.start_id)
            rgb = picture.tobytes()
            images.append(ImageInput(hashlib.sha256(rgb).digest(), picture.width, picture.height, rgb, gh * 16,
                                     gw * 16, len(ids), gh * gw // 4))
            ids += [self.image_id] * (gh * gw // 4) + [self.end_id]
        ids += torch.randint(10, 5000, (6,), generator=g).tolist()
        return ids, MultiModalInputs(tuple(images)), out

    def reference(self, ids: list[int], out, max_tokens: int = 8) -> list[int]:
        """transformers' greedy ids, run once per (prompt, pixels) in this module: generate over the real
        248k-token vocabulary is most of these tests' time."""
        key = (tuple(ids), max_tokens, None if out is None else hashlib.sha256(
            out["pixel_values"].numpy().tobytes() + out["image_grid_thw"].numpy().tobytes()).digest())
        if key not in self._references:
            self._references[key] = self._generate(ids, out, max_tokens)
        return list(self._references[key])

    def _generate(self, ids: list[int], out, max_tokens: int) -> list[int]:
        t = torch.tensor([ids])
        kwargs = {} if out is None else dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                                             mm_token_type_ids=(t == self.image_id).int())
        with torch.no_grad():
            generated = self.hf.generate(t, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=0, **kwargs)
        return generated[0, len(ids):].tolist()


def picture(width: int, height: int, seed: int):
    noise = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(noise.numpy())


def run(core: EngineCore, requests) -> tuple[dict, dict]:
    """Add (rid, ids, features) requests, step to the end -> ({rid: ids}, {rid: final output})."""
    for rid, ids, features in requests:
        core.add_request(rid, ids, greedy(), features=features)
    return step_to_end(core)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return Model(make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl")))


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory):
    return Model(make_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3vl"), initializer_range=0.3))


@pytest.fixture(params=["qwen35", "qwen3vl"])
def model(request):
    return request.getfixturevalue(request.param)


def test_one_and_two_images_beside_text_requests_equal_transformers(model):
    cases = {"one": model.prompt([picture(90, 50, 1)], seed=1),
             "two": model.prompt([picture(40, 200, 2), picture(120, 120, 3)], seed=2),
             "text": model.prompt([], seed=3)}
    two = cases["two"][1].images
    assert len(two) == 2 and two[0].num_tokens != two[1].num_tokens
    tokens, final = run(model.core(), [(rid, ids, features) for rid, (ids, features, _) in cases.items()])
    for rid, (ids, _, out) in cases.items():
        assert tokens[rid] == model.reference(ids, out), rid
    assert final["two"].num_prompt_tokens == len(cases["two"][0])  # image tokens count as prompt tokens


def test_chunked_prefill_splitting_images_encodes_each_once_and_equals_transformers(model):
    cases = [model.prompt([picture(40, 200, 2), picture(120, 120, 3)], seed=2), model.prompt([], seed=4)]
    core = model.core(max_num_batched_tokens=7)  # an image of 10+ tokens spans several steps
    tokens, _ = run(core, [(f"r{i}", ids, features) for i, (ids, features, _) in enumerate(cases)])
    for i, (ids, _, out) in enumerate(cases):
        assert tokens[f"r{i}"] == model.reference(ids, out)
    stats = core.stats().extra
    assert stats["mm_images_encoded"] == 2  # the later chunks read the encoder cache
    assert stats["mm_encoder_cache_misses"] == 2 and stats["mm_encoder_cache_hits"] == 0  # counted once per image


def test_preempted_image_requests_resume_with_the_ids_of_an_ample_pool(qwen3vl):
    requests = [(f"r{i}", *qwen3vl.prompt([picture(90 + 30 * i, 50, 20 + i)], seed=20 + i)[:2]) for i in range(4)]
    ample, _ = run(qwen3vl.core(), requests)
    small_core = qwen3vl.core(num_kv_blocks=24, enable_prefix_caching=False)  # one request needs about 10 blocks
    small, _ = run(small_core, requests)
    assert small == ample
    assert small_core.stats().num_preemptions > 0


def test_encoder_cache_hit_gives_the_output_of_a_miss(qwen35):
    ids, features, out = qwen35.prompt([picture(90, 50, 1)], seed=1)  # test_one_and_two_images_...'s "one"
    core = qwen35.core(enable_prefix_caching=False)  # every token recomputed: only the encoder cache can help
    first, _ = run(core, [("a", ids, features)])
    before = core.stats().extra
    second, _ = run(core, [("b", ids, features)])
    after = core.stats().extra
    assert after["mm_images_encoded"] == before["mm_images_encoded"] == 1
    assert after["mm_encoder_cache_hits"] == before["mm_encoder_cache_hits"] + 1
    assert first["a"] == second["b"] == qwen35.reference(ids, out)


def test_encoder_cache_off_encodes_each_time_with_the_same_output(qwen35):
    ids, features, out = qwen35.prompt([picture(120, 120, 8)], seed=8)  # as test_same_text_same_image_hits_...
    assert features.images[0].num_tokens > 7
    core = qwen35.core(enable_prefix_caching=False, encoder_cache_mb=0, max_num_batched_tokens=7)  # chunks split it
    tokens, _ = run(core, [("a", ids, features)])
    tokens.update(run(core, [("b", ids, features)])[0])
    stats = core.stats().extra
    assert stats["mm_encoder_cache_hits"] == 0 and stats["mm_encoder_cache_bytes"] == 0
    # each request encodes it (the cache keeps nothing), once: its later chunks read the encoding it holds
    assert stats["mm_images_encoded"] == 2 and core.multimodal.encodes.num_held == 0
    assert tokens["a"] == tokens["b"] == qwen35.reference(ids, out)


def test_encoder_cache_mb_is_a_flag_and_an_environment_variable():
    from rawserve.config import build_parser, configs_from_args

    engine, _ = configs_from_args(build_parser(environ={"RAWSERVE_ENCODER_CACHE_MB": "0"}).parse_args([]))
    assert engine.encoder_cache_mb == 0
    engine, _ = configs_from_args(build_parser(environ={}).parse_args(["--encoder-cache-mb", "64"]))
    assert engine.encoder_cache_mb == 64
    with pytest.raises(ValueError, match="--encoder-cache-mb"):
        EngineConfig(encoder_cache_mb=-1)


def test_same_text_other_image_shares_only_the_blocks_before_it(model):
    qwen35 = model  # either family; Qwen3.5 continues from the state saved at the block edge before the image
    core = qwen35.core()
    prefix = torch.randint(10, 5000, (13,), generator=torch.Generator().manual_seed(9)).tolist()
    a = qwen35.prompt([picture(90, 50, 6)], seed=6, prefix=prefix)
    b = qwen35.prompt([picture(90, 50, 7)], seed=6, prefix=prefix)
    assert a[0] == b[0]  # the same token ids: only the pixels differ
    tokens_a, _ = run(core, [("a", a[0], a[1])])
    tokens_b, final_b = run(core, [("b", b[0], b[1])])
    offset = b[1].images[0].offset
    assert 0 < final_b["b"].num_cached_tokens <= offset  # the text before the image hit, nothing from it on
    assert tokens_b["b"] == qwen35.reference(b[0], b[2])
    assert tokens_a["a"] != tokens_b["b"]
    assert tokens_a["a"] == qwen35.reference(a[0], a[2])


def test_same_text_same_image_hits_past_the_image(model):
    qwen35 = model
    core = qwen35.core()
    ids, features, out = qwen35.prompt([picture(120, 120, 8)], seed=8)
    run(core, [("a", ids, features)])
    tokens, final = run(core, [("b", ids, features)])
    image = features.images[0]
    assert final["b"].num_cached_tokens >= image.offset + image.num_tokens
    assert tokens["b"] == qwen35.reference(ids, out)


def test_image_keys_enter_block_hashes_from_the_block_of_the_first_image_token(qwen35):
    core = qwen35.core()
    prefix = list(range(100, 110))  # the image starts at 11: inside block 2
    a = qwen35.prompt([picture(90, 50, 6)], seed=6, prefix=prefix)
    b = qwen35.prompt([picture(90, 50, 7)], seed=6, prefix=prefix)
    core.add_request("a", a[0], greedy(), features=a[1])
    core.add_request("b", b[0], greedy(), features=b[1])
    core.add_request("t", a[0], greedy())  # no images: the placeholders as plain tokens
    ha, hb, ht = (core.requests[r].block_hashes for r in "abt")
    first_image_block = a[1].images[0].offset // BLOCK
    assert ha[:first_image_block] == hb[:first_image_block] == ht[:first_image_block]
    assert all(x != y for x, y in zip(ha[first_image_block:], hb[first_image_block:]))
    assert all(x != y for x, y in zip(ha[first_image_block:], ht[first_image_block:]))


def test_bad_image_features_fail_the_request_alone(qwen35, tmp_path):
    core = qwen35.core()
    ids, features, _ = qwen35.prompt([picture(90, 50, 1)], seed=1)
    image = features.images[0]
    import dataclasses

    bad = [
        (ids[:-3] + [1, 2, 3], MultiModalInputs((dataclasses.replace(image, offset=image.offset + 1),)), "placeholder"),
        (ids, MultiModalInputs((dataclasses.replace(image, num_tokens=image.num_tokens + 1),)), "tokens for"),
        (ids, MultiModalInputs((dataclasses.replace(image, rgb=image.rgb[:-1]),)), "RGB"),
        (ids, MultiModalInputs((dataclasses.replace(image, resized_width=40),)), "multiples of 32"),
        (ids + [qwen35.image_id], features, "no image fills"),
        (ids, "pixels", "MultiModalInputs"),
    ]
    for i, (prompt_ids, feats, message) in enumerate(bad):
        with pytest.raises(ValueError, match=message):
            core.add_request(f"bad{i}", prompt_ids, greedy(), features=feats)
    tokens, _ = run(core, [("good", ids, features)])
    assert len(tokens["good"]) == 8


def test_a_text_only_model_refuses_images(tmp_path):
    from tests.checkpoints import make_hf_checkpoint

    core = EngineCore(EngineConfig(model_dir=str(make_hf_checkpoint(tmp_path / "text")), device="cpu",
                                   dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=128))
    rgb = bytes(32 * 32 * 3)
    image = ImageInput(b"h" * 32, 32, 32, rgb, 32, 32, 1, 1)
    with pytest.raises(ValueError, match="takes no images"):
        core.add_request("r", [5, 6, 7], greedy(), features=MultiModalInputs((image,)))


def test_an_image_whose_encoding_would_pass_the_budget_starts_a_later_step(model):
    ids, features, _ = model.prompt([picture(120, 120, 3)], seed=11)
    image = features.images[0]
    assert image.offset > 4 and image.num_tokens >= 12
    core = model.core(max_num_batched_tokens=12, enable_prefix_caching=False)
    chunks = []
    schedule = core.scheduler.schedule

    def spy():
        scheduled = schedule()
        chunks.append([(req.rid, req.num_computed_tokens, n) for req, n in scheduled])
        return scheduled

    core.scheduler.schedule = spy
    run(core, [("img", ids, features), ("text", *model.prompt([], seed=12)[:2])])
    img = [(start, n) for step in chunks for rid, start, n in step if rid == "img"]
    # the chunk that reaches the image starts with it: the text before it ran in an earlier, cheaper step
    assert [start for start, n in img if start <= image.offset < start + n] == [image.offset]
    assert any(start < image.offset for start, n in img)
    assert sum(n for start, n in img if start < len(ids)) == len(ids)  # the prompt, then decodes
    assert core.stats().extra["mm_images_encoded"] == 1


async def test_images_cross_to_a_spawned_core_process_and_give_the_in_process_ids(qwen3vl):
    import functools

    from rawserve.engine.core import make_engine_core
    from rawserve.engine.frontend.async_llm import AsyncLLM
    from rawserve.text.tokenizer import Tokenizer

    ids, features, out = qwen3vl.prompt([picture(90, 50, 1)], seed=1)
    config = EngineConfig(model_dir=str(qwen3vl.dir), device="cpu", dtype="float32", block_size=BLOCK,
                          num_kv_blocks=128, max_model_len=256)
    llm = AsyncLLM(functools.partial(make_engine_core, config), Tokenizer.from_dir(qwen3vl.dir), mode="process")
    try:
        await llm.start()
        outs = [o async for o in llm.generate(ids, greedy(), features=features)]
    finally:
        await llm.stop(5)
    assert [t for o in outs for t in o.new_token_ids] == qwen3vl.reference(ids, out)
