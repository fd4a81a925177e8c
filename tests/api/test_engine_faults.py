"""Honest health and clean endings when the engine or the server goes (issue 13, items 3-5): a frozen core (SIGSTOP)
turns /health 503 and back; a killed core leaves /metrics at zero with every failed request counted as an error;
streams still running at the drain timeout end with an error event, [DONE] and the chunked end.
Real servers: the engine core is a spawned process that the tests stop and kill.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.api.demo_server import exchange, serve_demo
from tests.api.test_openai_server import demo_dir, raw  # noqa: F401 - demo_dir is a fixture
from tests.spawned import listening_port

STALL_S = 1.5


@pytest.fixture(scope="module")
def server():
    yield from serve_demo(dict(num_kv_blocks=512, max_model_len=4096, dtype="auto"),
                          dict(engine_mode="process", engine_stall_timeout_s=STALL_S, log_requests=False))


class Stream:
    """A streamed completion read on a thread: its data events, and whether the chunked body ended."""

    def __init__(self, port: int, max_tokens: int = 3000) -> None:
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                           "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%b" % (len(body), body))
        self.data = b""
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.data += chunk
                if b"data: " in self.data:
                    self.first.set()
                if self.data.endswith(b"\r\n0\r\n\r\n"):
                    break
        except OSError:
            pass
        self.first.set()

    def events(self) -> list[str]:
        body = self.data.partition(b"\r\n\r\n")[2].decode()
        return [line[6:] for line in body.split("\n") if line.startswith("data: ")]

    def ended_cleanly(self) -> bool:
        return self.data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


def health(port: int, method: str = "GET") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"{method} /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def metric(server, name: str, label: str = "") -> float:
    match = re.search(rf"rawserve:{name}\{{[^}}]*{label}[^}}]*\}} (\S+)", server.app.llm.render_metrics())
    assert match is not None, name
    return float(match.group(1))


def test_a_frozen_core_turns_health_503_while_requests_wait_and_back_when_it_resumes(server):
    port = server.app.port
    pid = server.app.llm.info["pid"]
    time.sleep(STALL_S + 0.5)  # idle and quiet but for its heartbeat: still healthy
    assert health(port) == (200, b'{"status":"ok"}')
    stream = Stream(port)
    assert stream.first.wait(60)
    os.kill(pid, signal.SIGSTOP)
    try:
        assert health(port)[0] == 200  # not yet: a step may take a moment
        status, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(health(port)), STALL_S + 5)
        error = json.loads(body)["error"]
        assert error["code"] == "engine_stalled" and "1 request(s) wait" in error["message"]
        assert health(port, "HEAD") == (503, b"")  # HEAD answers like GET, without the body
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: health(port)[0] == 200, 5)
    assert health(port, "HEAD") == (200, b"")
    stream.close()  # it was still running: the client leaves, the request is aborted


def test_a_killed_core_leaves_metrics_at_zero_and_counts_every_failed_request(server):
    port = server.app.port
    errors_before = metric(server, "request_success_total", 'finished_reason="error"')
    streams = [Stream(port) for _ in range(6)]
    for s in streams:
        assert s.first.wait(60)
    wait_for(lambda: metric(server, "kv_cache_usage_perc") > 0, 5)
    os.kill(server.app.llm.info["pid"], signal.SIGKILL)
    for s in streams:
        s.thread.join(10)
        events = s.events()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert s.ended_cleanly()
        s.close()
    wait_for(lambda: server.app.llm.num_in_flight == 0, 5)
    assert metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0
    assert metric(server, "kv_cache_usage_perc") == 0 and metric(server, "requests_in_flight") == 0
    assert metric(server, "request_success_total", 'finished_reason="error"') == errors_before + 6
    status, body = health(port)
    assert status == 503 and json.loads(body)["error"]["code"] == "engine_dead"
    assert raw(server, "GET", "/metrics")[0] == 200


def test_sigterm_under_load_ends_streams_past_the_drain_timeout_with_an_error_event_and_done(demo_dir):
    proc = subprocess.Popen([sys.executable, "-m", "rawserve", "serve", str(demo_dir), "--port", "0",
                             "--num-kv-blocks", "512", "--max-model-len", "4096", "--drain-timeout-s", "1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(proc)
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        streams = [Stream(port) for _ in range(4)]
        for s in streams:
            assert s.first.wait(60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for s in streams:
            s.thread.join(10)
            events = s.events()
            assert events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2])["error"]["code"] == "server_shutdown"
            assert s.ended_cleanly()  # [DONE], then the terminal chunk
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ----- issue 33 item 1: a sampling value must never kill the engine for everyone

@pytest.fixture(scope="module")
def sampling_server():
    """Its own server (the one above has its core stopped and killed): the demo model, a spawned core."""
    yield from serve_demo(dict(num_kv_blocks=256, max_model_len=1024), dict(engine_mode="process", log_requests=False))


def chat(server, **fields) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8, **fields}
    status, _, payload = exchange(server, "/v1/chat/completions", body)
    return status, json.loads(payload)


def test_temperature_1e_300_is_greedy_by_rule_and_the_engine_serves_on(sampling_server):
    greedy = chat(sampling_server, temperature=0, logprobs=True, top_logprobs=5)
    for fields in (dict(temperature=1e-300), dict(temperature=1e-300, logprobs=True, top_logprobs=5),
                   dict(temperature=1e-45), dict(temperature=1e-39), dict(temperature=1e-37, top_p=0.5)):
        status, body = chat(sampling_server, **fields)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == greedy[1]["choices"][0]["message"]["content"]
    status, body = chat(sampling_server, repetition_penalty=1e-300)
    assert status == 400 and body["error"]["param"] == "repetition_penalty", body
    status, body = chat(sampling_server, temperature=0.7, seed=3)  # a normal request after them
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    assert not sampling_server.app.llm.is_dead


@pytest.mark.parametrize("fields, param, words", [
    (dict(temperature=3), "temperature", "must be in [0, 2]"), (dict(temperature=1e18), "temperature", "[0, 2]"),
    (dict(seed=-1), "seed", "out of range"), (dict(seed=2 ** 64), "seed", "out of range"),
    (dict(seed=-2 ** 63 - 1), "seed", "out of range"),
    (dict(top_k=-2), "top_k", "out of range"), (dict(top_k=2 ** 40), "top_k", "out of range"),
    (dict(top_k=2 ** 70), "top_k", "out of range"),
])
def test_out_of_range_sampling_values_are_400s_saying_so(sampling_server, fields, param, words):
    status, body = chat(sampling_server, **fields)
    assert status == 400, body
    error = body["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error", error
