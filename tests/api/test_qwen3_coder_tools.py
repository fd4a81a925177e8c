"""Tool calls in the XML form through a live server with the openai SDK: a tiny random Qwen3 with the real
tokenizer and Qwen3.5's chat template, so qwen3_coder is chosen from the template alone. Forced calls (required,
named, parallel_tool_calls false), streamed and not, give arguments valid against their schema; a history with an
assistant's tool_calls (arguments as JSON text) and a tool result renders them back as <parameter=…> blocks."""
from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread
from tests.conftest import fixture_path

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "qwen35-template"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
ALERTS = {"type": "function", "function": {
    "name": "get_alerts", "parameters": {"type": "object", "properties": {
        "region": {"type": "string", "enum": ["north", "south"]},
        "levels": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "maxItems": 3}},
        "required": ["region", "levels"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ALERTS)}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
# A random model thinks at random: no thinking, so the forced call starts at once.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(qwen3_real_tokenizer_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen35-template") / "model"
    shutil.copytree(qwen3_real_tokenizer_dir, directory)
    shutil.copy(fixture_path("chat_templates", "Qwen3.5-4B.jinja"), directory / "chat_template.jinja")
    srv = ServerThread(EngineConfig(model_dir=str(directory), device="cpu", num_kv_blocks=256, max_model_len=2048),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_template_alone_chooses_the_xml_parser(server):
    assert server.app.context.tool_call_parser == "qwen3_coder"


def check(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_have_arguments_valid_for_their_schema(client):
    for seed in range(3):
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, ALERTS], seed=seed,
                                                tool_choice="required", max_tokens=400, extra_body=NO_THINKING,
                                                logprobs=True).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        written = "".join(entry.token for entry in choice.logprobs.content)  # what the model wrote: the XML form
        assert "<function=" in written and "</function>" in written and '{"name"' not in written
        for call in choice.message.tool_calls:
            check(call.function.name, call.function.arguments)


def test_streamed_required_calls_concatenate_to_valid_arguments(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, ALERTS], seed=5,
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=400,
                                            stream=True, extra_body=NO_THINKING)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            if delta.id is not None:  # the first delta of a call: id, type and name, no arguments yet
                assert delta.index not in calls and delta.type == "function" and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": delta.function.arguments or ""}
            else:
                assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    check(calls[0]["name"], calls[0]["arguments"])


def test_named_tool_choice_streamed_and_not_calls_that_function_once(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, ALERTS], seed=2, max_tokens=400,
                  tool_choice={"type": "function", "function": {"name": "get_alerts"}}, extra_body=NO_THINKING)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_alerts"
    check("get_alerts", call.function.arguments)
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.function.name] == ["get_alerts"]
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert streamed == call.function.arguments  # same seed: the stream folds to the whole response
    assert chunks[-1].choices[0].finish_reason == "stop"


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.base + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_an_assistant_tool_call_in_the_history_renders_as_parameters(client, server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2,
                                                                         "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    ids = post(server, "/tokenize", {"model": MODEL, "messages": history})["tokens"]
    prompt = post(server, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>") in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=5, seed=0,
                                           extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
