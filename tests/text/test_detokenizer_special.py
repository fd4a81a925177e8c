"""Output-parser markers that the tokenizer makes special tokens (<tool_call>, <think>, as many checkpoints do):
the detokenizer keeps them for the parsers under skip_special_tokens, and they never reach the message."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.parsers import OutputParser
from rawserve.text.tokenizer import WINDOW, Tokenizer
from tests.conftest import fixture_path

MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def special_markers_tokenizer(directory: pathlib.Path, source: pathlib.Path,
                              markers: tuple[str, ...] = MARKERS) -> pathlib.Path:
    """Copy the Qwen3-layout tokenizer in `source` into `directory` with `markers` flipped to special tokens (in
    tokenizer.json, which decides, and in tokenizer_config.json's added_tokens_decoder, as a checkpoint has it)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    data = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if token["content"] in markers:
            token["special"] = True
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    for token in config.get("added_tokens_decoder", {}).values():
        if token.get("content") in markers:
            token["special"] = True
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return directory


# The tokenizer built in tests/conftest.py runs in every clone; the real Qwen3 one where ../shared/fixtures is.
@pytest.fixture(scope="module", params=["large_vocab", "qwen3"])
def tok(request, tmp_path_factory) -> Tokenizer:
    if request.param == "qwen3":
        source = fixture_path("qwen3-tokenizer")
    else:
        source = request.getfixturevalue("large_vocab_tokenizer_dir")
    return Tokenizer.from_dir(special_markers_tokenizer(tmp_path_factory.mktemp("special-markers"), source))


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(tok: Tokenizer, ids: list[int], keep: tuple[str, ...], mode: str | None = None) -> list[str]:
    """One id at a time, as the engine delivers them: the deltas, flush included."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True, keep_special=keep, mode=mode)
    return [detok.add([i]) for i in ids] + [detok.flush()]


def test_the_copy_makes_the_markers_single_special_tokens(tok):
    for marker in MARKERS:
        [token_id] = _ids(tok, marker)
        assert token_id in tok.special_token_ids
    assert tok.special_ids_of(MARKERS) == frozenset(_ids(tok, "".join(MARKERS)))
    assert tok.special_ids_of(["hello", "<tool_response>"]) == frozenset()  # not one token; added, not special


@pytest.mark.parametrize("mode", [None, WINDOW])
def test_kept_markers_are_decoded_and_other_specials_still_skipped(tok, mode):
    text = f"<think>\nhm\n</think>\n\n<tool_call>\n{CALL}\n</tool_call><|im_end|>"
    ids = _ids(tok, text)
    assert tok.eos_token_id in ids or _ids(tok, "<|im_end|>")[0] in ids
    kept = "".join(_stream(tok, ids, MARKERS, mode))
    assert kept == text.replace("<|im_end|>", "")
    # Without keeping them (the behaviour before): skip_special_tokens drops the parsers' tags.
    assert "".join(_stream(tok, ids, (), mode)) == f"\nhm\n\n\n\n{CALL}\n"
    # Keeping only some of them drops the rest.
    assert "".join(_stream(tok, ids, ("<tool_call>",), mode)) == f"\nhm\n\n\n<tool_call>\n{CALL}\n"


def test_kept_markers_do_not_change_skip_false(tok):
    ids = _ids(tok, "<think>a</think><|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, keep_special=MARKERS)
    assert detok.add(ids) + detok.flush() == tok.decode(ids, skip_special_tokens=False)


def _parse(tok: Tokenizer, text: str, *, reasoning: str | None, use_tools: bool) -> dict:
    """The server's path for one choice: real ids, one at a time, through the detokenizer and the parser,
    with the keep set and hidden markers chat.start_chat derives."""
    parser = OutputParser(reasoning, use_tools)
    hidden = tuple(m for m in parser.markers if tok.token_to_id(m) in tok.special_ids_of(parser.markers))
    parser = OutputParser(reasoning, use_tools, hidden_markers=hidden)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    deltas = _stream(tok, _ids(tok, text), hidden)
    for k, delta in enumerate(deltas):
        for d in parser.feed(delta, final=k == len(deltas) - 1):
            message["content"] += d.get("content", "")
            message["reasoning_content"] += d.get("reasoning_content", "")
            for call in d.get("tool_calls", ()):
                if "id" in call:
                    message["tool_calls"].append([call["function"]["name"], ""])
                message["tool_calls"][-1][1] += call["function"].get("arguments", "")
    message["has_tool_calls"] = parser.has_tool_calls
    return message


def test_an_auto_call_in_special_markers_is_a_tool_call(tok):
    m = _parse(tok, f"<tool_call>\n{CALL}\n</tool_call><|im_end|>", reasoning=None, use_tools=True)
    assert m["tool_calls"] == [["get_weather", '{"city": "Paris"}']] and m["has_tool_calls"]
    assert m["content"] == ""


def test_reasoning_in_special_markers_is_split_out(tok):
    m = _parse(tok, "<think>\nLet me see.\n</think>\n\nIt is sunny.<|im_end|>", reasoning="qwen3", use_tools=False)
    assert m["reasoning_content"] == "Let me see." and m["content"] == "It is sunny."


def test_reasoning_then_two_calls_with_content_between(tok):
    text = (f"<think>why</think>\n\nChecking.\n<tool_call>\n{CALL}\n</tool_call>\n"
            f"<tool_call>\n{CALL.replace('Paris', 'Oslo')}\n</tool_call><|im_end|>")
    m = _parse(tok, text, reasoning="qwen3", use_tools=True)
    assert m["reasoning_content"] == "why" and m["content"] == "Checking."
    assert [c[1] for c in m["tool_calls"]] == ['{"city": "Paris"}', '{"city": "Oslo"}']


def test_a_block_that_is_no_call_shows_without_its_special_markers(tok):
    m = _parse(tok, "Hi <tool_call>\nnot json\n</tool_call> bye<|im_end|>", reasoning="qwen3", use_tools=True)
    assert not m["has_tool_calls"] and m["tool_calls"] == []
    assert "<tool_call>" not in m["content"] and "</tool_call>" not in m["content"]
    assert m["content"] == "Hi \nnot json\n bye"


def test_markers_of_parsers_not_in_use_stay_skipped(tok):
    # No tools in the request: the hermes tags are not kept, so skipping drops them as any special token.
    m = _parse(tok, "<think>r</think>A<tool_call>B<|im_end|>", reasoning="qwen3", use_tools=False)
    assert m == {"content": "AB", "reasoning_content": "r", "tool_calls": [], "has_tool_calls": False}


def test_llama3_python_tag_is_kept_for_the_parser_and_hidden(llama3_tokenizer):
    tok = llama3_tokenizer
    assert tok.special_ids_of(["<|python_tag|>"])  # special in Llama 3's own vocabulary
    parser = OutputParser(None, True, tool_parser="llama3_json", hidden_markers=("<|python_tag|>",))
    assert parser.markers == ("<|python_tag|>",)
    text = "".join(_stream(tok, _ids(tok, '<|python_tag|>not a call<|eom_id|>'), parser.markers))
    assert text == "<|python_tag|>not a call"
    deltas = parser.feed(text, final=True)
    assert deltas == [{"content": "not a call"}] and not parser.has_tool_calls
