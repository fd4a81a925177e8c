"""gpt-oss's harmony output: channels split into reasoning and content, calls to functions.*, every chunking alike,
real token streams through the detokenizer, auto's pick and the stop ids."""
from __future__ import annotations

import json

import pytest

from rawserve.text.chat_template import render_chat
from rawserve.text.defaults import GenerationDefaults, tool_call_parser_for
from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.parsers import OutputParser, check_parser_names
from rawserve.text.parsers.harmony import MARKERS, HarmonyParser
from rawserve.text.tokenizer import Tokenizer
from tests.harmony_tokenizer import HARMONY_SPECIAL_IDS, harmony_template, write_harmony_tokenizer
from tests.text.test_parsers import accumulate, assert_openai_valid, run

ANALYSIS = "<|channel|>analysis<|message|>The user asks 2+2. Easy: 4.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "unit": "celsius"}<|call|>')
HARMONY = {"tool_parser": "openai", "use_tools": True}


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(write_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tok")))


def message(text: str, **options) -> dict:
    deltas = run([text], **{**HARMONY, **options})
    assert_openai_valid(deltas)
    return accumulate(deltas)


def test_analysis_is_reasoning_and_final_is_content():
    assert message(ANALYSIS + FINAL) == {"content": "2 + 2 = **4**.",
                                         "reasoning_content": "The user asks 2+2. Easy: 4.", "tool_calls": []}


def test_a_message_to_a_function_is_a_tool_call_in_either_header_order():
    expected = {"content": "", "reasoning_content": "The user asks 2+2. Easy: 4.",
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}]}
    assert message(ANALYSIS + CALL) == expected
    # The template writes the recipient before the channel (as the model may, straight after `<|start|>assistant`).
    assert message(ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                   '{"city": "Paris", "unit": "celsius"}<|call|>') == expected
    assert message(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": '
                   '"celsius"}<|call|>')["tool_calls"] == expected["tool_calls"]


def test_parallel_calls_count_up_and_a_preamble_is_content():
    text = ("<|channel|>commentary<|message|>Checking both cities.<|end|>" + CALL
            + "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
            + "<|start|>assistant<|channel|>commentary to=functions.ping<|message|><|call|>")
    got = message(text)
    assert got["content"] == "Checking both cities."
    assert got["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                                 {"name": "get_time", "arguments": "{}"}, {"name": "ping", "arguments": "{}"}]
    parser = OutputParser(**HARMONY)
    parser.feed(text, final=True)
    assert parser.has_tool_calls


def test_without_tools_a_call_stays_reasoning_and_builtin_tools_are_reasoning():
    assert message(ANALYSIS + CALL, use_tools=False) == {
        "content": "", "reasoning_content": 'The user asks 2+2. Easy: 4.{"city": "Paris", "unit": "celsius"}',
        "tool_calls": []}
    browse = "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>"
    assert message(browse) == {"content": "", "reasoning_content": '{"query": "x"}', "tool_calls": []}


def test_reasoning_parser_names_read_harmony_and_hermes_can_follow():
    check_parser_names("gpt_oss", "openai")
    check_parser_names("openai_gptoss", "openai")
    for name in ("gpt_oss", "openai_gptoss"):
        assert message(ANALYSIS + FINAL, reasoning=name, use_tools=False, tool_parser="hermes") == {
            "content": "2 + 2 = **4**.", "reasoning_content": "The user asks 2+2. Easy: 4.", "tool_calls": []}
    # The harmony reasoning parser with another tool parser: final's text goes through that parser.
    got = message(ANALYSIS + '<|start|>assistant<|channel|>final<|message|><tool_call>\n{"name": "f", '
                  '"arguments": {}}\n</tool_call><|return|>', reasoning="gpt_oss", tool_parser="hermes")
    assert got["tool_calls"] == [{"name": "f", "arguments": "{}"}] and got["content"] == ""


def test_output_without_harmony_is_content_and_a_cut_header_shows_nothing():
    assert message("Just text.")["content"] == "Just text."
    assert message("A line\nand <|end|> more")["content"] == "A line\nand  more"
    assert message("x" * 300)["content"] == "x" * 300
    assert message(ANALYSIS + "<|start|>assistant<|channel|>fin") == {
        "content": "", "reasoning_content": "The user asks 2+2. Easy: 4.", "tool_calls": []}
    # Cut inside a body (max_tokens): what came is kept, a marker's start included, as text.
    assert message("<|channel|>final<|message|>Hello <|")["content"] == "Hello <|"


def test_stray_text_between_messages_is_content_and_whitespace_is_not():
    assert message(ANALYSIS + "\n  " + FINAL)["content"] == "2 + 2 = **4**."
    assert message(ANALYSIS + "oops" + FINAL)["content"] == "oops2 + 2 = **4**."


TEXTS = [ANALYSIS + FINAL, ANALYSIS + CALL, "<|channel|>commentary<|message|>Wait.<|end|>" + CALL + CALL,
         "no harmony <|end|> at all\n", ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a <| b <|end"]


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_into_two_and_one_char_at_a_time_gives_the_same_message_and_no_marker(text):
    whole = message(text)
    pieces = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for chunks in pieces:
        deltas = run(chunks, **HARMONY)
        assert_openai_valid(deltas)
        assert accumulate(deltas) == whole, chunks
        for delta in deltas:
            for key in ("content", "reasoning_content"):
                shown = delta.get(key, "")
                # A marker never shows, whole or in pieces (the last case's "<|" and "<|end" are the model's text).
                assert not any(m in shown for m in MARKERS), (chunks, delta)
                assert not shown.endswith(("<|cha", "<|sta", "<|ret", "<|mes", "<|cal")), (chunks, delta)


def test_a_real_token_stream_with_special_tokens_skipped(harmony_tokenizer):
    """Token by token through the detokenizer as the server runs it: skip_special_tokens on, the markers kept for
    the parser (chat.start_chat's keep_special_tokens), then gone from the message."""
    tok = harmony_tokenizer
    text = ANALYSIS + CALL
    ids = tok.encode(text, add_special_tokens=False)
    assert {tok.token_to_id(m) for m in MARKERS} <= set(ids) | {200002, 200006}
    parser = OutputParser(**HARMONY)
    hidden = tuple(m for m in parser.markers if tok.token_to_id(m) in tok.special_ids_of(parser.markers))
    assert set(hidden) == set(MARKERS)
    detok = IncrementalDetokenizer(tok, True, keep_special=hidden)
    deltas = []
    for token_id in ids:
        deltas += parser.feed(detok.add([token_id]))
    deltas += parser.feed(detok.flush(), final=True)
    assert accumulate(deltas) == message(text)
    # Without keeping them the markers vanish before the parser: no call, one run of text.
    plain = IncrementalDetokenizer(tok, True)
    lost = OutputParser(**HARMONY)
    text_out = "".join(plain.add([i]) for i in ids) + plain.flush()
    assert accumulate(lost.feed(text_out, final=True))["tool_calls"] == []


def test_auto_picks_openai_for_the_harmony_template_only():
    assert tool_call_parser_for("auto", harmony_template()) == "openai"
    assert tool_call_parser_for("auto", "{{ messages }}<|im_start|>") == "hermes"
    assert tool_call_parser_for("hermes", harmony_template()) == "hermes"


def test_call_is_a_stop_id_wherever_return_is(tmp_path, harmony_tokenizer):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 200002}))
    assert GenerationDefaults.from_dir(tmp_path, harmony_tokenizer).eos_token_ids == (200002, 200012)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    assert GenerationDefaults.from_dir(tmp_path, harmony_tokenizer).eos_token_ids == (200002, 199999, 200012)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 199999}))
    assert GenerationDefaults.from_dir(tmp_path, harmony_tokenizer).eos_token_ids == (199999,)


def test_the_prompt_ends_where_the_parser_starts(harmony_tokenizer):
    """The template's generation prompt leaves the model inside an assistant header: the parser's first state."""
    prompt = render_chat(harmony_template(), [{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|start|>assistant")
    ids, tail = (harmony_tokenizer.encode(t, add_special_tokens=False) for t in (prompt, "<|start|>assistant"))
    assert ids[-len(tail):] == tail and tail[0] == HARMONY_SPECIAL_IDS["<|start|>"]
    assert HarmonyParser().feed("<|channel|>final<|message|>Hi!", final=True) == [("content", "Hi!")]
