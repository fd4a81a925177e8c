"""Incremental detokenizer against the real tokenizers and the Qwen3-shaped one built in tests/conftest.py (which
runs without ../shared/fixtures): exact at every boundary, never a split character."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.tokenizer import WINDOW

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text that exercises multi-byte UTF-8: CJK, emoji (4 bytes, often split), accents, astral CJK.
TEXT = st.text(alphabet=st.one_of(
    st.sampled_from("abc xyz\n\t.,!?-_'\"0123"),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
    st.characters(min_codepoint=0x00C0, max_codepoint=0x024F),
    st.sampled_from("𝔘𠀋ꙮ龘🦜"),
), max_size=40)


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:])]


def _interesting_ids(tokenizer) -> list[int]:
    """Single-byte pieces that are not valid UTF-8 alone, specials, and ids past the vocabulary."""
    table = tokenizer.vocab_bytes()
    partial = [i for i, b in enumerate(table) if len(b) <= 2 and b and b[0] >= 0x80][:400]
    return partial + sorted(tokenizer.special_token_ids)[:20] + [tokenizer.vocab_size + 5, tokenizer.vocab_size + 200]


def _check_valid_text(tokenizer, text: str, cuts: list[int], mode: str | None = None) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunks in (_chunks(ids, cuts), [[i] for i in ids]):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, mode=mode)
        deltas = [detok.add(chunk) for chunk in chunks] + [detok.flush()]
        assert not any("\ufffd" in d for d in deltas), deltas
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def _check_random_ids(tokenizer, ids: list[int], cuts: list[int], skip: bool, mode: str | None = None) -> None:
    chunks = _chunks(ids, cuts)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, mode=mode)
    emitted, k = "", 0
    for n, chunk in enumerate(chunks):
        emitted += detok.add(chunk)
        k += len(chunk)
        prefix_text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        assert prefix_text.startswith(emitted)  # nothing shown is ever taken back
        # Ending the stream at this boundary gives exactly the full decode of the prefix.
        fresh = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, mode=mode)
        assert "".join(fresh.add(c) for c in chunks[:n + 1]) + fresh.flush() == prefix_text
    assert emitted + detok.flush() == tokenizer.decode(ids, skip_special_tokens=skip)


# Byte-level BPE with a 151,669-token vocabulary: the built one in every clone, the real Qwen3 one where it is.
BYTE_LEVEL_QWEN = ["large_vocab_tokenizer", "qwen3_tokenizer"]


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
@SETTINGS
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_qwen3_valid_text_never_yields_a_replacement_character(request, name, text, cuts):
    _check_valid_text(request.getfixturevalue(name), text, cuts)


@SETTINGS
@given(text=TEXT, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_llama3_and_stories_valid_text_never_yield_a_replacement_character(llama3_tokenizer, stories_tokenizer,
                                                                          text, cuts):
    _check_valid_text(llama3_tokenizer, text, cuts)
    _check_valid_text(stories_tokenizer, text, cuts)


_POOLS: dict[int, list[int]] = {}


def _pool(tokenizer) -> list[int]:
    if id(tokenizer) not in _POOLS:
        _POOLS[id(tokenizer)] = _interesting_ids(tokenizer)
    return _POOLS[id(tokenizer)]


@pytest.mark.parametrize("name", [*BYTE_LEVEL_QWEN, "llama3_tokenizer"])
@SETTINGS
@given(data=st.data(), cuts=st.lists(st.integers(0, 200), max_size=10), skip=st.booleans())
def test_byte_level_random_ids_concatenate_to_the_full_decode_at_every_boundary(request, name, data, cuts, skip):
    tokenizer = request.getfixturevalue(name)
    ids = data.draw(st.lists(st.one_of(st.integers(0, tokenizer.vocab_size + 300), st.sampled_from(_pool(tokenizer))),
                             max_size=24))
    _check_random_ids(tokenizer, ids, cuts, skip)


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
@SETTINGS
@given(data=st.data(), cuts=st.lists(st.integers(0, 200), max_size=10), skip=st.booleans())
def test_window_mode_matches_the_full_decode_for_byte_level(request, name, data, cuts, skip):
    tokenizer = request.getfixturevalue(name)
    ids = data.draw(st.lists(st.one_of(st.integers(0, tokenizer.vocab_size + 300), st.sampled_from(_pool(tokenizer))),
                             max_size=16))
    _check_random_ids(tokenizer, ids, cuts, skip, mode=WINDOW)


@SETTINGS
@given(ids=st.lists(st.integers(0, 600), max_size=24), cuts=st.lists(st.integers(0, 200), max_size=10),
       skip=st.booleans())
def test_byte_fallback_random_ids_concatenate_to_the_full_decode(stories_tokenizer, ids, cuts, skip):
    # ids 3..258 are <0xNN> pieces; runs of them are judged as a whole by the ByteFallback decoder.
    _check_random_ids(stories_tokenizer, ids, cuts, skip)


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
def test_a_character_split_across_tokens_is_emitted_once_complete(request, name):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("a𠀋b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "a𠀋b"
    assert "𠀋" in deltas and all("\ufffd" not in d for d in deltas)
    assert deltas.index("𠀋") == len(ids) - 2  # held through the partial pieces, out with the last


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
def test_an_incomplete_character_at_the_end_flushes_as_the_full_decode_does(request, name):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("𝔘", add_special_tokens=False)
    assert len(ids) > 1 and len(tokenizer.token_bytes(ids[0])) < 4
    ids = ids[:1]  # only the first bytes of 4
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == ""
    assert detok.flush() == tokenizer.decode(ids) == "\ufffd"


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
def test_skip_special_tokens_is_honoured(request, name):
    tokenizer = request.getfixturevalue(name)
    ids = [*tokenizer.encode("Hello"), 151645, *tokenizer.encode(" world"), 151667, 151643]
    if name == "qwen3_tokenizer":
        assert ids == [9707, 151645, 1879, 151667, 151643]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert text == "Hello<|im_end|> world<think><|endoftext|>"


def test_sentencepiece_leading_space_and_bos_follow_the_decoder(stories_tokenizer):
    ids = stories_tokenizer.encode("Once upon a time")  # [1, 403, 407, 261, 378]
    skip = IncrementalDetokenizer(stories_tokenizer, skip_special_tokens=True)
    assert [skip.add([i]) for i in ids] == ["", "Once", " upon", " a", " time"]
    keep = IncrementalDetokenizer(stories_tokenizer, skip_special_tokens=False)
    assert "".join(keep.add([i]) for i in ids) == "<s> Once upon a time"


def test_byte_fallback_run_is_held_until_it_ends(stories_tokenizer):
    tok = stories_tokenizer
    run = [tok.token_to_id(f"<0x{b:02X}>") for b in "你".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in run] == ["", "", ""]
    assert detok.add([403]) == "你 Once"
    bad = IncrementalDetokenizer(tok)
    assert bad.add(run[:2] + [tok.token_to_id("<0x41>")]) == ""
    assert bad.flush() == "\ufffd" * 3 == tok.decode(run[:2] + [tok.token_to_id("<0x41>")])


def test_bad_input_is_rejected(qwen3_tokenizer, stories_tokenizer):
    detok = IncrementalDetokenizer(qwen3_tokenizer)
    assert detok.add([]) == ""
    with pytest.raises(ValueError, match=">= 0"):
        detok.add([5, -1])
    with pytest.raises(ValueError, match="mode"):
        IncrementalDetokenizer(stories_tokenizer, mode="byte_level")


def _seconds_per_token(tokenizer, ids: list[int], mode: str | None) -> float:
    best = float("inf")
    for _ in range(3):
        detok = IncrementalDetokenizer(tokenizer, mode=mode)
        start = time.perf_counter()
        for i in ids:
            detok.add([i])
        best = min(best, (time.perf_counter() - start) / len(ids))
    return best


@pytest.mark.parametrize("name", BYTE_LEVEL_QWEN)
@pytest.mark.parametrize("mode", [None, WINDOW])
def test_cost_per_token_does_not_grow_with_the_sequence(request, name, mode):
    tokenizer = request.getfixturevalue(name)
    text = "The quick brown fox jumps over the lazy dog. 你好世界 😀 " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)
    short = _seconds_per_token(tokenizer, ids[:300], mode)
    long = _seconds_per_token(tokenizer, (ids * 10)[:6000], mode)
    # Re-decoding the whole sequence would make the long stream ~20x slower per token.
    assert long < 4 * short
