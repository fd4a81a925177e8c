"""SamplingParams validation names the field; child() derives distinct reproducible seeds."""
from __future__ import annotations

import ast
import pathlib
import pickle

import pytest

from rawserve.engine import rules
from rawserve.engine.types import FLOAT32_TINY, SamplingParams


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
        rules.check_request([5], params, vocab_size=256, max_model_len=64)


NAN, INF = float("nan"), float("inf")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 3}, "temperature: must be in [0, 2], got 3"),
    ({"temperature": 1e18}, "temperature: must be in [0, 2]"),
    ({"seed": -1}, "seed: out of range"), ({"seed": 1 << 64}, "seed: out of range"),
    ({"top_k": -2}, "top_k: out of range"), ({"top_k": 1 << 31}, "top_k: out of range"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty: must be > 0 and a normal float32 number"),
    ({"repetition_penalty": 1e-39}, "repetition_penalty: must be > 0 and a normal float32 number"),
    ({"repetition_penalty": 1e39}, "repetition_penalty: must be > 0 and a normal float32 number"),
    ({"seed": True}, "seed: must be an integer"), ({"logprobs": 2.0}, "logprobs: must be an integer"),
    ({"min_p": "0.1"}, "min_p: must be a number"),
    *[({name: value}, f"{name}: must be a finite number") for name in FLOAT_FIELDS for value in (NAN, INF, -INF)],
    ({"logit_bias": {5: NAN}}, "logit_bias: bias for token 5 must be in [-100, 100]"),
])
def test_out_of_range_values_are_refused_saying_so(kwargs, message):
    with pytest.raises(ValueError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-39, 5e-324])
def test_temperatures_zero_or_subnormal_in_float32_are_greedy_by_rule(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.is_greedy
    assert SamplingParams(temperature=FLOAT32_TINY).temperature == FLOAT32_TINY  # the smallest normal samples
    changed = SamplingParams()
    changed.temperature = temperature  # after construction: the core's check refuses it, never divides by it
    with pytest.raises(ValueError, match="^temperature: .* below float32's smallest normal"):
        rules.check_request([5], changed, vocab_size=256, max_model_len=64)


def test_the_limits_themselves_are_accepted():
    SamplingParams(temperature=2, seed=0, top_k=(1 << 31) - 1, repetition_penalty=FLOAT32_TINY)
    SamplingParams(seed=(1 << 64) - 1, top_k=-1, repetition_penalty=3.4e38)


def test_types_does_not_import_rules():
    """rules names SamplingParams (for type checking only); types must import nothing back (issue 31 item 9)."""
    source = pathlib.Path(__file__).parents[2] / "rawserve" / "engine" / "types.py"
    imported = {node.module for node in ast.walk(ast.parse(source.read_text()))
                if isinstance(node, ast.ImportFrom)} | {alias.name for node in ast.walk(ast.parse(source.read_text()))
                                                         if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.startswith("rawserve.engine.rules") for name in imported), imported


def test_children_get_distinct_reproducible_seeds_and_pickle():
    params = SamplingParams(n=4, seed=11, stop="x")
    seeds = [params.child(j).seed for j in range(4)]
    assert len(set(seeds)) == 4 and seeds == [params.child(j).seed for j in range(4)]
    assert all(params.child(j).n == 1 for j in range(4))
    assert SamplingParams(n=2).child(1).seed is None
    assert pickle.loads(pickle.dumps(params)) == params and params.stop == ("x",)
