"""Tokenizer: reference ids of the real Qwen3 / Llama 3 tokenizers, special ids, bytes, threads; what needs only a
Qwen3-shaped tokenizer also runs on the one tests/conftest.py builds (no ../shared/fixtures needed)."""
from __future__ import annotations

import json
import shutil
import threading

import pytest

from rawserve.text.tokenizer import BYTE_LEVEL, PIECES, Tokenizer
from tests.conftest import fixture_path


def _reference_cases(name: str) -> list[tuple[str, list[int]]]:
    texts = fixture_path("tokenizer_tests", f"{name}.inp").read_text(encoding="utf-8")
    ids = fixture_path("tokenizer_tests", f"{name}.out").read_text(encoding="utf-8")
    texts_list = texts.split("\n__ggml_vocab_test__\n")[:-1]
    ids_list = [[int(x) for x in line.split()] for line in ids.split("\n")[:-1]]
    assert len(texts_list) == len(ids_list) == 46
    return list(zip(texts_list, ids_list))


@pytest.mark.parametrize("name, tokenizer_fixture", [("qwen2", "qwen3_tokenizer"), ("llama3", "llama3_tokenizer")])
def test_real_tokenizers_reproduce_reference_ids_and_decode_back(name, tokenizer_fixture, request):
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    for text, expected in _reference_cases(name):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == expected, text
        assert tokenizer.decode(ids) == text
        # The byte table is what the detokenizer and guided decoding use: it must agree too.
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_qwen3_ids_with_special_tokens_in_text(qwen3_tokenizer):
    assert qwen3_tokenizer.encode("Hello world") == [9707, 1879]
    ids = qwen3_tokenizer.encode("<|im_start|>user\n你好<|im_end|>")
    assert ids == [151644, 872, 198, 108386, 151645]
    assert qwen3_tokenizer.decode(ids) == "<|im_start|>user\n你好<|im_end|>"
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == "user\n你好"


def test_llama3_adds_bos_only_with_special_tokens(llama3_tokenizer):
    assert llama3_tokenizer.encode("Hello world") == [128000, 9906, 1917]
    assert llama3_tokenizer.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    assert llama3_tokenizer.encode("This is a test sentence.") == [128000, 2028, 374, 264, 1296, 11914, 13]


# Byte-level BPE in Qwen3's layout: the built one in every clone, the real Qwen3 one where ../shared/fixtures is.
QWEN_LAYOUT = ["large_vocab_tokenizer", "qwen3_tokenizer"]


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_qwen3_layout_special_tokens_and_vocab_size_come_from_the_files(request, name):
    q = request.getfixturevalue(name)
    assert (q.vocab_size, q.eos_token, q.eos_token_id, q.bos_token, q.bos_token_id) == \
        (151669, "<|im_end|>", 151645, None, None)
    assert q.added_token_ids == frozenset(range(151643, 151669))
    assert q.special_token_ids == frozenset(range(151643, 151657))
    # <think> and <tool_call> are added but not special: they survive skip_special_tokens.
    assert q.id_to_token(151667) == "<think>" and 151667 not in q.special_token_ids
    assert q.decode([151667, 151668, 151657], skip_special_tokens=True) == "<think></think><tool_call>"
    assert q.decode_mode == BYTE_LEVEL


def test_special_tokens_and_vocab_sizes_come_from_the_checkpoint(llama3_tokenizer, stories_tokenizer):
    ll = llama3_tokenizer
    assert (ll.vocab_size, ll.bos_token_id, ll.eos_token, ll.eos_token_id) == (128256, 128000, "<|eot_id|>", 128009)
    assert len(ll.special_token_ids) == 256
    s = stories_tokenizer
    assert (s.vocab_size, s.bos_token_id, s.eos_token_id) == (512, 1, 2)
    assert s.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_decode_modes_follow_the_decoder(qwen3_tokenizer, llama3_tokenizer, stories_tokenizer):
    assert qwen3_tokenizer.decode_mode == BYTE_LEVEL
    assert llama3_tokenizer.decode_mode == BYTE_LEVEL
    assert stories_tokenizer.decode_mode == PIECES
    assert stories_tokenizer.pieces_strip == (" ", 1)


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_byte_level_vocabulary_covers_every_byte_and_reverses_the_gpt2_map(request, name):
    qwen3_tokenizer = request.getfixturevalue(name)
    table = qwen3_tokenizer.vocab_bytes()
    assert len(table) == qwen3_tokenizer.vocab_size
    assert {t for t in table if len(t) == 1} == {bytes([b]) for b in range(256)}
    assert qwen3_tokenizer.token_bytes(qwen3_tokenizer.token_to_id("Ġ")) == b" "
    assert qwen3_tokenizer.token_bytes(qwen3_tokenizer.token_to_id("Ċ")) == b"\n"
    # 你 is split by byte-level BPE into pieces that are not valid UTF-8 on their own.
    assert qwen3_tokenizer.token_bytes(qwen3_tokenizer.token_to_id("ä")) == b"\xe4"
    assert qwen3_tokenizer.token_bytes(151645) == b"<|im_end|>"
    assert qwen3_tokenizer.token_bytes(151936) == b""  # a padded embedding row
    assert qwen3_tokenizer.token_bytes(-1) == b""


def test_byte_fallback_and_sentencepiece_pieces_become_bytes(stories_tokenizer):
    tok = stories_tokenizer
    assert tok.token_bytes(tok.token_to_id("<0xE4>")) == b"\xe4"
    assert tok.token_bytes(tok.token_to_id("▁Once")) == b" Once"
    assert tok.byte_fallback_values()[tok.token_to_id("<0x41>")] == 0x41
    assert tok.byte_fallback_values()[403] == -1
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == b" Once upon a time"


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_decode_rejects_negative_or_non_integer_ids(request, name):
    qwen3_tokenizer = request.getfixturevalue(name)
    with pytest.raises(ValueError, match="non-negative"):
        qwen3_tokenizer.decode([1, -5])
    with pytest.raises(ValueError, match="non-negative"):
        qwen3_tokenizer.decode(["a"])
    with pytest.raises(ValueError, match="text must be a string"):
        qwen3_tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    hello = qwen3_tokenizer.encode("Hello")
    assert qwen3_tokenizer.decode([*hello, 999_999]) == "Hello"  # past the vocabulary: skipped, as in tokenizers
    with pytest.raises(ValueError, match="non-negative"):
        qwen3_tokenizer.decode([1, True])  # a bool is not an id, though it is an int to Python


@pytest.mark.parametrize("name", QWEN_LAYOUT)
def test_long_inputs_take_the_batch_calls_with_the_same_results(request, name):
    qwen3_tokenizer = request.getfixturevalue(name)
    from rawserve.text.tokenizer import RELEASE_GIL_AT, TooManyTokens

    text = "Hello world, once upon a time. " * 800
    assert len(text) > RELEASE_GIL_AT
    ids = qwen3_tokenizer.encode(text)
    assert ids == qwen3_tokenizer._tok.encode(text).ids and len(ids) > RELEASE_GIL_AT
    assert qwen3_tokenizer.decode(ids) == qwen3_tokenizer._tok.decode(ids) == text
    with pytest.raises(ValueError, match="non-negative"):
        qwen3_tokenizer.decode(ids + [-1])
    with pytest.raises(TooManyTokens) as too_many:
        qwen3_tokenizer.encode(text, max_tokens=len(ids) - 1)
    assert too_many.value.num_tokens == len(ids)
    assert qwen3_tokenizer.encode(text, max_tokens=len(ids)) == ids
    with pytest.raises(TooManyTokens):
        qwen3_tokenizer.encode("Hello world", max_tokens=1)  # the short path checks too


def test_from_dir_reads_the_chat_template_from_tokenizer_config(qwen3_tokenizer):
    expected = fixture_path("chat_templates", "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    assert qwen3_tokenizer.chat_template == expected


def test_from_dir_reads_the_built_tokenizers_template(large_vocab_tokenizer):
    from rawserve.demo_model import chat_template

    assert large_vocab_tokenizer.chat_template == chat_template()


def test_from_dir_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_eos_token_missing_from_the_vocabulary_is_rejected(tmp_path, large_vocab_tokenizer_dir):
    shutil.copy(large_vocab_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<nope>"}}))
    with pytest.raises(ValueError, match="eos_token '<nope>'"):
        Tokenizer.from_dir(tmp_path)


def test_special_tokens_map_is_the_fallback_for_bos_and_eos(tmp_path, large_vocab_tokenizer_dir):
    shutil.copy(large_vocab_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": "<|endoftext|>", "special": True}, "eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id, tok.chat_template) == \
        ("<|endoftext|>", 151643, "<|im_end|>", 151645, None)


@pytest.mark.parametrize("name", ["large_vocab_tokenizer_dir", "qwen3"])
def test_concurrent_use_from_threads_matches_serial_results(request, name):
    directory = fixture_path("qwen3-tokenizer") if name == "qwen3" else request.getfixturevalue(name)
    tok = Tokenizer.from_file(directory / "tokenizer.json")  # fresh: byte tables unbuilt
    texts = ["Hello world", "你好，世界 😀", "def f(x):\n    return x * 2\n", "¿Qué tal? Ünïcödé"] * 5
    expected = [tok.encode(t) for t in texts]
    results: list[object] = []
    tables: list[int] = []
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        tables.append(id(tok.vocab_bytes()))  # the lazily built table is built once for everyone
        for _ in range(20):
            got = [tok.encode(t) for t in texts]
            results.append(got == expected and [tok.decode(ids) for ids in got] == [tok.decode(e) for e in expected])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 160
    assert len(set(tables)) == 1
    assert tok.encode_batch(texts) == expected


def test_truncation_in_tokenizer_json_never_cuts_a_prompt(tmp_path, large_vocab_tokenizer_dir):
    data = json.loads((large_vocab_tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    data["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert len(tok.encode("Once upon a time in a land far away")) > 3
    once = tok.encode("Once")
    assert tok.decode([*once, 2**40]) == "Once"  # a huge id is skipped like any id past the vocabulary
