"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official anthropic SDK and raw
sockets, on a tiny random Qwen3 with a Qwen3-shaped tokenizer built here and the demo's ChatML template (tools, thinking): outputs are random, so the
tests force what they check through guided decoding (tool_choice, guided_grammar) and assert structure, event order,
token counts and bytes, not content."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
from collections.abc import AsyncIterator

import pytest

from rawserve.api.messages_stream import PING_EVENT
from rawserve.config import EngineConfig, ServerConfig
from rawserve.http import Request, Router, SSEResponse
from tests.api.demo_server import dechunk, exchange, serve_demo
from tests.api.test_openai_server import ServerThread
from tests.http.harness import client as raw_client, serve as serve_router

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "qwen3-tiny"
KEY = "key-a"
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 8},
                                           "unit": {"type": "string", "enum": ["c", "f"]}}}}
TIME = {"name": "get_time", "description": "The time in a zone",
        "input_schema": {"type": "object", "additionalProperties": False, "required": ["zone"],
                         "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}
NO_THINKING = {"type": "disabled"}
GREEDY = {"temperature": 0}  # the newest SDKs no longer type temperature: it goes in the body
HELLO = [{"role": "user", "content": "Say hello."}]
THINK_GRAMMAR = 'root ::= <think> "first plan, then answer" </think> "\\n\\n" ("yes" | "no")'


@pytest.fixture(scope="module")
def server(large_vocab_model_dir):
    srv = ServerThread(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=512,
                                    max_model_len=4096),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[KEY],
                                    reasoning_parser="qwen3", max_body_bytes=1 << 20))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict, headers: str = f"x-api-key: {KEY}\r\n") -> tuple[int, dict, bytes]:
    return exchange(server, path, body, headers)


def sse_events(body: bytes) -> list[tuple[str, dict]]:
    """(event line, data) for each event; asserts every event has both lines and they agree."""
    events = []
    for frame in body.decode().split("\n\n"):
        if not frame:
            continue
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
        assert events[-1][0] == events[-1][1]["type"]
    return events


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_returns_a_message_whose_usage_adds_up_to_count_tokens(client):
    message = client.messages.create(model=MODEL, max_tokens=6, messages=HELLO, extra_body=GREEDY, thinking=NO_THINKING)
    assert re.fullmatch(r"msg_[0-9a-f]{32}", message.id) and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] in (["text"], [])
    assert message.stop_reason in ("max_tokens", "end_turn") and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 6 if message.stop_reason == "max_tokens" else 0 < usage.output_tokens <= 6
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking=NO_THINKING).input_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == counted and usage.cache_creation_input_tokens == 0


def test_count_tokens_equals_the_prompt_tokens_chat_uses(client, chat):
    system = "You are terse."
    tools = [WEATHER, TIME]
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=HELLO, tools=tools).input_tokens
    reply = chat.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "system", "content": system}, *HELLO],
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in tools])
    assert counted == reply.usage.prompt_tokens
    # The system prompt and the tools are in the prompt: each one adds tokens.
    assert counted > client.messages.count_tokens(model=MODEL, system=system, messages=HELLO).input_tokens \
        > client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens


def test_a_system_prompt_as_a_string_or_as_text_blocks_is_the_same_prompt(client):
    blocks = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English.",
                                                             "cache_control": {"type": "ephemeral"}}]
    joined = "You are terse.\nAnswer in English."
    as_string = client.messages.create(model=MODEL, max_tokens=5, system=joined, messages=HELLO, extra_body=GREEDY)
    as_blocks = client.messages.create(model=MODEL, max_tokens=5, system=blocks, messages=HELLO, extra_body=GREEDY)
    assert text_of(as_string) == text_of(as_blocks)
    assert as_string.usage.input_tokens + as_string.usage.cache_read_input_tokens == \
        as_blocks.usage.input_tokens + as_blocks.usage.cache_read_input_tokens
    assert as_blocks.usage.input_tokens + as_blocks.usage.cache_read_input_tokens > \
        client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens


def test_stream_text_and_final_message_match_the_whole_response(client):
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY, thinking=NO_THINKING)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY,
                                thinking=NO_THINKING) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.id.startswith("msg_") and final.id != whole.id


def test_raw_stream_sends_anthropics_named_events_in_order(server):
    status, headers, body = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": HELLO,
                                                          "stream": True, "thinking": NO_THINKING})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    payload = dechunk(body)
    assert b"[DONE]" not in payload and payload.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    events = sse_events(payload)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    middle = "".join({"content_block_start": "[", "content_block_delta": "d", "content_block_stop": "]"}[n]
                     for n in names[1:-2])
    assert re.fullmatch(r"(\[d+\])*", middle), names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn") and delta["usage"]["output_tokens"] <= 5
    indices = [data["index"] for name, data in events if name.startswith("content_block")]
    assert indices == sorted(indices)


def test_tool_choice_any_gives_a_tool_use_valid_for_its_schema(client):
    message = client.messages.create(model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "Weather?"}],
                                     tools=[WEATHER, TIME], tool_choice={"type": "any"}, thinking=NO_THINKING)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        assert re.fullmatch(r"toolu_[0-9a-f]{32}", call.id) and call.name in ("get_weather", "get_time")
        schema = (WEATHER if call.name == "get_weather" else TIME)["input_schema"]
        jsonschema.validate(call.input, schema)


def test_tool_choice_tool_names_the_tool_streamed_or_not(client):
    kwargs = dict(model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "Weather?"}],
                  tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"}, thinking=NO_THINKING)
    message = client.messages.create(**kwargs)
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_time" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, TIME["input_schema"])
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    assert streamed.name == "get_time"
    jsonschema.validate(streamed.input, TIME["input_schema"])  # the partial_json fragments join to the object


def test_tool_result_round_trip_renders_as_chat_tool_messages(client, chat):
    first = client.messages.create(model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "Weather?"}],
                                   tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                   thinking=NO_THINKING)
    [call] = [block for block in first.content if block.type == "tool_use"]
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny"}]},
                 {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=turns, tools=[WEATHER], thinking=NO_THINKING)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The same conversation in chat's shape: the assistant's call, the tool's output, then the user's text.
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER], thinking=NO_THINKING)
    reply = chat.chat.completions.create(
        model=MODEL, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}],
        messages=[{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": text_of(first), "tool_calls": [
                      {"id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                  {"role": "user", "content": "And tomorrow?"}])
    assert counted.input_tokens == reply.usage.prompt_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted.input_tokens


def test_thinking_enabled_gives_a_signed_thinking_block_before_the_text(client):
    kwargs = dict(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Is it sunny?"}],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"guided_grammar": THINK_GRAMMAR})
    message = client.messages.create(**kwargs)
    assert [block.type for block in message.content] == ["thinking", "text"] and message.stop_reason == "end_turn"
    thinking, text = message.content
    assert thinking.thinking == "first plan, then answer" and re.fullmatch(r"[0-9a-f]{64}", thinking.signature)
    assert text.text in ("yes", "no")
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds.index("signature_delta") < kinds.index("text_delta") and "thinking_delta" in kinds
    assert final.content[0].thinking == thinking.thinking and final.content[0].signature == thinking.signature
    # Handed back with its signature, the thinking block is the assistant turn's reasoning: the request is taken.
    turns = [{"role": "user", "content": "Is it sunny?"},
             {"role": "assistant", "content": [block.model_dump() for block in message.content]},
             {"role": "user", "content": "Sure?"}]
    again = client.messages.create(model=MODEL, max_tokens=2, thinking={"type": "enabled", "budget_tokens": 1024},
                                   messages=turns)
    assert again.stop_reason in ("max_tokens", "end_turn")


def test_thinking_disabled_closes_the_block_in_the_prompt(client):
    on = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking={"type": "enabled", "budget_tokens": 2048})
    off = client.messages.count_tokens(model=MODEL, messages=HELLO, thinking=NO_THINKING)
    default = client.messages.count_tokens(model=MODEL, messages=HELLO)
    # Qwen3's template writes an empty <think></think> when enable_thinking is false; the default is thinking.
    assert off.input_tokens > on.input_tokens == default.input_tokens
    message = client.messages.create(model=MODEL, max_tokens=6, messages=HELLO, thinking=NO_THINKING,
                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert [block.type for block in message.content] == ["text"] and text_of(message) in ("yes", "no")


def test_stop_sequences_end_the_message_with_stop_sequence(client):
    message = client.messages.create(model=MODEL, max_tokens=20, messages=HELLO, thinking=NO_THINKING,
                                     stop_sequences=["STOP", "HALT"],
                                     extra_body={"guided_grammar": 'root ::= "yes STOP no"'})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "STOP"
    assert text_of(message) == "yes "


@pytest.mark.parametrize("body, fragment", [
    ({"messages": HELLO}, "max_tokens: Field required"),
    ({"max_tokens": 4, "messages": []}, "messages: at least one message is required"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]},
     "messages.0.content.0.type: content block type 'hologram' is not supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     f"messages.0.content.0: {MODEL} takes no images"),  # a text-only model
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": HELLO, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
     "tool_choice.name"),
    ({"max_tokens": 4, "messages": HELLO, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0.type"),
])
def test_bad_requests_get_anthropic_shaped_400s(client, server, body, fragment):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.post("/v1/messages", cast_to=object, body={"model": MODEL, **body})  # the SDK checks no fields here
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
    assert fragment in caught.value.body["error"]["message"]
    status, headers, raw = post(server, "/v1/messages", {"model": MODEL, **body})
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(raw) == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": caught.value.body["error"]["message"]}}


def test_http_layer_refusals_on_messages_paths_are_anthropic_shaped(server):
    status, _, raw = post(server, "/v1/messages", {"model": MODEL}, headers="")
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    assert json.loads(raw)["type"] == "error" and "x-api-key" in json.loads(raw)["error"]["message"]
    status, _, raw = post(server, "/v1/messages/count_tokens", {"model": MODEL}, headers="x-api-key: wrong\r\n")
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    # Bad JSON, an unknown model, a body over --max-body-bytes (refused from its head).
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {KEY}\r\ncontent-length: 5\r\n"
                     "connection: close\r\n\r\n{bad}".encode())
        data = b"".join(iter(lambda: sock.recv(65536), b""))
    assert data.startswith(b"HTTP/1.1 400") and b'"type":"invalid_request_error"' in data
    status, _, raw = post(server, "/v1/messages", {"model": "claude-x", "max_tokens": 2, "messages": HELLO})
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error"
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: {KEY}\r\ncontent-length: {2 << 20}\r\n"
                     "\r\n".encode())
        data = b"".join(iter(lambda: sock.recv(65536), b""))
    assert data.startswith(b"HTTP/1.1 413") and data.endswith(b'"type":"request_too_large","message":"The request '
                                                              b'body is 2097152 bytes; the limit is 1048576."}}')
    # OpenAI's routes keep OpenAI's shape.
    status, _, raw = post(server, "/v1/chat/completions", {"model": MODEL}, headers="")
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key" and "type" not in json.loads(raw)


def test_keys_are_taken_as_x_api_key_or_bearer_with_anthropic_headers(server):
    headers = "anthropic-version: 2023-06-01\r\nanthropic-beta: prompt-caching-2024-07-31\r\n"
    body = {"model": MODEL, "messages": HELLO}
    for auth in (f"x-api-key: {KEY}\r\n", f"authorization: Bearer {KEY}\r\n"):
        status, _, raw = post(server, "/v1/messages/count_tokens", body, headers=auth + headers)
        assert status == 200 and json.loads(raw)["input_tokens"] > 0
    bearer = anthropic.Anthropic(base_url=server.base, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=HELLO, metadata={"user_id": "u-1"})


def claude_code_request(billing: str, messages: list[dict]) -> dict:
    """A request shaped as Claude Code sends it: system blocks (a per-request billing line first), 20 tools."""
    tools = [{"name": f"tool_{i}", "description": f"Tool number {i}: does task {i} on the workspace.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                               "limit": {"type": "integer"}},
                               "required": ["path"]}} for i in range(20)]
    system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0; cch={billing};"},
              {"type": "text", "text": "You are an interactive CLI agent that helps with software tasks. " * 12,
               "cache_control": {"type": "ephemeral"}}]
    return dict(model=MODEL, max_tokens=8, system=system, tools=tools, messages=messages, thinking=NO_THINKING,
                metadata={"user_id": "user_abc"})


def test_a_claude_code_shaped_conversation_hits_the_prefix_cache_on_its_second_turn(client):
    first_turn = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                                               {"type": "text", "text": "List the files."}]}]
    with client.messages.stream(**claude_code_request("a1b2", first_turn)) as stream:
        first = stream.get_final_message()
    assert first.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens > 800
    second_turn = [*first_turn,
                   {"role": "assistant", "content": [
                       {"type": "text", "text": "Listing."},
                       {"type": "tool_use", "id": "toolu_01", "name": "tool_3", "input": {"path": "."}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                                 "content": "a.py\nb.py"}]}]
    with client.messages.stream(**claude_code_request("c3d4", second_turn)) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The system prompt and tools, the bulk of the prompt, come from the cache despite the changed billing line.
    assert second.usage.cache_read_input_tokens > 800
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


async def test_a_waiting_stream_sends_anthropic_ping_events():
    async def slow() -> AsyncIterator[dict]:
        yield {"type": "message_start"}
        await asyncio.sleep(0.35)  # a long prefill
        yield {"type": "message_stop"}

    async def handler(request: Request) -> SSEResponse:
        return SSEResponse(slow(), named=True, ping=PING_EVENT)

    router = Router()
    router.add("GET", "/events", handler)
    async with serve_router(router, sse_ping_interval_s=0.1) as srv, raw_client(srv.port) as c:
        reply = await c.request("GET", "/events")
    first, _, rest = reply.body.partition(b"\n\n")
    pings, _, last = rest.partition(b'event: message_stop\n')
    assert first == b'event: message_start\ndata: {"type":"message_start"}'
    assert 2 <= pings.count(PING_EVENT) <= 4 and pings == PING_EVENT * pings.count(PING_EVENT)
    assert sse_events(reply.body)[1] == ("ping", {"type": "ping"})


def test_a_streamed_message_waits_with_ping_events(server):
    from rawserve.api.messages import create_message
    from rawserve.http import Headers

    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": HELLO, "stream": True}).encode()
    request = Request("POST", "/v1/messages", "", Headers([]), body)
    response = server.call(create_message(server.app.context, request))

    async def events() -> list[dict]:
        return [event async for event in response.events]

    assert [event["type"] for event in server.call(events())][-1] == "message_stop"  # its request ran to the end
    assert isinstance(response, SSEResponse) and response.named and response.ping == PING_EVENT


def test_an_engine_failure_mid_stream_ends_it_with_an_anthropic_error_event(demo_dir):
    servers = serve_demo(dict(num_kv_blocks=256, max_model_len=4096), dict(engine_mode="process", log_requests=False))
    srv = next(servers)
    try:
        body = json.dumps({"model": "demo", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                           "messages": HELLO}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.app.port), timeout=60)
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        data = b""
        while b"content_block_delta" not in data:
            data += sock.recv(65536)
        os.kill(srv.app.llm.info["pid"], signal.SIGKILL)
        while not data.endswith(b"\r\n0\r\n\r\n"):
            data += sock.recv(65536)
        sock.close()
    finally:
        next(servers, None)
    events = sse_events(dechunk(data.partition(b"\r\n\r\n")[2]))
    name, error = events[-1]
    assert name == "error" and error["error"]["type"] == "overloaded_error" and error["error"]["message"]
    assert set(error) == {"type", "error"} and "message_stop" not in [n for n, _ in events]


@pytest.fixture(scope="module")
def demo_dir():
    from rawserve.demo_model import ensure_demo_model

    return ensure_demo_model()

