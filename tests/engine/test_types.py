"""SamplingParams validation names the field; child() derives distinct reproducible seeds."""
from __future__ import annotations

import pickle

import pytest

from rawserve.engine.types import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": {5: 200}}, "logit_bias"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"), ({"seed": 1 << 70}, "seed"), ({"stop": [""]}, "stop"),
    ({"n": True}, "n"),
])
def test_invalid_field_raises_value_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_logit_bias_is_rejected_with_the_vocab_size():
    params = SamplingParams(logit_bias={300: 1.0})
    with pytest.raises(ValueError, match=r"logit_bias: token id 300 is outside the vocabulary \(size 256\)"):
        params.validate(vocab_size=256)


def test_children_get_distinct_reproducible_seeds_and_pickle():
    params = SamplingParams(n=4, seed=11, stop="x")
    seeds = [params.child(j).seed for j in range(4)]
    assert len(set(seeds)) == 4 and seeds == [params.child(j).seed for j in range(4)]
    assert all(params.child(j).n == 1 for j in range(4))
    assert SamplingParams(n=2).child(1).seed is None
    assert pickle.loads(pickle.dumps(params)) == params and params.stop == ("x",)
