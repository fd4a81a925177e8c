"""Tool-call and reasoning markers that the checkpoint's tokenizer makes special tokens, through a live server and
the openai SDK: forced calls (tool_choice required or named), calls and reasoning forced by a grammar of the special
tokens (a random-weight model emits neither by itself) come back as tool_calls, function_call items and
reasoning, streamed and not, and no marker reaches the message text."""
from __future__ import annotations

import json

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread
from tests.text.test_detokenizer_special import MARKERS, special_markers_tokenizer

openai = pytest.importorskip("openai")

MODEL = "special-markers"
CITIES = ["Paris", "Oslo"]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                          "required": ["city"], "additionalProperties": False}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # the forced call starts at once
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
# An "auto" call and a reasoning block, emitted by way of the special tokens themselves.
CALL_GRAMMAR = 'root ::= <tool_call> "\\n" ' + json.dumps(CALL_TEXT) + ' "\\n" </tool_call>'
THINK_GRAMMAR = 'root ::= <think> "first plan, then answer" </think> "\\n\\n" ("yes" | "no")'
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, large_vocab_tokenizer_dir):
    from tests.conftest import tiny_qwen3_with_tokenizer

    tokenizer_dir = special_markers_tokenizer(tmp_path_factory.mktemp("special-markers-tok"),
                                              large_vocab_tokenizer_dir)
    directory = tiny_qwen3_with_tokenizer(tmp_path_factory.mktemp("special-markers-model"), tokenizer_dir)
    srv = ServerThread(EngineConfig(model_dir=str(directory), device="cpu", num_kv_blocks=128, max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[],
                                    reasoning_parser="qwen3"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _no_markers(text: str | None) -> None:
    assert not any(marker in (text or "") for marker in MARKERS), text


def _streamed_message(stream) -> tuple[str, str, list[list[str]], str | None]:
    """(content, reasoning, [[name, arguments]], finish_reason) folded from chat chunks."""
    content = reasoning = ""
    calls: list[list[str]] = []
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                calls.append([call.function.name, ""])
            calls[-1][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather" and json.loads(arguments)["city"] in CITIES


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_chat_call_is_a_tool_call_streamed_and_not(client, tool_choice):
    named = isinstance(tool_choice, dict)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=tool_choice,
                                           parallel_tool_calls=False, max_tokens=200, temperature=0,
                                           extra_body=NO_THINKING)
    choice = reply.choices[0]
    assert choice.finish_reason == ("stop" if named else "tool_calls")
    [call] = choice.message.tool_calls
    _check_call(call.function.name, call.function.arguments)
    assert choice.message.content is None
    content, reasoning, calls, finish = _streamed_message(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0,
        parallel_tool_calls=False, stream=True, extra_body=NO_THINKING))
    assert finish == ("stop" if named else "tool_calls") and len(calls) == 1
    _check_call(*calls[0])
    assert content == "" and reasoning == ""


def test_an_auto_chat_call_in_special_markers_is_a_tool_call(client):
    body = dict(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS, max_tokens=200,
                extra_body={"guided_grammar": CALL_GRAMMAR, **NO_THINKING})
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    content, _, calls, finish = _streamed_message(client.chat.completions.create(**body, stream=True))
    assert (content, calls, finish) == ("", [["get_weather", '{"city": "Oslo"}']], "tool_calls")


def test_reasoning_in_special_markers_is_split_out(client):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=40, extra_body={"guided_grammar": THINK_GRAMMAR})
    message = client.chat.completions.create(**body).choices[0].message
    assert message.reasoning_content == "first plan, then answer" and message.content in ("yes", "no")
    content, reasoning, _, finish = _streamed_message(client.chat.completions.create(**body, stream=True))
    assert (reasoning, finish) == ("first plan, then answer", "stop") and content in ("yes", "no")


def test_without_tools_or_skipping_the_markers_are_plain_special_tokens(client):
    # No tools: the hermes tags are no parser's markers, so skip_special_tokens drops them like any special.
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                           extra_body={"guided_grammar": CALL_GRAMMAR, **NO_THINKING})
    assert reply.choices[0].message.content == f"\n{CALL_TEXT}\n" and not reply.choices[0].message.tool_calls
    # skip_special_tokens false: the client asked to see special tokens; a parsed call still consumes its tags.
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, tools=CHAT_TOOLS,
                                           extra_body={"guided_grammar": CALL_GRAMMAR, "skip_special_tokens": False,
                                                       **NO_THINKING})
    assert reply.choices[0].finish_reason == "tool_calls" and len(reply.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_responses_call_is_a_function_call_item_streamed_and_not(client, tool_choice):
    body = dict(model=MODEL, input="Weather in Oslo?", tools=RESPONSES_TOOLS, tool_choice=tool_choice,
                max_output_tokens=200, temperature=0, parallel_tool_calls=False, reasoning={"effort": "minimal"})
    response = client.responses.create(**body)
    assert response.status == "completed"
    [item] = response.output
    assert item.type == "function_call"
    _check_call(item.name, item.arguments)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    assert [i.type for i in final.output] == ["function_call"]
    _check_call(final.output[0].name, final.output[0].arguments)


def test_responses_auto_call_and_reasoning_in_special_markers(client):
    response = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=RESPONSES_TOOLS,
                                       max_output_tokens=200, reasoning={"effort": "minimal"},
                                       extra_body={"guided_grammar": CALL_GRAMMAR})
    assert [(i.type, i.name, i.arguments) for i in response.output] == [
        ("function_call", "get_weather", '{"city": "Oslo"}')]
    with client.responses.stream(model=MODEL, input="Is it sunny?", max_output_tokens=40,
                                 extra_body={"guided_grammar": THINK_GRAMMAR}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].summary[0].text == "first plan, then answer" and final.output_text in ("yes", "no")
    assert "response.reasoning_summary_text.delta" in kinds
    _no_markers(final.output_text)
