"""Tokenizer.encode's early refusal: a text far over `max_tokens` is refused from its length or a windowed
count, never tokenized whole; a text at or just over the limit still gets the exact answer."""
from __future__ import annotations

import random

import pytest

from rawserve.text.tokenizer import COUNT_WINDOW_CHARS, Tokenizer, TooManyTokens
from tests.conftest import fixture_path


# The Qwen3-shaped tokenizer built in tests/conftest.py (every clone) and the real one (where ../shared/fixtures is).
@pytest.fixture(scope="module", params=["large_vocab", "qwen3"])
def qwen3(request):
    if request.param == "qwen3":
        return Tokenizer.from_file(fixture_path("qwen3-tokenizer", "tokenizer.json"))
    return Tokenizer.from_file(request.getfixturevalue("large_vocab_tokenizer_dir") / "tokenizer.json")


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["hello", "world", "the", "a", "日本語", "foo.bar", "xxxxx", "\n", "  ", "café", "e\u0301"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def test_a_text_longer_than_limit_times_the_longest_token_is_refused_from_its_length(qwen3):
    assert qwen3.max_token_chars == 128  # Qwen3's longest token (and the built one's): a run of 128 spaces
    text = "x" * (1000 * 128 + 1)
    with pytest.raises(TooManyTokens) as refused:
        qwen3.encode(text, max_tokens=1000)
    assert refused.value.at_least and refused.value.num_tokens == 1001


def test_a_text_under_that_length_but_over_the_limit_is_refused_by_the_windowed_count(qwen3):
    text = words(60000)
    assert len(text) > 2 * COUNT_WINDOW_CHARS
    exact = len(qwen3.encode(text))
    limit = exact // 3
    assert len(text) < limit * qwen3.max_token_chars  # the length alone cannot tell
    with pytest.raises(TooManyTokens) as refused:
        qwen3.encode(text, max_tokens=limit)
    assert refused.value.at_least and limit < refused.value.num_tokens <= exact


@pytest.mark.parametrize("delta", [0, -1])
def test_near_the_limit_the_answer_is_exact(qwen3, delta):
    text = words(60000, seed=1)
    exact = qwen3.encode(text)
    if delta == 0:
        assert qwen3.encode(text, max_tokens=len(exact)) == exact
    else:
        with pytest.raises(TooManyTokens) as refused:
            qwen3.encode(text, max_tokens=len(exact) - 1)
        assert not refused.value.at_least and refused.value.num_tokens == len(exact)


def test_a_normalizer_that_shrinks_text_is_counted_after_it(qwen3):
    # NFC composes e + combining acute into one character: the bound counts the normalized text.
    text = "e\u0301" * 2000
    exact = qwen3.encode(text)
    assert len(text) > len(exact)  # so the early check runs, through normalize_str
    assert qwen3.encode(text, max_tokens=len(exact)) == exact
