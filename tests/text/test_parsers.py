"""Output parsers: reasoning split, Hermes and Llama 3 tool calls, OpenAI-valid deltas, chunk invariance."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionChunk

from rawserve.text.chat_template import render_chat
from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.parsers import OutputParser, check_parser_names, prompt_opens_reasoning
from tests.conftest import fixture_path

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def run(text_chunks: list[str], **options) -> list[dict]:
    parser = OutputParser(**options)
    deltas = []
    for chunk in text_chunks:
        deltas += parser.feed(chunk, final=False)
    deltas += parser.feed("", final=True)
    return deltas


def assert_openai_valid(deltas: list[dict]) -> None:
    """Every delta parses as an OpenAI chunk; tool-call deltas have the first/later shapes."""
    seen: set[int] = set()
    for delta in deltas:
        assert delta and all(v != "" for k, v in delta.items() if k != "tool_calls")
        ChatCompletionChunk.model_validate({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        for call in delta.get("tool_calls", []):
            assert len(delta["tool_calls"]) == 1
            if call["index"] not in seen:
                seen.add(call["index"])
                assert set(call) == {"index", "id", "type", "function"} and CALL_ID.match(call["id"])
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                assert call["function"]["name"]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                assert call["function"]["arguments"]
    assert seen == set(range(len(seen))), "tool call indexes count up from 0"


def accumulate(deltas: list[dict]) -> dict:
    """What a client assembles from the stream (ids left out: they are random)."""
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    for delta in deltas:
        for key in ("content", "reasoning_content"):
            message[key] += delta.get(key, "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                message["tool_calls"].append({"name": call["function"]["name"], "arguments": ""})
            message["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return message


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


# ----- reasoning


@pytest.mark.parametrize("text, options, reasoning, content", [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", {"reasoning": "qwen3"}, "Let me think.",
     "The answer is 4."),
    ("Hello there", {"reasoning": "qwen3"}, "", "Hello there"),  # enable_thinking=False: no block at all
    ("Thinking...\n</think>\n\nDone", {"reasoning": "qwen3", "starts_in_reasoning": True}, "Thinking...", "Done"),
    ("<think>\nagain</think>ok", {"reasoning": "qwen3", "starts_in_reasoning": True}, "again", "ok"),
    ("Thinking...</think>Done", {"reasoning": "deepseek_r1"}, "Thinking...", "Done"),
    ("<think>never closed  ", {"reasoning": "qwen3"}, "never closed", ""),
    ("<think>a</think>b<think>c", {"reasoning": "qwen3"}, "a", "b<think>c"),
    ("  <thin", {"reasoning": "qwen3"}, "", "  <thin"),
    ("<think>x</think>", {}, "", "<think>x</think>"),  # no reasoning parser: all content
])
def test_reasoning_is_split_from_content(text, options, reasoning, content):
    for chunks in ([text], list(text)):
        deltas = run(chunks, **options)
        assert_openai_valid(deltas)
        message = accumulate(deltas)
        assert (message["reasoning_content"], message["content"]) == (reasoning, content)


def test_prompt_opening_think_is_detected_from_the_rendered_prompt():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_opens_reasoning("<think>old</think> ... <think>\n")


# ----- hermes tool calls


def hermes_block(name: str, args: dict, style: int = 0) -> str:
    if style == 1:
        body = json.dumps({"arguments": args, "name": name}, ensure_ascii=False)
    elif style == 2:
        body = json.dumps({"name": name, "arguments": args}, indent=2)
    else:
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_hermes_call_streams_name_first_then_argument_fragments():
    text = "Let me check.\n" + hermes_block("get_weather", {"city": "Paris", "unit": "celsius"})
    deltas = run(list(text), use_tools=True)
    assert_openai_valid(deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(calls) > 5  # the arguments arrived in many fragments, not at the end
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert accumulate(deltas)["content"] == "Let me check."


def test_many_hermes_calls_get_their_own_indexes_and_ids():
    text = "\n".join(hermes_block(f"tool{i}", {"i": i, "s": "é\"\\"}, style=i % 3) for i in range(3))
    deltas = run([text], use_tools=True)
    assert_openai_valid(deltas)
    message = accumulate(deltas)
    assert message["content"] == ""
    assert [c["name"] for c in message["tool_calls"]] == ["tool0", "tool1", "tool2"]
    assert [json.loads(c["arguments"]) for c in message["tool_calls"]] == [{"i": i, "s": "é\"\\"} for i in range(3)]
    ids = [d["tool_calls"][0]["id"] for d in deltas if "id" in d.get("tool_calls", [{}])[0]]
    assert len(set(ids)) == 3


def test_text_around_calls_is_content():
    text = "Sure." + hermes_block("f", {}) + "\nDone, " + hermes_block("g", {"a": [1]}) + " bye"
    message = accumulate(run(list(text), use_tools=True))
    assert message["content"] == "Sure.\nDone,  bye"  # whitespace between content is kept
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [("f", "{}"), ("g", '{"a": [1]}')]


@pytest.mark.parametrize("block", [
    "<tool_call>not json at all</tool_call>",
    "<tool_call>{'name': 'f', 'arguments': {}}</tool_call>",
    '<tool_call>{"name": "f", "arguments": {\'city\': 1}}</tool_call>',
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    '<tool_call>{"name": "f", "argu',  # cut off before the call could start
])
def test_malformed_json_inside_the_tags_falls_back_to_content(block):
    text = "Before " + block + " after"
    for chunks in ([text], list(text)):
        deltas = run(chunks, use_tools=True)
        assert_openai_valid(deltas)
        assert accumulate(deltas) == {"content": text, "reasoning_content": "", "tool_calls": []}


def test_a_call_broken_after_it_started_keeps_its_name_and_the_rest_is_content():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
    message = accumulate(run(list(text), use_tools=True))
    assert message["tool_calls"] == [{"name": "f", "arguments": '{"a": 1,'}]
    assert message["content"] == "}}"


def test_a_call_cut_off_by_the_end_of_the_stream_is_truncated_like_max_tokens():
    message = accumulate(run(['<tool_call>{"name": "f", "arguments": {"a": "long te'], use_tools=True))
    assert message["tool_calls"] == [{"name": "f", "arguments": '{"a": "long te'}]
    message = accumulate(run(['<tool_call>{"name": "f", "arguments": {"a": 1}}'], use_tools=True))
    assert message["tool_calls"] == [{"name": "f", "arguments": '{"a": 1}'}]


def test_arguments_given_as_a_json_string_or_missing_are_normalized():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    message = accumulate(run(list(text), use_tools=True))
    assert message["tool_calls"] == [{"name": "f", "arguments": '{"x": 1}'}, {"name": "g", "arguments": "{}"}]


# Qwen3's added tokens at Qwen3's ids: the tokenizer built in tests/conftest.py and, where present, the real one.
@pytest.mark.parametrize("name", ["large_vocab_tokenizer", "qwen3_tokenizer"])
def test_reasoning_then_tool_call_with_the_real_qwen3_tokens(request, name):
    qwen3_tokenizer = request.getfixturevalue(name)
    text = ("<think>\nThe user wants weather in 東京 🌧.\n</think>\n\n"
            + hermes_block("get_weather", {"city": "東京", "unit": "celsius"}))
    ids = qwen3_tokenizer.encode(text)
    assert 151657 in ids and 151667 in ids  # <tool_call> and <think> are single added tokens
    detok = IncrementalDetokenizer(qwen3_tokenizer, skip_special_tokens=True)
    parser = OutputParser("qwen3", True)
    deltas = [d for i in ids for d in parser.feed(detok.add([i]))] + parser.feed(detok.flush(), final=True)
    assert_openai_valid(deltas)
    message = accumulate(deltas)
    assert message["reasoning_content"] == "The user wants weather in 東京 🌧."
    assert message["content"] == ""
    assert message["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "東京", "unit": "celsius"}'}]
    assert parser.has_tool_calls


# ----- llama 3 JSON tool calls


def test_llama3_json_calls_with_python_tag_and_separators():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {}}')
    for chunks in ([text], list(text)):
        deltas = run(chunks, use_tools=True, tool_parser="llama3_json")
        assert_openai_valid(deltas)
        assert accumulate(deltas) == {"content": "", "reasoning_content": "", "tool_calls": [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]}


@pytest.mark.parametrize("text", ["The weather is fine.", '{"answer": 42}', " {\"name\": \"x\"",
                                  "<|python_tag|>print(1)",
                                  '\n{"name": "f", "parameters": {\'a\': 1}}'])
def test_llama3_json_output_that_is_not_a_call_is_content(text):
    for chunks in ([text], list(text)):
        deltas = run(chunks, use_tools=True, tool_parser="llama3_json")
        assert accumulate(deltas) == {"content": text, "reasoning_content": "", "tool_calls": []}


def test_llama3_json_text_after_the_calls_is_content():
    message = accumulate(run(['{"name": "f", "parameters": {"a": 1}}\nThat is all.'], use_tools=True,
                             tool_parser="llama3_json"))
    assert message["tool_calls"] == [{"name": "f", "arguments": '{"a": 1}'}] and message["content"] == "That is all."


# ----- registry and lifecycle


def test_unknown_parser_names_list_the_known_ones():
    with pytest.raises(ValueError, match="known: hermes, llama3_json, openai, qwen3_coder"):
        OutputParser(None, True, tool_parser="mistral")
    with pytest.raises(ValueError, match="known: deepseek_r1, gpt_oss, openai_gptoss, qwen3"):
        OutputParser("granite", False)
    check_parser_names("qwen3", "llama3_json")


def test_tools_off_leaves_tags_as_content_and_text_after_final_is_refused():
    parser = OutputParser(None, False)
    assert parser.feed(hermes_block("f", {}), final=True) == [{"content": hermes_block("f", {})}]
    assert parser.feed("", final=True) == []
    with pytest.raises(ValueError, match="after the final"):
        parser.feed("more")


# ----- chunk-boundary fuzzing

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)
PLAIN = st.text(alphabet="ab yz.\n", max_size=8)
NOISE = st.sampled_from(["<tool", "<tool_call>oops</tool_call>", "</tool_call>", "<think>", "</think>", "{",
                         "}", '"', "<|python_tag|>", ";", "<tool_call>{\"name\": 1}</tool_call>", "\n\n"])


@st.composite
def outputs(draw) -> str:
    parts = []
    if draw(st.booleans()):
        parts.append("<think>" + draw(PLAIN) + draw(st.sampled_from(["</think>", "</think>\n\n", ""])))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(PLAIN))
        elif kind == 1:
            parts.append(hermes_block(draw(NAMES), draw(ARGS), draw(st.integers(0, 2))))
        elif kind == 2:
            call = json.dumps({"name": draw(NAMES), "parameters": draw(ARGS)})
            parts.append(call + draw(st.sampled_from(["; ", ""])))
        else:
            parts.append(draw(NOISE))
    text = "".join(parts)
    if draw(st.booleans()):
        text = text[:draw(st.integers(0, len(text)))]  # the stream may stop anywhere (max_tokens)
    return text


@pytest.mark.parametrize("options", [
    {"use_tools": True},
    {"reasoning": "qwen3", "use_tools": True},
    {"reasoning": "deepseek_r1", "use_tools": True},
    {"use_tools": True, "tool_parser": "llama3_json"},
    {"reasoning": "qwen3"},
])
@settings(max_examples=100, deadline=None)
@given(text=outputs(), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_every_chunking_gives_the_same_message(options, text, cuts):
    whole = run([text], **options)
    pieces = run(split(text, cuts), **options)
    chars = run(list(text), **options)
    assert_openai_valid(pieces)
    assert accumulate(pieces) == accumulate(whole) == accumulate(chars)


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, ARGS, st.integers(0, 2)), min_size=1, max_size=3),
       texts=st.lists(st.text(alphabet="abc xyz.,", max_size=8).map(str.strip), min_size=4, max_size=4),
       cuts=st.lists(st.integers(0, 600), max_size=15))
def test_well_formed_calls_round_trip_exactly(calls, texts, cuts):
    text = texts[0] + "".join(hermes_block(n, a, s) + texts[i + 1] for i, (n, a, s) in enumerate(calls))
    deltas = run(split(text, cuts), use_tools=True)
    assert_openai_valid(deltas)
    message = accumulate(deltas)
    assert message["content"] == "".join(texts[:len(calls) + 1])
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [(n, a) for n, a, _ in calls]


@pytest.mark.parametrize("template_name, kwargs, opens", [
    ("Qwen-Qwen3-0.6B", {}, False),                        # the model writes <think> itself
    ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, False),  # the prompt closes an empty block
    ("Qwen-QwQ-32B", {"enable_thinking": True}, True),     # the prompt opens <think>
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {"enable_thinking": True}, True),
])
def test_rendered_prompt_tells_the_parser_where_the_output_starts(template_name, kwargs, opens):
    template = fixture_path("chat_templates", f"{template_name}.jinja").read_text(encoding="utf-8")
    prompt = render_chat(template, [{"role": "user", "content": "2+2?"}], **kwargs)
    assert prompt_opens_reasoning(prompt) is opens
    output = {"Qwen-Qwen3-0.6B": "<think>\nadd\n</think>\n\n4"}.get(template_name, "add\n</think>\n\n4")
    if kwargs.get("enable_thinking") is False:
        output = "4"
    message = accumulate(run(list(output), reasoning="qwen3", starts_in_reasoning=prompt_opens_reasoning(prompt)))
    assert (message["reasoning_content"], message["content"]) == ("" if output == "4" else "add", "4")
