"""Offline LLM.generate: the stories260k golden text, token prompts, n samples, stop strings, clean failures."""
from __future__ import annotations

import pytest

import rawserve
from rawserve.engine.frontend.llm import LLM
from rawserve.engine.types import SamplingParams
from tests.conftest import fixture_path

GOLDEN_IDS = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
              411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]
GOLDEN_TEXT = (", there was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
               "red ball.")
GOLDEN_FROM_BOS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267,
                   337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432,
                   352]


@pytest.fixture(scope="module")
def stories():
    return rawserve.LLM(fixture_path("stories260k"), max_num_batched_tokens=64)


def test_stories260k_gives_its_golden_greedy_text(stories):
    [result] = stories.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    assert result.prompt_token_ids == [1, 403, 407, 261, 378]
    [completion] = result.outputs
    assert completion.token_ids == GOLDEN_IDS
    assert completion.text == GOLDEN_TEXT
    assert completion.finish_reason == "length"


def test_text_and_token_prompts_batch_together_in_prompt_order(stories):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    results = stories.generate([[1], "Once upon a time"], greedy)
    assert results[0].outputs[0].token_ids == GOLDEN_FROM_BOS and results[0].prompt is None
    assert results[1].outputs[0].text == GOLDEN_TEXT and results[1].prompt == "Once upon a time"


def test_stop_string_truncates_text_and_frees_the_engine(stories):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Lily"])
    [result] = stories.generate("Once upon a time", params)
    completion = result.outputs[0]
    assert completion.text == ", there was a little girl named "
    assert completion.finish_reason == "stop" and completion.stop_reason == "Lily"
    assert not stories.core.has_unfinished
    assert stories.core.blocks.num_free_blocks == stories.core.num_blocks
    kept = stories.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"],
                                                               include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == ", there was a little girl named Lily"


def test_n_seeded_samples_differ_from_each_other_and_reproduce(stories):
    params = SamplingParams(temperature=1.0, max_tokens=24, n=3, seed=11)
    first = [c.token_ids for c in stories.generate("Once upon a time", params)[0].outputs]
    again = [c.token_ids for c in stories.generate("Once upon a time", params)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 3


def test_logprobs_and_prompt_logprobs_reach_the_result(stories):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1)
    [result] = stories.generate("Once upon a time", params)
    assert len(result.prompt_logprobs) == 5 and result.prompt_logprobs[0] is None
    logprobs = result.outputs[0].logprobs
    assert [entry[0] for entry in logprobs] == GOLDEN_IDS[:5]
    assert all(entry[2] == 1 and len(entry[3]) == 2 for entry in logprobs)  # greedy picks rank 1


def test_a_rejected_prompt_fails_the_call_and_leaves_nothing_running(stories):
    ok = [1, 403, 407]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stories.generate([ok, [1, 99999]], SamplingParams(max_tokens=4))
    assert not stories.core.has_unfinished
    with pytest.raises(ValueError, match="prompts"):
        stories.generate([], SamplingParams())
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        stories.generate(["fine", 3.5], SamplingParams())
    with pytest.raises(ValueError, match="params: got 1 for 2 prompts"):
        stories.generate(["a", "b"], [SamplingParams()])


def test_checkpoint_without_tokenizer_takes_token_ids_and_refuses_text(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, device="cpu", num_kv_blocks=64)
    [result] = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 4 and result.outputs[0].text is None
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("hello", SamplingParams())
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        llm.generate([5, 6], SamplingParams(stop=["x"]))
