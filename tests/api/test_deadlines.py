"""Deadlines and retry signals through a live server: X-Request-Timeout ends a generation with a 200 and
finish_reason "length" (the partial text kept, the engine request freed), the openai SDK sends one HTTP request
for such a call, errors a retry cannot fix carry x-should-retry: false; chat echo and continuous usage stats."""
from __future__ import annotations

import json

import pytest

from tests.api.demo_server import MODEL, exchange, serve_demo
from tests.api.test_openai_server import raw, wait_idle

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# 4,000 tokens take several seconds on any CPU (a step costs at least a millisecond of host time), and a 2 s
# deadline leaves a busy machine time for the first tokens: the deadline lands mid-generation.
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
MID = "x-request-timeout: 2\r\n"


@pytest.fixture(scope="module")
def server():
    yield from serve_demo(dict(num_kv_blocks=300, max_model_len=4096), dict(request_timeout_s=30))


def test_deadline_mid_generation_is_a_200_at_length_with_the_partial_text(server):
    wait_idle(server)
    timeouts = server.app.llm.metrics.counter_value("request_success_total", "length")
    code, head, body = exchange(server, "/v1/completions", LONG, MID)
    assert code == 200, body
    choice = json.loads(body)["choices"][0]
    usage = json.loads(body)["usage"]
    assert choice["finish_reason"] == "length" and 0 < usage["completion_tokens"] < LONG["max_tokens"]
    ids = json.loads(raw(server, "POST", "/tokenize", json.dumps(
        {"prompt": choice["text"], "add_special_tokens": False}).encode())[1])["tokens"]
    assert choice["text"] and len(ids) <= usage["completion_tokens"]
    wait_idle(server)  # the engine request was aborted: no KV block stays in use
    assert server.app.llm.metrics.counter_value("request_success_total", "length") == timeouts + 1


def test_streamed_deadline_ends_with_the_finish_chunk_and_done(server):
    code, head, body = exchange(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}, MID)
    assert code == 200
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["length"] and 0 < chunks[-1]["usage"]["completion_tokens"] < 4000
    wait_idle(server)


def test_openai_sdk_makes_one_http_request_for_a_deadline_hit_call(server):
    sent = []
    http_client = httpx.Client(event_hooks={"request": [sent.append]}, timeout=60)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", http_client=http_client)  # 2 retries
    try:
        reply = client.completions.create(model=MODEL, prompt=LONG["prompt"], max_tokens=LONG["max_tokens"],
                                          temperature=0, extra_body={"ignore_eos": True},
                                          extra_headers={"X-Request-Timeout": "0.4"})
    finally:
        http_client.close()
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens < LONG["max_tokens"]
    assert len(sent) == 1
    wait_idle(server)


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_a_bad_request_timeout_is_a_400_the_client_must_not_retry(server, value):
    code, head, body = exchange(server, "/v1/completions", {"prompt": "x", "max_tokens": 1},
                               f"x-request-timeout: {value}\r\n")
    assert code == 400 and json.loads(body)["error"]["param"] == "X-Request-Timeout"
    assert head["x-should-retry"] == "false"


def test_a_request_timeout_above_the_server_s_is_capped_by_it(server):
    from rawserve.api.serving import request_deadline
    from rawserve.http import Request
    from rawserve.http.messages import Headers

    def deadline(value: bytes) -> float | None:
        headers = Headers([(b"x-request-timeout", value)] if value else [])
        return request_deadline(server.app.context, Request("POST", "/v1/completions", "", headers, b""))

    assert deadline(b"1e9") == 30 and deadline(b"2.5") == 2.5 and deadline(b"") is None


def test_chat_echo_starts_the_reply_with_the_assistant_s_last_message(server):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": messages, "echo": True, "add_generation_prompt": False, "continue_final_message": True,
            "max_tokens": 5, "temperature": 0}
    code, _, payload = exchange(server, "/v1/chat/completions", body)
    assert code == 200
    whole = json.loads(payload)["choices"][0]["message"]["content"]
    plain = json.loads(exchange(server, "/v1/chat/completions", {**body, "echo": False})[2])
    assert whole == "Once upon" + plain["choices"][0]["message"]["content"]
    code, _, payload = exchange(server, "/v1/chat/completions", {**body, "stream": True, "stream_options": {
        "continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in payload.decode().split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole
    counts = [c["usage"]["completion_tokens"] for c in chunks]  # usage on every chunk, the tokens so far
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
    # The last message is the user's: echo adds nothing.
    code, _, payload = exchange(server, "/v1/chat/completions", {"messages": messages[:1], "echo": True,
                                                                "max_tokens": 3, "temperature": 0})
    text = json.loads(payload)["choices"][0]["message"]["content"]
    assert not text.startswith("Tell me")
