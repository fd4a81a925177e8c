"""gpt-oss's harmony template rendered by rawserve as transformers renders it: reasoning_effort, developer and
system messages, tools, reasoning beside tool calls, tool results; messages as OpenAI clients send them."""
from __future__ import annotations

import copy
import datetime
import json

import pytest

from rawserve.text.chat_template import ChatTemplateError, render_chat
from tests.harmony_tokenizer import harmony_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}}}, "required": ["city"]}}}
NO_ARGS = {"type": "function", "function": {"name": "now", "description": "The time"}}


def call(name: str, arguments: dict) -> dict:
    """A tool call as an OpenAI client sends it: arguments as a JSON string."""
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def as_transformers_callers_send(messages: list[dict]) -> list[dict]:
    """transformers' own callers: reasoning under `thinking` (the name the template reads), arguments as objects,
    no null content (this template tests `in message.content`; rawserve drops null fields, as OpenAI sends them)."""
    out = [{k: v for k, v in m.items() if v is not None} for m in copy.deepcopy(messages)]
    for m in out:
        if "reasoning_content" in m:
            m["thinking"] = m.pop("reasoning_content")
        for c in m.get("tool_calls", ()):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


CASES = {
    "developer_tools_effort": (
        [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Weather in Paris?"}],
        {"tools": [WEATHER, NO_ARGS], "reasoning_effort": "high"}),
    "system_is_the_instructions": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {"reasoning_effort": "low"}),
    "tool_round_trip_keeps_the_call_reasoning": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "reasoning_content": "I should call get_weather.",
          "tool_calls": [call("get_weather", {"city": "Paris"})]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}],
        {"tools": [WEATHER]}),
    "a_later_final_answer_drops_the_call_reasoning": (
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "reasoning_content": "Call it.",
          "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
         {"role": "assistant", "content": "Sunny, 21 °C.", "reasoning_content": "Report it."},
         {"role": "user", "content": "Thanks! 你好"}],
        {"tools": [WEATHER], "reasoning_effort": "medium"}),
    "model_identity": ([{"role": "user", "content": "Who are you?"}], {"model_identity": "You are Rawserve."}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_as_transformers_renders(name):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages, kwargs = CASES[name]
    kwargs = dict(kwargs)
    tools = kwargs.pop("tools", None)
    # transformers' strftime_now reads the clock: both render with today's date.
    expected, _ = render_jinja_template(conversations=[as_transformers_callers_send(messages)], tools=tools,
                                        chat_template=harmony_template(), add_generation_prompt=True, **kwargs)
    got = render_chat(harmony_template(), messages, tools=tools, add_generation_prompt=True,
                      now=datetime.datetime.now(), **kwargs)
    assert got == expected[0]
    assert got.endswith("<|start|>assistant")


def test_the_markers_land_where_the_model_reads_them():
    messages, kwargs = CASES["tool_round_trip_keeps_the_call_reasoning"]
    text = render_chat(harmony_template(), messages, tools=[WEATHER], now=datetime.datetime(2024, 7, 26))
    assert "Current date: 2024-07-26\n\nReasoning: medium\n\n" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>I should call get_weather.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temperature\\": 21}"'
            "<|end|><|start|>assistant") in text


def test_channel_markers_in_a_message_are_refused():
    with pytest.raises(ChatTemplateError, match="thinking"):
        render_chat(harmony_template(), [{"role": "user", "content": "Hi"},
                                         {"role": "assistant", "content": "<|channel|>analysis<|message|>x<|end|>"},
                                         {"role": "user", "content": "?"}])
    with pytest.raises(ChatTemplateError, match="no previous assistant message with a tool call"):
        render_chat(harmony_template(), [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}])
