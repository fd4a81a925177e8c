"""Client input that must not reach the server's internals (issue 13, item 6) and start-up order (item 7):
reserved chat_template_kwargs, malformed text parts, a batch that can never fit --max-pending, and a taken
port failing before the model loads. Real sockets against the demo checkpoint.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.demo_server import serve_demo
from tests.api.test_openai_server import demo_dir, raw, wait_idle  # noqa: F401 - demo_dir is a fixture

MAX_PENDING = 8


@pytest.fixture(scope="module")
def server():
    yield from serve_demo(dict(num_kv_blocks=128, max_model_len=256, dtype="auto"), dict(max_pending=MAX_PENDING))


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, payload = raw(server, "POST", path, json.dumps(body).encode(), "content-type: application/json\r\n")
    return status, json.loads(payload)


def abort_count(server) -> float:
    match = re.search(r'request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', server.app.llm.render_metrics())
    assert match is not None
    return float(match.group(1))


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "template",
                                 "now", "max_rendered_chars", "strftime_now"])
def test_reserved_chat_template_kwargs_get_a_400_naming_the_key(server, key):
    status, body = post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: 1}})
    assert status == 400, body
    error = body["error"]
    assert f"'{key}'" in error["message"] and error["param"] == f"chat_template_kwargs.{key}"
    assert error["type"] == "invalid_request_error"


def test_ordinary_chat_template_kwargs_still_reach_the_template(server):
    status, body = post(server, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, body


@pytest.mark.parametrize("part, says", [({"type": "text"}, "has no 'text'"),
                                        ({"type": "text", "text": 5}, "'text' of type int"),
                                        ({"type": "text", "text": None}, "has no 'text'")])
def test_a_text_part_without_string_text_says_so(server, part, says):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    status, body = post(server, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert status == 400
    assert "needs a string 'text'" in body["error"]["message"] and says in body["error"]["message"]
    assert body["error"]["param"] == "messages.0.content.1.text"


def test_a_batch_that_can_never_fit_max_pending_is_a_400_before_any_stream_starts(server):
    aborts_before = abort_count(server)
    status, body = post(server, "/v1/completions", {"model": "demo", "prompt": ["a", "b", "c"], "n": 3,
                                                    "max_tokens": 2})
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and "--max-pending" in body["error"]["message"]
    assert "9 engine requests" in body["error"]["message"]
    status, body = post(server, "/v1/chat/completions", {**CHAT, "n": MAX_PENDING + 1})
    assert status == 400 and body["error"]["param"] == "n"
    wait_idle(server)
    assert abort_count(server) == aborts_before  # nothing was admitted, so nothing was aborted
    status, body = post(server, "/v1/completions", {"model": "demo", "prompt": ["a", "b"], "n": 4, "max_tokens": 2})
    assert status == 200 and len(body["choices"]) == 8  # exactly at the cap fits


def test_a_taken_port_fails_at_once_with_one_line_before_the_model_loads(demo_dir):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "rawserve", "serve", str(demo_dir), "--port", str(port),
                               "--engine-mode", "process"], capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - started
    finally:
        holder.close()
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[0] and "Address already in use" in lines[0]
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr.lower()
    assert elapsed < 30  # no model load (the spawned core would import torch first)


async def test_the_server_object_binds_before_it_starts_the_engine(demo_dir):
    from rawserve.api.app import OpenAIServer

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        app = OpenAIServer(EngineConfig(model_dir=str(demo_dir), device="cpu", num_kv_blocks=16),
                           ServerConfig(port=holder.getsockname()[1], engine_mode="thread"))
        with pytest.raises(OSError):
            await app.start()
        assert app.llm.info is None and app.llm._client.worker is None  # the core never started
    finally:
        holder.close()


# --- Message content as OpenAI's schema has it (issue 33, item 6) -----------------------------------------
# system, developer, user and tool: a string or an array of at least one part, never null or missing; an
# assistant's content may be null only when it has tool_calls.

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("message, code", [
    ({"role": "user", "content": None}, "invalid_value"),
    ({"role": "user"}, "invalid_value"),
    ({"role": "user", "content": []}, "empty_array"),
    ({"role": "system", "content": None}, "invalid_value"),
    ({"role": "system", "content": []}, "empty_array"),
    ({"role": "developer", "content": None}, "invalid_value"),
    ({"role": "developer", "content": []}, "empty_array"),
    ({"role": "tool", "tool_call_id": "c1", "content": None}, "invalid_value"),
    ({"role": "tool", "tool_call_id": "c1", "content": []}, "empty_array"),
    ({"role": "assistant", "content": None}, "invalid_value"),
    ({"role": "assistant"}, "invalid_value"),
    ({"role": "assistant", "content": [], "tool_calls": [CALL]}, "empty_array"),
])
def test_a_message_without_content_is_a_400_naming_its_content(server, message, code):
    messages = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "again"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        status, body = post(server, path, {**CHAT, "messages": messages})
        assert status == 400, body
        error = body["error"]
        assert error["param"] == "messages.1.content" and error["code"] == code, error
        assert error["type"] == "invalid_request_error" and "'messages.1.content'" in error["message"]


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "user", "content": ""},  # an empty string is a string
    {"role": "user", "content": [{"type": "text", "text": "a"}]},
])
def test_content_that_openai_accepts_is_accepted(server, message):
    messages = [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "again"}]
    status, body = post(server, "/v1/chat/completions", {**CHAT, "messages": messages})
    assert status == 200, body


@pytest.mark.parametrize("messages, code, says", [
    (None, "missing_required_parameter", "Missing required parameter: 'messages'."),
    ([], "empty_array", "Invalid 'messages': empty array."),
    ("hi", "invalid_type", "Invalid type for 'messages': expected an array"),
])
def test_messages_missing_empty_or_not_an_array_is_openais_400(server, messages, code, says):
    body = {key: value for key, value in CHAT.items() if key != "messages"}
    if messages is not None:
        body["messages"] = messages
    status, body = post(server, "/v1/chat/completions", body)
    assert status == 400, body
    error = body["error"]
    assert (error["param"], error["code"], error["type"]) == ("messages", code, "invalid_request_error"), error
    assert error["message"].startswith(says) and "or null" not in error["message"], error


def test_a_responses_function_call_item_still_becomes_an_assistant_turn(server):
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "12"}]
    status, body = post(server, "/v1/responses", {"model": "demo", "input": items, "max_output_tokens": 2})
    assert status == 200, body
