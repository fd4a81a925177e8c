"""The offline LLM taking images as vLLM's does ({"prompt": ..., "multi_modal_data": {"image": PIL.Image}}) on a
tiny random Qwen3.5 vision checkpoint (CPU, float32): greedy ids equal transformers' with its processor, one and two
images and a text-only prompt in one batch, the placeholders expanded in prompt_token_ids; bad prompts are
ValueErrors that leave the engine serving."""
from __future__ import annotations

import pytest
import torch

from rawserve import LLM, SamplingParams
from tests.checkpoints import hf_image_processor, load_hf_vl, make_qwen35_vl_checkpoint

Image = pytest.importorskip("PIL.Image")
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def noise(width: int, height: int, seed: int):
    """Sides multiples of 32 within the checkpoint's bounds: the processor keeps the size, so the pixels are exact
    on both sides and greedy ids can be compared however sensitive the random model is."""
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.numpy())


def chat(text: str, images: int) -> str:
    return f"<|im_start|>user\n{PAD * images}{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256, block_size=4)


def transformers_ids(checkpoint, ids: list[int], images: list, max_tokens: int) -> list[int]:
    hf = load_hf_vl(checkpoint)
    t = torch.tensor([ids])
    kwargs = {}
    if images:
        out = hf_image_processor(checkpoint)(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                      mm_token_type_ids=(t == hf.config.image_token_id).int())
    with torch.no_grad():
        generated = hf.generate(t, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                **kwargs)
    return generated[0, len(ids):].tolist()


def test_images_as_vllm_takes_them_give_transformers_greedy_ids(llm, checkpoint):
    one, two = [noise(96, 64, 1)], [noise(64, 128, 2), noise(128, 128, 3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = llm.generate([{"prompt": chat("Describe it.", 1), "multi_modal_data": {"image": one[0]}},
                            {"prompt": chat("Compare them.", 2), "multi_modal_data": {"image": two}},
                            {"prompt": chat("No picture.", 0)}], params)
    image_id = 248056
    assert results[0].prompt_token_ids.count(image_id) == 6  # 96x64: 6x4 patches, 2x2 merged
    assert results[1].prompt_token_ids.count(image_id) == 8 + 16
    assert image_id not in results[2].prompt_token_ids
    for result, images in zip(results, (one, two, [])):
        assert result.outputs[0].token_ids == transformers_ids(checkpoint, result.prompt_token_ids, images, 6)
    ids = llm.generate({"prompt_token_ids": llm.tokenizer.encode(chat("Describe it.", 1)),
                        "multi_modal_data": {"image": one}}, params)[0]
    assert ids.prompt_token_ids == results[0].prompt_token_ids
    assert ids.outputs[0].token_ids == results[0].outputs[0].token_ids


def test_mm_processor_kwargs_size_offline_images_too(checkpoint):
    small = LLM(checkpoint, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=128, block_size=4,
                mm_processor_kwargs='{"max_pixels": 4096}')
    result = small.generate({"prompt": chat("Describe it.", 1), "multi_modal_data": {"image": noise(128, 128, 3)}},
                            SamplingParams(temperature=0, max_tokens=1))[0]
    assert result.prompt_token_ids.count(248056) == 4  # 16 under the checkpoint's bounds


@pytest.mark.parametrize("prompt,said", [
    ({"prompt": chat("x", 0), "multi_modal_data": {"image": "picture.png"}}, "expected a PIL.Image"),
    ({"prompt": chat("x", 2), "multi_modal_data": {"image": [Image.new("RGB", (64, 64))]}}, "2 image placeholder"),
    ({"prompt": chat("x", 1), "multi_modal_data": {"video": []}}, "multi_modal_data"),
    ({"prompt": chat("x", 1), "prompt_token_ids": [1]}, "exactly one"),
    ({"text": "x"}, "unknown key"),
    ({"prompt": chat("x", 1), "multi_modal_data": {"image": Image.new("RGB", (2000, 5))}}, "aspect ratio")])
def test_bad_image_prompts_are_value_errors_and_the_engine_serves_on(llm, prompt, said):
    with pytest.raises(ValueError, match=said):
        llm.generate([chat("fine", 0), prompt], SamplingParams(temperature=0, max_tokens=1))
    assert not llm.core.has_unfinished
    assert len(llm.generate(chat("again", 0), SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids) == 2


def test_a_text_only_model_refuses_images(tmp_path):
    from tests.qwen35_checkpoints import make_qwen35_checkpoint

    text_only = LLM(make_qwen35_checkpoint(tmp_path), device="cpu", dtype="float32", max_model_len=128)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": Image.new("RGB", (64, 64))}})
