"""Structured output through the real server (engine core in a spawned process) with the official openai SDK,
on a random-weight Qwen3 with a Qwen3-shaped tokenizer built in tests/conftest.py (no fixtures needed): parse()
with a Pydantic model, json_object, forced and named tool calls streamed and not, GBNF, regex and choice; bad
constraints get a 400 naming the field."""
from __future__ import annotations

import json
import multiprocessing
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread, raw

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "qwen3-tiny"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12,
                                                                             "maximum": 14}},
                                       "required": ["tz"]}}}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]
    temperature: int = pydantic.Field(ge=-50, le=60)


@pytest.fixture(scope="module")
def server(large_vocab_model_dir):
    srv = ServerThread(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=512,
                                    max_model_len=2048),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process", api_key=[]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_gives_a_valid_object(client):
    for seed in range(4):
        completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Weather,
                                                   seed=seed, max_tokens=80)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        parsed = choice.message.parsed
        assert isinstance(parsed, Weather) and len(parsed.city) <= 8 and -50 <= parsed.temperature <= 60


def test_json_object_is_an_object_and_streams_the_same_way(client):
    schema_free = {"type": "json_object"}
    for seed in range(2):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=schema_free,
                                               seed=seed, max_tokens=100, temperature=0.7)
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, seed=0, max_tokens=100,
                                            temperature=0.7, response_format=schema_free)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=0, max_tokens=100, temperature=0.7,
                                           response_format=schema_free)
    assert streamed == again.choices[0].message.content


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        tool = WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL
        jsonschema.validate(arguments, tool["function"]["parameters"])


def test_required_tool_calls_parse_streamed_and_not(client):
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                               tool_choice="required", seed=seed, max_tokens=300)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                            tool_choice="required", seed=1, max_tokens=300, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["name"] in ("get_weather", "get_time")
        json.loads(entry["arguments"])


def test_parallel_tool_calls_false_gives_exactly_one_call(client):
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                               tool_choice="required", parallel_tool_calls=False, seed=seed,
                                               max_tokens=300)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_named_tool_choice_calls_only_that_function_and_finishes_with_stop(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], seed=3, max_tokens=300,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "stop"
            check_calls(choice.message.tool_calls, {"get_time"})
            assert len(choice.message.tool_calls) == 1
        else:
            chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
            names = [d.function.name for c in chunks for d in c.choices[0].delta.tool_calls or () if d.function.name]
            assert names == ["get_time"] and chunks[-1].choices[0].finish_reason == "stop"


def test_forced_call_cut_by_max_tokens_is_length_with_no_calls(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=4)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls == []


def test_gbnf_regex_and_choice_on_completions_and_chat(client):
    grammar = 'root ::= "answer: " ("yes" | "no") " (" [0-9] [0-9]? "%)"'
    for seed in range(3):
        text = client.completions.create(model=MODEL, prompt="Q:", max_tokens=40, seed=seed,
                                         extra_body={"guided_grammar": grammar}).choices[0].text
        assert re.fullmatch(r"answer: (yes|no) \([0-9][0-9]?%\)", text), text
    pattern = r"[A-Z][a-z]{2,5} \d{2}"
    stream = client.completions.create(model=MODEL, prompt="Q:", max_tokens=40, stream=True, seed=1,
                                       extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, "".join(c.choices[0].text for c in stream if c.choices))
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, seed=2,
                                            extra_body={"structured_outputs": {"choice": ["sunny", "rain ☔"]}})
    assert choice.choices[0].message.content in ("sunny", "rain ☔")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "patternProperties": {}}}}}}},
     "response_format.json_schema.schema", "patternProperties"),
    ({"guided_regex": "(?=a)b"}, "guided_regex", "lookahead"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_grammar": "root ::= root \"a\""}, "guided_grammar", "left-recursive"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "Only one"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"guided_choice": []}, "guided_choice", "list"),
    ({"guided_grammar": 'root ::= <[99999999]> "x"'}, "guided_grammar", "outside the vocabulary"),
    ({"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"not": {}}}}}}], "tool_choice": "required"},
     "tools.1.function.parameters", "'not'"),
    ({"guided_regex": "(.{0,5000}){0,60}"}, "guided_regex", "too large"),
])
def test_bad_constraints_get_a_400_naming_the_field(server, body, param, words):
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **body}
    status, data = raw(server, "POST", "/v1/chat/completions", json.dumps(payload).encode(),
                       "content-type: application/json\r\n")
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["param"] == param and words.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"


def test_a_bad_schema_does_not_disturb_a_running_stream(client, server):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=60,
                                            extra_body={"ignore_eos": True})
    first = next(stream)
    status, _ = raw(server, "POST", "/v1/chat/completions",
                    json.dumps({"model": MODEL, "messages": MESSAGES, "guided_regex": "(?<=x)"}).encode(),
                    "content-type: application/json\r\n")
    assert status == 400
    rest = [c for c in stream if c.choices]
    assert first.choices and rest, "the stream ended early"
    assert rest[-1].choices[0].finish_reason == "length"


def post_timed(server, path: str, body: dict) -> tuple[int, dict, float]:
    start = time.monotonic()
    status, data = raw(server, "POST", path, json.dumps(body).encode(), "content-type: application/json\r\n")
    return status, json.loads(data), time.monotonic() - start


def test_a_20000_branch_pattern_is_refused_at_once_and_holds_up_no_other_compile(server):
    # 200 KB of pattern: it compiled for 48 s before its refusal, and every other new grammar waited behind it.
    big = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "guided_json": {
        "type": "string", "pattern": "|".join(f"word{i:05d}" for i in range(20_000))}}
    small = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[xy]{3}"}
    with ThreadPoolExecutor(2) as pool:  # both compile workers started, so start-up is not what is timed
        warm = [pool.submit(post_timed, server, "/v1/completions", {**small, "guided_regex": f"[ab]{{{n}}}"})
                for n in (1, 2)]
        assert [f.result()[0] for f in warm] == [200, 200]
        refused = pool.submit(post_timed, server, "/v1/chat/completions", big)
        time.sleep(0.1)
        status, reply, took_s = post_timed(server, "/v1/completions", small)
        assert status == 200 and re.fullmatch("[xy]{3}", reply["choices"][0]["text"]) and took_s < 10, took_s
        status, reply, took_s = refused.result()
    assert status == 400 and took_s < 10, (took_s, reply)
    assert reply["error"]["param"] == "guided_json" and "grammar nodes" in reply["error"]["message"]
    assert len(reply["error"]["message"]) < 1000
    status, reply, _ = post_timed(server, "/v1/completions", {**small, "guided_regex": "(yes|no)!"})
    assert status == 200 and reply["choices"][0]["text"] in ("yes!", "no!")


def compile_workers() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name == "rawserve-compile"}


def test_grammars_compile_in_workers_a_late_one_is_replaced_and_all_stop_with_the_server(large_vocab_model_dir):
    # One server for both: grammars compile in worker processes that stop with the server; a compile past its
    # deadline is a 400 and its worker is replaced.
    srv = ServerThread(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=64,
                                    max_model_len=512),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[],
                                    guided_compile_timeout_s=0.3, guided_compile_workers=1))
    before_server = {p.pid for p in multiprocessing.active_children()}  # the module's server has workers here too
    try:
        small = {"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[ab]{4}"}
        status, reply, _ = post_timed(srv, "/v1/completions", small)
        assert status == 200 and re.fullmatch("[ab]{4}", reply["choices"][0]["text"])
        workers = [p for p in multiprocessing.active_children() if p.pid not in before_server]
        assert workers and all(p.is_alive() for p in workers)
        before = compile_workers()
        # Within every limit (249,977 automaton states), and about a second of compiling: past the deadline. (The
        # empty alternative keeps every copy built: a run of copies that each take a byte is mostly virtual.)
        slow = {**small, "guided_regex": "(?:[一丂丄丆丈三上下丐丒专且]|){0,9999}"}
        status, reply, took_s = post_timed(srv, "/v1/completions", slow)
        assert status == 400 and reply["error"]["param"] == "guided_regex", reply
        assert "did not compile within 0.3 s" in reply["error"]["message"] and took_s < 10
        after = compile_workers()
        assert len(before - after) == 1 and len(after - before) == 1  # killed, and another started in its place
        status, reply, _ = post_timed(srv, "/v1/completions", {**small, "guided_regex": "[cd]{4}"})
        assert status == 200 and re.fullmatch("[cd]{4}", reply["choices"][0]["text"])
        workers = [p for p in multiprocessing.active_children() if p.pid not in before_server]
    finally:
        srv.stop()
    for p in workers:
        p.join(30)
        assert not p.is_alive()
