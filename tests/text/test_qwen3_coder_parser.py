"""The qwen3_coder tool parser (Qwen3.5 / Qwen3-Coder's XML form): whole and streamed at every split, values typed
by their schema with strings kept raw, several calls, text before them, malformed and cut-off blocks; the
template round trip (arguments rendered back as a mapping, then read again) and the parser a template implies."""
from __future__ import annotations

import datetime
import json

import pytest

from rawserve.text.chat_template import render_chat
from rawserve.text.defaults import tool_call_parser_for
from rawserve.text.parsers import OutputParser
from rawserve.text.parsers.qwen3_coder import convert_value
from tests.conftest import fixture_path

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
        "hot": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": ["string", "null"]}, "code": {"type": "string"}}},
    "ping": None,
}
SAMPLE = ("Let me look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo \"centro\"\n"
          "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=hot>\n"
          "True\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n['x', 'y']\n"
          "</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=code>\n\nif a </parameter> b:\n"
          "    print(1)\n\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n</function>\n"
          "</tool_call>")
SAMPLE_ARGS = [("get_weather", {"city": 'São Paulo "centro"', "days": 3, "ratio": 0.5, "hot": True,
                                "opts": {"a": [1, 2]}, "tags": ["x", "y"], "note": None,
                                "code": "\nif a </parameter> b:\n    print(1)\n"}),
               ("ping", {})]


def run(chunks: list[str], tools=TOOLS, reasoning: str | None = None) -> list[dict]:
    parser = OutputParser(reasoning, True, tool_parser="qwen3_coder", tools=tools)
    deltas = []
    for k, chunk in enumerate(chunks):
        deltas += parser.feed(chunk, final=k == len(chunks) - 1)
    return deltas


def fold(deltas: list[dict]) -> tuple[str, str, list[tuple[str, str]]]:
    """(content, reasoning, [(name, arguments text)]); checks each call's first delta is OpenAI's header."""
    content = reasoning = ""
    calls: list[list[str]] = []
    for delta in deltas:
        assert delta, "no empty deltas"
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["id"].startswith("call_") and call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            else:
                assert call["index"] == len(calls) - 1 and set(call["function"]) == {"arguments"}
                calls[-1][1] += call["function"]["arguments"]
    return content, reasoning, [(name, args) for name, args in calls]


def expected_calls(pairs) -> list[tuple[str, str]]:
    return [(name, json.dumps(args, ensure_ascii=False)) for name, args in pairs]


def test_whole_output_gives_content_then_typed_calls():
    content, _, calls = fold(run([SAMPLE]))
    assert content == "Let me look that up."
    assert calls == expected_calls(SAMPLE_ARGS)


def test_every_split_into_two_deltas_and_one_character_deltas_give_the_same_message():
    whole = fold(run([SAMPLE]))
    for cut in range(1, len(SAMPLE)):
        assert fold(run([SAMPLE[:cut], SAMPLE[cut:]])) == whole, cut
    assert fold(run(list(SAMPLE))) == whole


def test_a_string_value_streams_before_its_closing_tag():
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    parser = OutputParser(None, True, tool_parser="qwen3_coder", tools=TOOLS)
    deltas = parser.feed(head)
    assert fold(deltas)[2] == [("get_weather", '{"city": "Par')]
    more = parser.feed("is\n")  # the newline may be the markup's, before </parameter>: held back
    assert fold(deltas + more)[2] == [("get_weather", '{"city": "Paris')]
    rest = parser.feed("</parameter>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>", final=True)
    assert fold(deltas + more + rest)[2] == [("get_weather", '{"city": "Paris", "days": 4}')]


@pytest.mark.parametrize("schema,raw,value", [
    ({"type": "string"}, "123", "123"),  # strings are never JSON-parsed
    ({"type": "string"}, '{"a": 1}', '{"a": 1}'),
    ({"type": "string"}, "null", "null"),
    ({"type": "string"}, "  spaced  ", "  spaced  "),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, "-7 ", -7),
    ({"type": "integer"}, "4.0", 4),
    ({"type": "integer"}, "many", "many"),  # not one: the raw text, for the client to see
    ({"type": "number"}, "2.5e3", 2500.0),
    ({"type": "number"}, "3", 3),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "True", True),
    ({"type": "object"}, '{"k": [1, null]}', {"k": [1, None]}),
    ({"type": "object"}, "{'k': True}", {"k": True}),
    ({"type": "array"}, "[1, 2]", [1, 2]),
    ({"type": "array"}, "{'k': 1}", "{'k': 1}"),  # an object is no array
    ({"type": "integer"}, "null", None),
    ({"type": ["string", "null"]}, "None", None),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "5", 5),
    ({"enum": [1, 2, 3]}, "2", 2),
    ({"enum": ["a", "b"]}, "a", "a"),
    ({"$ref": "#/$defs/n"}, "8", 8),
    (None, "17", "17"),  # a parameter the schema does not list stays text
    ({}, "true", "true"),
])
def test_values_take_the_type_their_schema_declares(schema, raw, value):
    root = {"$defs": {"n": {"type": "integer"}}}
    got = convert_value(raw, schema, root)
    assert got == value and type(got) is type(value)


def test_only_one_newline_each_side_belongs_to_the_markup():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n\n two \n\n</parameter>\n<parameter=b>x</parameter>\n" \
           "</function>\n</tool_call>"
    assert fold(run([text], tools={}))[2] == [("f", json.dumps({"a": "\n two \n", "b": "x"}))]


def test_an_unknown_function_keeps_every_value_as_text():
    text = "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    assert fold(run([text]))[2] == [("other", '{"n": "5"}')]


def test_text_between_and_after_calls_and_whitespace_next_to_them():
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    content, _, calls = fold(run([f"  First.\n\n{call}\n\n{call}\nDone."]))
    assert content == "  First.\n\n\n\n\nDone." and len(calls) == 2  # as the hermes parser keeps it
    assert fold(run(["Just text\n\n  "])) == ("Just text\n\n  ", "", [])


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot a call\n</tool_call> after",
    "<tool_call>\n<function={{ tool.name }}>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather",
    "<tool_call>\n<function=get_weather>",
    "a <function=x y> b",
])
def test_a_block_that_is_no_call_is_content_tags_included(text):
    assert fold(run([text])) == (text, "", [])
    assert fold(run(list(text))) == (text, "", [])


def test_a_call_cut_short_closes_its_object_with_the_text_it_has():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo"
    assert fold(run([text]))[2] == [("get_weather", '{"city": "Ro"}')]
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n1"
    assert fold(run([text]))[2] == [("get_weather", '{"days": 1}')]
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<param"
    assert fold(run([text]))[2] == [("get_weather", '{"days": 2}')]


def test_a_missing_closing_parameter_tag_ends_at_the_function_end():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>"
    assert fold(run([text]))[2] == [("get_weather", '{"city": "Oslo"}')]


def test_a_malformed_parameter_closes_the_call_and_is_content():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=bad\nkey>\n1\n" \
           "</parameter>\n</function>\n</tool_call>tail"
    for chunks in ([text], list(text)):
        content, _, calls = fold(run(chunks))
        assert calls == [("get_weather", '{"days": 2}')]
        assert content == "<parameter=bad\nkey>\n1\n</parameter>\n</function>tail"


def test_a_closing_parameter_tag_not_followed_by_markup_is_part_of_the_value():
    text = "<tool_call>\n<function=get_weather>\n<parameter=code>\na</parameter>b\n</parameter>\n</function>\n" \
           "</tool_call>"
    assert fold(run([text]))[2] == [("get_weather", json.dumps({"code": "a</parameter>b"}))]


def test_a_bare_function_block_without_tool_call_tags_is_a_call():
    text = "Sure.\n<function=ping>\n</function>"
    assert fold(run([text])) == ("Sure.", "", [("ping", "{}")])


def test_reasoning_then_calls_with_the_qwen3_reasoning_parser():
    text = "<think>\nWeather needs a tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n" \
           "</parameter>\n</function>\n</tool_call>"
    for chunks in ([text], list(text)):
        content, reasoning, calls = fold(run(chunks, reasoning="qwen3"))
        assert reasoning.strip() == "Weather needs a tool." and content == ""
        assert calls == [("get_weather", '{"days": 2}')]


def test_the_xml_form_is_chosen_from_the_template_unless_named():
    templates = fixture_path("chat_templates")
    qwen35 = (templates / "Qwen3.5-4B.jinja").read_text()
    assert tool_call_parser_for("auto", qwen35) == "qwen3_coder"
    assert tool_call_parser_for("auto", (templates / "Qwen3-Coder.jinja").read_text()) == "qwen3_coder"
    assert tool_call_parser_for("auto", (templates / "Qwen-Qwen3-0.6B.jinja").read_text()) == "hermes"
    assert tool_call_parser_for("auto", None) == "hermes"
    assert tool_call_parser_for("hermes", qwen35) == "hermes"
    assert tool_call_parser_for("qwen3_coder", None) == "qwen3_coder"


def test_history_arguments_sent_as_json_text_render_as_the_template_golden_and_parse_back():
    templates = fixture_path("chat_templates")
    template = (templates / "Qwen3.5-4B.jinja").read_text()
    case = json.loads((templates / "goldens" / "cases.json").read_text())["cases"]["tool_round_trip"]
    messages = json.loads(json.dumps(case["messages"]))
    arguments = messages[1]["tool_calls"][0]["function"]["arguments"]
    messages[1]["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments)  # as an OpenAI client sends it
    text = render_chat(template, messages, tools=case["tools"], add_generation_prompt=True,
                       now=datetime.datetime(2024, 7, 26), date_string="26 Jul 2024")
    assert text == (templates / "goldens" / "Qwen3.5-4B" / "tool_round_trip.txt").read_text()
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
    assert fold(run([turn], tools=tools))[2] == [("get_weather", json.dumps(arguments))]
