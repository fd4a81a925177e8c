"""Probes and drain through a real spawned server (`python -m rawserve serve`, core in its own process).

/health is liveness (200 until the engine dies, draining included); /ready is readiness (503 from the SIGTERM on).
On SIGTERM the in-flight stream finishes whole, new requests get 503 with Retry-After, and the process exits 0
within --shutdown-timeout, cancelling what is still running when the timeout is spent.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

from bench.spawn import Replica

ARGS = ["--max-model-len", "2048", "--num-kv-blocks", "256", "--served-model-name", "demo"]


def tokens_per_second(server: Replica) -> float:
    began = time.monotonic()
    status, _, body = server.request("POST", "/v1/completions", {
        "model": "demo", "prompt": "Once", "max_tokens": 16, "ignore_eos": True})
    assert status == 200, body
    return 16 / (time.monotonic() - began)


class Stream(threading.Thread):
    """One streamed completion read to its end: the deltas' token count, finish_reason, [DONE], when it ended."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.max_tokens = port, max_tokens
        self.first = threading.Event()
        self.events: list[dict] = []
        self.done = False
        self.ended_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps({
                "model": "demo", "prompt": "Once upon a time", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}), {"content-type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200
            for line in response:
                if line.startswith(b"data: [DONE]"):
                    self.done = True
                elif line.startswith(b"data: "):
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.first.set()
            conn.close()


def test_sigterm_readiness_503_at_once_in_flight_finishes_new_requests_503_retry_after_exit_0():
    server = Replica([*ARGS, "--shutdown-timeout", "60"])
    try:
        assert server.request("GET", "/ready")[0] == 200
        assert server.request("GET", "/health")[0] == 200
        # long enough to outlast the checks below on a fast or a busy box: about 3 s of decoding
        max_tokens = max(32, min(1500, int(3 * tokens_per_second(server))))
        stream = Stream(server.port, max_tokens)
        stream.start()
        assert stream.first.wait(60)
        server.terminate()
        signalled = time.monotonic()
        status, _, body = server.request("GET", "/ready")
        while status == 200 and time.monotonic() - signalled < 2:  # the signal reaches the loop at its next turn
            status, _, body = server.request("GET", "/ready")
        assert status == 503 and json.loads(body)["error"]["code"] == "draining"
        assert server.request("GET", "/health")[0] == 200  # alive: no restart while it drains
        status, headers, body = server.request("POST", "/v1/completions", {"model": "demo", "prompt": "x"})
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == "server_shutting_down"
        assert server.request("GET", "/v1/models")[0] == 503
        assert server.request("GET", "/metrics")[0] == 200
        checked = time.monotonic()
        assert server.wait(60) == 0
        stream.join(10)
        assert stream.error is None and stream.done, stream.error
        assert stream.ended_at > checked, "the stream ended before the checks: they did not run during the drain"
        text_events = [e for e in stream.events if e["choices"]]
        assert text_events[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        server.kill()


def test_shutdown_timeout_bounds_the_exit_when_a_request_outlasts_it():
    server = Replica([*ARGS, "--shutdown-timeout", "2"])
    try:
        stream = Stream(server.port, 2000)  # far longer than 2 s here
        stream.start()
        assert stream.first.wait(60)
        server.terminate()
        began = time.monotonic()
        assert server.wait(30) == 0
        # the timeout, plus the interpreter's own exit (1.6 s on a 2-core box at load 5); the 2,000 tokens take far longer
        assert time.monotonic() - began < 2 + 3
        stream.join(10)
        # Cut short, and told so (issue 13): a server_shutdown error event, then [DONE] and the chunked end.
        assert stream.error is None and stream.done, stream.error
        assert stream.events[-1]["error"]["code"] == "server_shutdown"
    finally:
        server.kill()


def test_while_the_model_loads_every_path_says_loading(monkeypatch):
    """The listener answers during the load: /ready, /health and the API 503 `loading` (Retry-After), so what
    waits for /health 200 (scripts, ../shared/peers/bench.py) sends work only once the model is up."""
    import asyncio

    import rawserve.engine.core as core_module
    from rawserve.api.app import OpenAIServer
    from rawserve.config import EngineConfig, ServerConfig
    from rawserve.demo_model import ensure_demo_model

    gate = threading.Event()
    real_init = core_module.EngineCore.__init__

    def slow_init(self, *args, **kwargs):  # a load that takes until the test says so
        assert gate.wait(60)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(core_module.EngineCore, "__init__", slow_init)
    app = OpenAIServer(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=64,
                                    max_model_len=256),
                       ServerConfig(port=0, served_model_name="demo", engine_mode="thread", api_key=[]))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = asyncio.run_coroutine_threadsafe(app.start(), loop)
    try:
        deadline = time.monotonic() + 30
        while app.port is None:
            assert time.monotonic() < deadline and not start.done(), "the listener never came up"
            time.sleep(0.02)

        def get(path):
            conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=10)
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            conn.close()
            return response.status, dict(response.getheaders()), json.loads(body)

        status, headers, body = get("/ready")
        assert status == 503 and body["error"]["code"] == "loading" and "retry-after" in {h.lower() for h in headers}
        status, headers, body = get("/health")
        assert status == 503 and body["error"]["code"] == "loading" and "retry-after" in {h.lower() for h in headers}
        status, _, body = get("/v1/models")
        assert status == 503 and body["error"]["code"] == "loading"
        gate.set()
        start.result(60)
        assert get("/ready")[0] == 200 and get("/health")[0] == 200
        assert get("/v1/models")[2]["data"][0]["id"] == "demo"
    finally:
        gate.set()
        if start.done() and start.exception() is None:
            asyncio.run_coroutine_threadsafe(app.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
