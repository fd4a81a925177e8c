"""The Responses API (POST /v1/responses, stored responses) through the official openai SDK, raw sockets and the
OpenAI Agents SDK, on the random-weight demo model: outputs are random text, so the tests bound them (max tokens,
schemas with enums and maxLength) and assert structure, event order and bytes, not content."""
from __future__ import annotations

import json
import re
import socket
from typing import Literal

import orjson
import pytest

from rawserve.api.protocol import ChatMessage
from rawserve.api.response_store import ResponseStore, StoredResponse
from rawserve.api.responses import OutputItems, chat_messages, input_items
from rawserve.config import EngineConfig, ServerConfig
from tests.api.demo_server import dechunk
from tests.api.test_openai_server import ServerThread, raw, wait_idle

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MODEL = "demo"
KEY, OTHER_KEY = "key-a", "key-b"
AUTH = f"authorization: Bearer {KEY}\r\n"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    from rawserve.demo_model import ensure_demo_model

    srv = ServerThread(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=256,
                                    max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[KEY, OTHER_KEY],
                                    responses_store_max=64))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, body: dict, key: str = KEY) -> tuple[int, bytes]:
    return raw(server, "POST", "/v1/responses", orjson.dumps(body), f"authorization: Bearer {key}\r\n")


def test_string_input_gives_a_response_object_with_usage(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0)
    assert re.fullmatch(r"resp_[0-9a-f]{32}", r.id) and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == message.content[0].text
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0


def test_responses_and_chat_give_the_same_tokens_at_temperature_zero(server, client):
    chat_client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    call_args = '{"city": "Paris"}'
    chat = chat_client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, tools=[
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": call_args}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    resp = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, instructions="Be brief.",
                                   tools=[WEATHER], input=[
                                       {"role": "user", "content": [{"type": "input_text",
                                                                     "text": "Weather in Paris?"}]},
                                       {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                        "arguments": call_args},
                                       {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    text = "".join(item.content[0].text for item in resp.output if item.type == "message")
    assert text.strip() == (chat.choices[0].message.content or "").strip()


def test_required_and_named_tool_choice_give_function_calls(client):
    time_tool = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["tz"]}}
    r = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER, time_tool], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120, extra_body={"seed": 1})
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name in ("get_weather", "get_time")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments), dict)
    named = client.responses.create(model=MODEL, input="Time?", tools=[WEATHER, time_tool], max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_time"})
    assert [(c.type, c.name) for c in named.output] == [("function_call", "get_time")]
    assert -12 <= json.loads(named.output[0].arguments)["tz"] <= 14


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_a_pydantic_text_format_and_json_object(client):
    parsed = client.responses.parse(model=MODEL, input="Weather?", text_format=Weather, max_output_tokens=80)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Weather)
    assert parsed.text.format.type == "json_schema"
    completed = 0
    for seed in range(8):  # a random model ends an object only sometimes: every one that ends must parse
        obj = client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}},
                                      max_output_tokens=120, extra_body={"seed": seed})
        assert obj.output_text.startswith("{")
        if obj.status == "completed":
            completed += 1
            assert isinstance(json.loads(obj.output_text), dict)
    assert completed > 0


def test_stream_events_are_openai_s_order_byte_by_byte(server):
    status, payload = post(server, {"model": MODEL, "input": "yes or no?", "stream": True, "max_output_tokens": 40,
                                    "text": {"format": {"type": "json_schema", "name": "answer",
                                                        "schema": ANSWER_SCHEMA}}})
    assert status == 200
    body = dechunk(payload)
    assert b"[DONE]" not in body
    raw_events = body.split(b"\n\n")
    assert raw_events.pop() == b""
    events = []
    for i, chunk in enumerate(raw_events):
        head, data = chunk.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode() and event["sequence_number"] == i
        events.append(event)
    final = events[-1]["response"]
    [item] = final["output"]
    text = item["content"][0]["text"]
    assert json.loads(text)["answer"] in ("yes", "no")
    num_deltas = len(events) - 8
    deltas = [e["delta"] for e in events[4:4 + num_deltas]]
    assert "".join(deltas) == text and all(deltas)
    where = {"item_id": item["id"], "output_index": 0}
    shell = {**final, "status": "in_progress", "output": [], "usage": None}
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
    expected = [
        {"type": "response.created", "response": shell},
        {"type": "response.in_progress", "response": shell},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {"id": item["id"], "type": "message", "status": "in_progress", "content": [], "role": "assistant"}},
        {"type": "response.content_part.added", **where, "content_index": 0, "part": part},
        *({"type": "response.output_text.delta", **where, "content_index": 0, "logprobs": [], "delta": d}
          for d in deltas),
        {"type": "response.output_text.done", **where, "content_index": 0, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "content_index": 0, "part": {**part, "text": text}},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": final},
    ]
    assert final["status"] == "completed" and item["status"] == "completed"
    assert body == b"".join(b"event: %b\ndata: %b\n\n" % (e["type"].encode(), orjson.dumps(
        {**e, "sequence_number": i})) for i, e in enumerate(expected))
    status, stored = raw(server, "GET", f"/v1/responses/{final['id']}", headers=AUTH)
    assert status == 200 and stored == orjson.dumps(final)


def test_sdk_stream_with_function_call_events_and_final_response(client):
    kinds = []
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] is not None


def test_stored_response_retrieve_input_items_delete_and_other_key_gets_404(server, client):
    r = client.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."},
                                                   {"role": "user", "content": "Hi"}], max_output_tokens=3,
                                metadata={"k": "v"})
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = list(client.responses.input_items.list(r.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "developer"), ("message", "user")]
    assert items[1].content[0].type == "input_text" and items[1].content[0].text == "Hi"
    newest_first = client.responses.input_items.list(r.id, limit=1)
    assert [i.id for i in newest_first.data] == [items[1].id] and newest_first.has_more
    other = openai.OpenAI(base_url=server.base + "/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    status, body = raw(server, "DELETE", f"/v1/responses/{r.id}", headers=f"authorization: Bearer {OTHER_KEY}\r\n")
    assert status == 404 and orjson.loads(body) == {"error": {
        "message": f"Response with id '{r.id}' not found.", "type": "invalid_request_error", "param": None,
        "code": None}}
    status, body = post(server, {"model": MODEL, "input": "more", "previous_response_id": r.id}, key=OTHER_KEY)
    assert status == 404 and orjson.loads(body)["error"]["param"] == "previous_response_id"
    assert orjson.loads(body)["error"]["code"] == "previous_response_not_found"
    status, body = raw(server, "DELETE", f"/v1/responses/{r.id}", headers=AUTH)
    assert status == 200 and orjson.loads(body) == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def metric(server, name: str) -> float:
    status, body = raw(server, "GET", "/metrics")
    assert status == 200
    match = re.search(rb"^rawserve:" + name.encode() + rb"(?:\{[^}]*\})? ([0-9.e+]+)$", body, re.M)
    return float(match.group(1)) if match else 0.0


def test_previous_response_id_chains_the_conversation_from_the_prefix_cache(server, client):
    story = "Once upon a time a dragon guarded a mountain of gold near a quiet village by the sea. " * 3
    first = client.responses.create(model=MODEL, input=story, instructions="Answer briefly.", max_output_tokens=5,
                                    temperature=0)
    wait_idle(server)
    hits = metric(server, "prefix_cache_hits_total")
    # As OpenAI's, instructions are not carried over from the earlier turn: sent again, the prefix is the same.
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     instructions="Answer briefly.", max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert metric(server, "prefix_cache_hits_total") - hits >= 16
    # Only this turn's input is its input_items; the earlier turns came from the store.
    assert [i.content[0].text for i in client.responses.input_items.list(second.id)] == ["And then?"]


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input.0.content.0"),  # the demo model is text-only
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": "x", "tool_choice": "required", "tools": [{**WEATHER, "parameters": {"type": "nope"}}]},
     "tools.0.parameters"),
    ({}, "input"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": "x", "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
])
def test_unsupported_or_bad_fields_get_a_400_naming_them(server, body, param):
    status, payload = post(server, {"model": MODEL, **body})
    error = orjson.loads(payload)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_metadata_at_openai_s_limits_is_echoed(client):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2, metadata=metadata, store=False)
    assert r.metadata == metadata


def test_unknown_model_and_previous_response_get_404(server):
    status, payload = post(server, {"model": "nope", "input": "x"})
    assert status == 404 and orjson.loads(payload)["error"]["code"] == "model_not_found"
    status, payload = post(server, {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert status == 404 and orjson.loads(payload)["error"]["code"] == "previous_response_not_found"


def aborted_requests(server) -> float:
    """rawserve:request_success_total{finished_reason="abort"} from /metrics."""
    _, text = raw(server, "GET", "/metrics")
    for line in text.decode().splitlines():
        if line.startswith("rawserve:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_leaving_mid_stream_aborts_the_engine_request(server):
    before = aborted_requests(server)
    body = orjson.dumps({"model": MODEL, "input": "A long story", "stream": True, "max_output_tokens": 900,
                         "ignore_eos": True})
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{AUTH}\r\n".encode()
                     + body)
        seen = b""
        while b"response.output_text.delta" not in seen:
            seen += sock.recv(65536)
    wait_idle(server)
    assert aborted_requests(server) == before + 1  # ended by the abort, not by running out its 900 tokens


def test_output_items_stream_reasoning_then_text_then_a_call():
    out = OutputItems()
    events = []
    for delta in ({"reasoning_content": "think"}, {"reasoning_content": "ing"}, {"content": "Hi"}, {"content": "\n"},
                  {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}):
        events += out.feed(delta)
    events += out.finish("completed")
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added", "reasoning_summary_part.added", "reasoning_summary_text.delta",
        "reasoning_summary_text.delta", "reasoning_summary_text.done", "reasoning_summary_part.done",
        "output_item.done", "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done", "output_item.added",
        "function_call_arguments.delta", "function_call_arguments.done", "output_item.done"]
    reasoning, message, call = out.items
    assert reasoning["summary"] == [{"type": "summary_text", "text": "thinking"}]
    assert message["content"][0]["text"] == "Hi\n" and message["status"] == "completed"
    assert call["arguments"] == "{}" and call["call_id"] == "call_1"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_items_become_chat_messages_with_calls_joined_and_reasoning_carried():
    items = input_items([{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"},
                         {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                         {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c1", "output": "one"},
                         {"type": "function_call_output", "call_id": "c2",
                          "output": [{"type": "input_text", "text": "two"}]}])
    messages = chat_messages("sys", items)
    assert [(m.role, m.content) for m in messages] == [("system", "sys"), ("developer", "rules"), ("user", "q"),
                                                       ("assistant", None), ("tool", "one"), ("tool", "two")]
    assert [c.id for c in messages[3].tool_calls] == ["c1", "c2"] and messages[3].reasoning_content == "hmm"
    assert isinstance(messages[0], ChatMessage)


def test_store_is_a_bounded_lru_scoped_by_key():
    store = ResponseStore(2)

    def record(rid: str, key: str | None = "a", previous=None) -> StoredResponse:
        return StoredResponse({"id": rid, "output": [{"id": f"out-{rid}"}]}, [{"id": f"in-{rid}"}], previous, key)

    first = record("r1")
    store.put(first)
    store.put(record("r2", previous=first))
    assert store.get("r1", "b") is None and store.get("r1", "a") is first  # r1 is now the most recent
    store.put(record("r3"))
    assert store.get("r2", "a") is None and len(store) == 2  # r2 was the least recently used
    chained = record("r4", previous=first)
    assert [i["id"] for i in chained.conversation()] == ["in-r1", "out-r1", "in-r4", "out-r4"]
    assert not store.delete("r1", None) and store.delete("r1", "a") and store.get("r1", "a") is None


def test_an_agents_sdk_turn_calls_a_function_tool(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60))
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=100,
                                                                  parallel_tool_calls=False),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "Weather in Paris?")
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"


def test_a_stream_whose_engine_dies_ends_with_response_failed_and_is_logged(caplog):
    import logging
    import os
    import signal

    from rawserve.demo_model import ensure_demo_model

    srv = ServerThread(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=128,
                                    max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process", api_key=[]))
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=60)
        events = []
        with caplog.at_level(logging.INFO, "rawserve"), client.responses.create(model=MODEL, input="Go on", max_output_tokens=900, stream=True,
                                     extra_body={"ignore_eos": True}) as stream:
            for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta" and len(events) == 6:
                    os.kill(srv.app.llm.info["pid"], signal.SIGKILL)
        assert events[-1].type == "response.failed"
        assert events[-1].response.status == "failed" and events[-1].response.error is not None
        assert [e.sequence_number for e in events] == list(range(len(events)))
        # The failure never reached the access log's wrapper (response.failed is the stream's own end), so the
        # handler records it: an error line with the rid, and stream_error= on the access line.
        rid = events[-1].response.id
        errors = [r for r in caplog.records if r.name == "rawserve.api" and r.levelno == logging.ERROR]
        assert any("POST /v1/responses -> 5" in r.getMessage() and "rid=" in r.getMessage() for r in errors), errors
        access = [r.getMessage() for r in caplog.records if r.name == "rawserve.access"]
        assert any("stream_error=5" in line for line in access), (rid, access)
    finally:
        srv.stop()


def test_a_chain_past_its_turn_bound_is_refused_so_the_store_stays_bounded(server, monkeypatch):
    import rawserve.api.responses as responses

    monkeypatch.setattr(responses, "MAX_CHAIN_TURNS", 2)
    first = json.loads(post(server, {"model": MODEL, "input": "a", "max_output_tokens": 2})[1])
    status, body = post(server, {"model": MODEL, "input": "b", "max_output_tokens": 2,
                                 "previous_response_id": first["id"]})
    assert status == 200
    second = json.loads(body)
    status, body = post(server, {"model": MODEL, "input": "c", "max_output_tokens": 2,
                                 "previous_response_id": second["id"]})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "previous_response_id" and "2 turns" in error["message"]


LOGPROBS = "message.output_text.logprobs"


def _check_entries(entries: list[dict], text: str, num_top: int) -> None:
    """OpenAI's logprob entries, whose bytes spell `text` (a random model's invalid UTF-8 shows as U+FFFD)."""
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace") == text
    for e in entries:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == num_top
        assert all(set(t) == {"token", "logprob", "bytes"} for t in e["top_logprobs"])
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and e["logprob"] <= tops[0] + 1e-6


def test_include_logprobs_fills_the_output_text_part_like_chat_s(server, client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0, top_logprobs=3,
                                include=[LOGPROBS])
    assert r.top_logprobs == 3
    [message] = r.output
    part = message.content[0].model_dump()
    _check_entries(part["logprobs"], part["text"], 3)
    assert len(part["logprobs"]) == r.usage.output_tokens == 8
    chat = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3)
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    assert [(e["token"], e["bytes"]) for e in part["logprobs"]] == [(e["token"], e["bytes"]) for e in expected]
    assert [e["logprob"] for e in part["logprobs"]] == pytest.approx([e["logprob"] for e in expected], abs=1e-4)
    # top_logprobs alone adds nothing, as OpenAI: logprobs come only with include.
    plain = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=4, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == []


def test_include_logprobs_puts_each_delta_s_tokens_on_its_event(server, client):
    status, payload = post(server, {"model": MODEL, "input": "Tell a story.", "stream": True, "max_output_tokens": 24,
                                    "include": [LOGPROBS], "top_logprobs": 2, "seed": 3})
    assert status == 200
    events = [orjson.loads(chunk.split(b"\n")[1].removeprefix(b"data: "))
              for chunk in dechunk(payload).split(b"\n\n") if chunk]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(e["logprobs"] for e in deltas)
    for e in deltas:
        _check_entries(e["logprobs"], e["delta"], 2)
    [done] = [e for e in events if e["type"] == "response.output_text.done"]
    final = events[-1]["response"]
    part = final["output"][0]["content"][0]
    assert done["logprobs"] == part["logprobs"] == [x for e in deltas for x in e["logprobs"]]
    assert len(part["logprobs"]) == final["usage"]["output_tokens"]
    # The SDK reads the same shapes, streamed.
    stream = client.responses.create(model=MODEL, input="Tell a story.", max_output_tokens=6, temperature=0,
                                     include=[LOGPROBS], top_logprobs=1, stream=True)
    sdk_deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in sdk_deltas) == 6
    assert all(len(lp.top_logprobs) == 1 for e in sdk_deltas for lp in e.logprobs)


def test_output_items_give_logprobs_to_the_text_they_made_only():
    out = OutputItems()
    entry = [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]
    events = []
    out.add_logprobs(entry * 2)
    events += out.feed({"reasoning_content": "rr"})  # reasoning tokens: not the message's
    out.add_logprobs(entry)
    events += out.feed({"content": " "})  # whitespace before any text waits, and its tokens with it
    out.add_logprobs(entry)
    events += out.feed({"content": "a"})
    out.add_logprobs(entry)
    events += out.feed({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]})
    events += out.finish("completed")
    [delta] = [e for e in events if e["type"] == "response.output_text.delta"]
    assert delta["delta"] == " a" and delta["logprobs"] == entry * 2
    assert out.items[1]["content"][0]["logprobs"] == entry * 2
