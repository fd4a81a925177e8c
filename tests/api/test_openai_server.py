"""The OpenAI server end to end: real sockets, the official openai SDK, the demo checkpoint on disk.

The server runs on its own event loop in a thread (engine core in a thread). (The real `python -m rawserve`, its
core in a spawned process and stopped with SIGTERM, is tests/test_cli.py's TLS test.)
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest

from rawserve.config import EngineConfig, ServerConfig

openai = pytest.importorskip("openai")

MODEL = "demo"


class ServerThread:
    def __init__(self, engine: EngineConfig, server: ServerConfig) -> None:
        from rawserve.api.app import OpenAIServer

        self.app = OpenAIServer(engine, server)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.app.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(120), "server did not start"
        self.base = f"http://127.0.0.1:{self.app.port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.call(self.app.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def demo_dir():
    from rawserve.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="module")
def server(demo_dir):
    srv = ServerThread(EngineConfig(model_dir=str(demo_dir), device="cpu", num_kv_blocks=256, max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(server, method: str, path: str, body: bytes = b"", headers: str = "") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{headers}"
                     f"connection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def wait_idle(server, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.app.llm.core_stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0 \
                and server.app.llm.num_in_flight == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {server.app.llm.core_stats}")


HELLO = [{"role": "user", "content": "Tell me a story about a dragon."}]


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL
    # vLLM's max_model_len, and the KV pool: 256 blocks of 16 tokens, 4 layers x K and V x 2 heads x 32 x 4 bytes
    assert (card.max_model_len, card.kv_cache_tokens, card.kv_cache_bytes) == (1024, 4096, 4096 * 4 * 2 * 2 * 32 * 4)


def test_chat_stream_concatenates_to_the_non_streamed_greedy_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_n_samples_with_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, n=3, temperature=1.0, seed=7,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    for choice in r.choices:
        assert len(choice.logprobs.content) == 6
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    again = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_completions_batch_of_text_and_ids_with_n(server, client):
    r = client.completions.create(model=MODEL, prompt=["Once upon", "The dragon"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples of a prompt agree
    ids = json.loads(raw(server, "POST", "/tokenize", b'{"prompt": "Once upon"}')[1])["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_completions_echo_and_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="The dragon", max_tokens=10, temperature=0).choices[0]
    stop = base.text[3:6]
    assert stop.strip(), base.text
    cut = client.completions.create(model=MODEL, prompt="The dragon", max_tokens=10, temperature=0, stop=[stop],
                                    echo=True).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == "The dragon" + base.text[:base.text.index(stop)]


def test_streamed_completion_logprobs_cover_every_token(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stream=True, logprobs=2,
                                            temperature=0))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert len(tokens) == 5
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "messages": HELLO}, 404, "model"),
    ({"messages": HELLO, "temperature": -1}, 400, "temperature"),
    ({"messages": HELLO, "max_tokens": 5000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ({"messages": []}, 400, "messages"),
    ({"messages": HELLO, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ({"messages": HELLO, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ({"messages": HELLO, "n": True}, 400, "n"),
    ({"messages": HELLO, "stop": ["x"] * 65}, 400, "stop"),
    ({"messages": HELLO, "stop": "y" * 1025}, 400, "stop"),
    ({"messages": HELLO, "logit_bias": {str(i): 1 for i in range(1025)}}, 400, "logit_bias"),
])
def test_bad_chat_requests_get_openai_shaped_errors(server, body, status, param):
    code, payload = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    error = json.loads(payload)["error"]
    assert code == status, error
    assert error["param"] == param and error["message"] and "type" in error and "code" in error


def test_invalid_json_gets_400_and_server_keeps_serving(server, client):
    code, payload = raw(server, "POST", "/v1/completions", b"{nope")
    assert code == 400 and json.loads(payload)["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices[0].finish_reason


def test_client_disconnect_mid_stream_frees_every_kv_block(server):
    wait_idle(server)
    metrics = server.app.llm.metrics
    aborted = metrics.counter_value("request_success_total", "abort")
    steps_before = server.app.llm.core_stats.steps
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    sock = socket.create_connection(("127.0.0.1", server.app.port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while b"data: " not in received:
        chunk = sock.recv(65536)
        assert chunk, "the stream ended before its first event"
        received += chunk
    assert server.app.llm.num_in_flight == 1
    sock.close()
    wait_idle(server)
    # The request ended as an abort, and the core stopped stepping it well short of its 1000 tokens.
    assert metrics.counter_value("request_success_total", "abort") == aborted + 1
    assert server.app.llm.core_stats.steps - steps_before < 900


def test_health_metrics_tokenize_detokenize(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=2)
    code, payload = raw(server, "GET", "/health")
    assert code == 200
    code, payload = raw(server, "GET", "/metrics")
    assert code == 200
    text = payload.decode()
    assert re.search(r'rawserve:request_success_total\{model_name="demo",finished_reason="length"\} [1-9]', text)
    assert f'rawserve:kv_cache_bytes{{model_name="demo"}} {4096 * 4 * 2 * 2 * 32 * 4}' in text
    assert 'rawserve:kv_cache_capacity_tokens{model_name="demo"} 4096' in text
    rss = float(re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M).group(1))
    assert 20 << 20 < rss < 64 << 30
    assert "engine_core_resident_memory_bytes" not in text  # a core thread's memory is this process's
    code, payload = raw(server, "POST", "/tokenize", json.dumps({"prompt": "héllo wörld"}).encode())
    tokens = json.loads(payload)["tokens"]
    code, payload = raw(server, "POST", "/detokenize", json.dumps({"tokens": tokens}).encode())
    assert json.loads(payload)["prompt"] == "héllo wörld"


def test_long_inputs_take_the_gil_free_paths_and_give_the_same_answers(server, client):
    """Texts and id lists past 4,096 go through tokenizers' batch calls (which let other threads
    run); the answers must be those of the plain calls, and an over-long prompt is refused with its
    exact token count without its ids ever being built."""
    tokenizer = server.app.tokenizer
    text = "Once upon a time, a dragon drank tea. " * 400  # ~15k characters
    code, payload = raw(server, "POST", "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False}).encode())
    assert code == 200
    ids = json.loads(payload)["tokens"]
    assert ids == tokenizer._tok.encode(text, add_special_tokens=False).ids and len(ids) > 4096
    code, payload = raw(server, "POST", "/detokenize", json.dumps({"tokens": ids}).encode())
    assert code == 200 and json.loads(payload)["prompt"] == tokenizer._tok.decode(ids) == text
    count = len(tokenizer._tok.encode(text).ids)
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 1}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]})):
        code, payload = raw(server, "POST", path, json.dumps(body).encode())
        error = json.loads(payload)["error"]
        assert code == 400 and error["code"] == "context_length_exceeded", payload
        assert error["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert f"your prompt has {count} tokens" in raw(server, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": text, "max_tokens": 1}).encode())[1].decode()
    # A bad id deep inside a long list is named by its index.
    code, payload = raw(server, "POST", "/detokenize", json.dumps({"tokens": ids[:-1] + [1.5]}).encode())
    assert code == 400 and json.loads(payload)["error"]["param"] == f"tokens.{len(ids) - 1}"
    code, payload = raw(server, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": ids[:100] + [-1], "max_tokens": 1}).encode())
    assert code == 400 and "Token id -1 is out of vocabulary" in json.loads(payload)["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=1).choices


def test_tool_call_output_accumulates_into_openai_message():
    from rawserve.api.chat import _accumulate
    from rawserve.text.parsers import OutputParser

    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    parser = OutputParser(None, True)
    message = {"role": "assistant", "content": ""}
    for i in range(0, len(text), 7):  # arrives in pieces, as a stream does
        for delta in parser.feed(text[i:i + 7], final=i + 7 >= len(text)):
            _accumulate(message, delta)
    assert parser.has_tool_calls
    call = message["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert message["content"] == "Sure."


def test_repeated_prompt_reports_prefix_cache_hits_and_cache_salt_isolates(server):
    prompt = "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up. " * 2

    def cached(**extra) -> int:
        body = json.dumps({"prompt": prompt, "max_tokens": 2, **extra}).encode()
        code, payload = raw(server, "POST", "/v1/completions", body)
        assert code == 200
        return json.loads(payload)["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="warm")
    assert cached(cache_salt="warm") >= 16  # at least one full KV block came from the cache
    assert cached(cache_salt="other-tenant") == 0


def test_usage_counts_each_prompt_once_whatever_n(client):
    prompt = "A long prompt about dragons, castles and knights that spans more than one KV block. " * 2
    warm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    r = client.completions.create(model=MODEL, prompt=[prompt, "short"], max_tokens=2, n=3)
    short = client.completions.create(model=MODEL, prompt="short", max_tokens=1).usage.prompt_tokens
    assert r.usage.prompt_tokens == warm.usage.prompt_tokens + short
    assert r.usage.completion_tokens == 12
    # Samples 2 and 3 of a prompt may hit blocks sample 1 just wrote: still never more than the prompt.
    assert 16 <= r.usage.prompt_tokens_details.cached_tokens <= warm.usage.prompt_tokens
    chat = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=4)
    assert chat.usage.prompt_tokens_details.cached_tokens <= chat.usage.prompt_tokens
