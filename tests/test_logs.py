"""Log lines an operator reads: progress with size and rate, the stats line while busy, the access line and the
error lines of one request (4xx at debug, 5xx at error with the rid)."""
from __future__ import annotations

import io
import logging

import pytest

from rawserve.api.access_log import current, logged
from rawserve.api.status_log import StatsLogger, startup_summary
from rawserve.config import EngineConfig, ServerConfig
from rawserve.engine.types import EngineStats
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, SSEResponse
from rawserve.http.messages import Headers
from rawserve.logs import Progress, setup_logging
from rawserve.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_logs_size_and_rate_periodically(caplog):
    clock, log = Clock(), logging.getLogger("rawserve.test")
    with caplog.at_level(logging.INFO, "rawserve.test"):
        progress = Progress("loading", 4 << 20, log, stream=io.StringIO(), log_interval_s=5, clock=clock)
        clock.now = 1.0
        progress.update(1 << 20)  # within the interval: quiet
        clock.now = 6.0
        progress.update(1 << 20)
        clock.now = 8.0
        progress.update(2 << 20)
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["loading: 2.0 MiB / 4.0 MiB (50%) in 6.0 s, 341.3 KiB/s",
                     "loading: 4.0 MiB / 4.0 MiB (100%) in 8.0 s, 512.0 KiB/s"]


def test_progress_on_a_terminal_draws_a_bar_then_logs_the_outcome(caplog):
    clock, stream = Clock(), TTY()
    with caplog.at_level(logging.INFO, "rawserve.test"):
        progress = Progress("writing", 1000, logging.getLogger("rawserve.test"), stream=stream, clock=clock)
        clock.now = 0.5
        progress.update(500)
        clock.now = 1.0
        progress.update(500)
        progress.close()
    assert "\r[###############...............] writing: 500 B / 1000 B (50%)" in stream.getvalue()
    assert [r.getMessage() for r in caplog.records] == ["writing: 1000 B / 1000 B (100%) in 1.0 s, 1000 B/s"]


def test_setup_logging_twice_changes_the_level_without_doubling_lines():
    stream = io.StringIO()
    root = logging.getLogger()
    before, root_level = list(root.handlers), root.level
    try:
        setup_logging("info", stream)
        setup_logging("debug", stream)
        logging.getLogger("rawserve.x").debug("once")
        assert stream.getvalue().count("once") == 1 and " DEBUG MainProcess rawserve.x: once" in stream.getvalue()
    finally:
        for handler in root.handlers[:]:
            if handler not in before:
                root.removeHandler(handler)
        root.setLevel(root_level)
        logging.getLogger("rawserve").setLevel(logging.NOTSET)


class FakeLLM:
    def __init__(self) -> None:
        self.metrics = Metrics("m")
        self.core_stats = EngineStats()


def test_stats_line_every_interval_while_busy_and_silence_when_idle(caplog):
    llm, clock = FakeLLM(), Clock()
    stats = StatsLogger(llm, 10.0, clock)
    clock.now = 10.0
    assert stats.tick() is None  # nothing happened
    llm.metrics.inc("prompt_tokens_total", 200)
    llm.metrics.inc("generation_tokens_total", 500)
    llm.metrics.set_total("prefix_cache_queries_total", 200)
    llm.metrics.set_total("prefix_cache_hits_total", 50)
    llm.core_stats = EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.125)
    clock.now = 20.0
    with caplog.at_level(logging.INFO, "rawserve"):
        line = stats.tick()
    assert line == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%")
    assert caplog.records[-1].getMessage() == line
    llm.core_stats = EngineStats()
    clock.now = 30.0
    assert stats.tick() is None


def test_startup_summary_names_everything_an_operator_checks(tmp_path):
    from rawserve.demo_model import ensure_demo_model

    demo = ensure_demo_model()
    line = startup_summary(EngineConfig(model_dir=str(demo)), ServerConfig(host="0.0.0.0", api_key=["k"]), "demo",
                           {"max_model_len": 512, "num_blocks": 10, "block_size": 16, "dtype": "float32",
                            "device": "cpu", "kv_cache_bytes": 5 << 20,
                            "kv_cache_reason": "what 1 sequences x 160 tokens can use", "num_threads": 2,
                            "threads_reason": "auto: 2 CPUs in the affinity mask"}, 8001)
    for part in (str(demo), "Qwen3ForCausalLM", "1.05M parameters", "dtype float32", "device cpu",
                 "2 engine threads [auto: 2 CPUs in the affinity mask]", "max_model_len 512",
                 "KV cache 160 tokens (10 blocks of 16, 5.0 MiB) [what 1 sequences x 160 tokens can use]",
                 "engine in a process",
                 "listening on http://0.0.0.0:8001/v1", "API key on"):
        assert part in line, part


def test_startup_summary_reads_no_safetensors_header_when_the_core_counted(monkeypatch):
    from rawserve.api import status_log
    from rawserve.demo_model import ensure_demo_model

    def no_open(*args, **kwargs):
        raise AssertionError("a safetensors header was read on the event loop")

    monkeypatch.setattr(status_log, "open", no_open, raising=False)  # shadows the builtin in that module only
    line = startup_summary(EngineConfig(model_dir=str(ensure_demo_model())), ServerConfig(), "demo",
                           {"num_params": 2_000_000}, 8001)
    assert "Qwen3ForCausalLM, 2.00M parameters" in line


def request(path: str = "/v1/completions") -> Request:
    return Request("POST", path, "", Headers([]), b"{}", client=("10.0.0.7", 5555))


class FakeTally:
    num_prompt_tokens = 7
    completion_tokens = 4


async def test_access_line_for_a_json_response(caplog):
    async def handler(req: Request) -> JSONResponse:
        record = current()
        record.rid, record.tally = "cmpl-1", FakeTally()
        record.first_token()
        record.finish_reasons.append("stop")
        return JSONResponse({})

    with caplog.at_level(logging.DEBUG, "rawserve"):
        await logged(handler)(request())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "rawserve.access"]
    assert line.startswith('10.0.0.7:5555 "POST /v1/completions" 200 prompt_tokens=7 output_tokens=4 ttft_ms=')
    assert line.endswith("finish=stop rid=cmpl-1") and "total_ms=" in line


@pytest.mark.parametrize("status, level", [(400, logging.DEBUG), (503, logging.ERROR)])
async def test_errors_4xx_at_debug_5xx_at_error_with_the_rid(caplog, status, level):
    async def handler(req: Request) -> JSONResponse:
        current().rid = "chatcmpl-9"
        raise APIError(status, "nope", code="why")

    with caplog.at_level(logging.DEBUG, "rawserve"), pytest.raises(APIError):
        await logged(handler)(request())
    (error,) = [r for r in caplog.records if r.name == "rawserve.api"]
    assert error.levelno == level and "rid=chatcmpl-9" in error.getMessage() and "nope" in error.getMessage()
    (access,) = [r.getMessage() for r in caplog.records if r.name == "rawserve.access"]
    assert f'"POST /v1/completions" {status} ' in access


async def test_a_stream_is_logged_when_its_last_event_went_out_and_disabled_logs_nothing(caplog):
    async def events():
        current().first_token()
        yield {"a": 1}
        current().finish_reasons.append("length")
        yield {"b": 2}

    async def handler(req: Request) -> SSEResponse:
        current().tally = FakeTally()
        return SSEResponse(events())

    with caplog.at_level(logging.INFO, "rawserve"):
        response = await logged(handler)(request())
        assert not caplog.records  # not yet: the stream has not run
        assert [e async for e in response.events] == [{"a": 1}, {"b": 2}]
        (line,) = [r.getMessage() for r in caplog.records]
        assert '" 200 prompt_tokens=7 output_tokens=4 ttft_ms=' in line and "finish=length" in line
        caplog.clear()
        response = await logged(handler, is_enabled=False)(request())
        assert [e async for e in response.events] == [{"a": 1}, {"b": 2}]
        assert not caplog.records


def test_requests_the_http_layer_refuses_get_their_access_line(caplog):
    import h11

    from rawserve.api.access_log import refusal_logger
    from rawserve.http.auth import APIKeyAuth
    from rawserve.http.dispatch import Dispatcher
    from rawserve.http.messages import RequestHead
    from rawserve.http.routing import CORSPolicy, Router

    router = Router()

    async def models(req: Request) -> JSONResponse:
        return JSONResponse({})

    router.add("GET", "/v1/models", models)
    dispatcher = Dispatcher(router, APIKeyAuth(["k"]), CORSPolicy([]), on_refusal=refusal_logger(True))
    with caplog.at_level(logging.INFO, "rawserve"):
        for method, path, key, status in (("GET", "/v1/models", None, 401), ("GET", "/nope", "k", 404),
                                          ("POST", "/v1/models", "k", 405)):
            raw = [(b"host", b"x")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
            head = RequestHead(h11.Request(method=method, target=path, headers=raw), 65536)
            request = Request(method, path, "", head.headers, b"", "1.1", ("10.0.0.9", 1))
            answer, _ = dispatcher.admit(head, request)
            assert answer.status == status
        assert refusal_logger(False) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "rawserve.access"]
    assert [line.split(" total_ms")[0] for line in lines] == [
        '10.0.0.9:1 "GET /v1/models" 401', '10.0.0.9:1 "GET /nope" 404', '10.0.0.9:1 "POST /v1/models" 405']


def test_framing_refusals_get_their_access_line_too(caplog):
    from rawserve.api.access_log import refusal_logger
    from rawserve.config import ServerConfig
    from rawserve.http.auth import APIKeyAuth
    from rawserve.http.dispatch import Dispatcher
    from rawserve.http.protocol import HTTPProtocol
    from rawserve.http.routing import CORSPolicy, Router

    config = ServerConfig(max_body_bytes=10)
    router = Router()

    async def echo(req: Request) -> JSONResponse:
        return JSONResponse({})

    router.add("POST", "/x", echo)
    dispatcher = Dispatcher(router, APIKeyAuth([]), CORSPolicy([]), on_refusal=refusal_logger(True))
    with caplog.at_level(logging.INFO, "rawserve"):
        for data in (b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 99\r\n\r\n", b"NOT HTTP\r\n\r\n"):
            protocol = HTTPProtocol(config, dispatcher, clock=lambda: 0.0, client=("10.0.0.8", 2))
            protocol.receive_data(data)
            protocol.next_action()
        slow = HTTPProtocol(config, dispatcher, clock=lambda: 0.0, client=("10.0.0.8", 3))
        slow.receive_data(b"GET /x HTTP/1.1\r\nhost")  # a head that never ends
        slow.next_action()
        assert slow.tick(1e9) is not None
    lines = [r.getMessage().split(" total_ms")[0] for r in caplog.records if r.name == "rawserve.access"]
    assert lines == ['10.0.0.8:2 "POST /x" 413', '10.0.0.8:2 "- -" 400', '10.0.0.8:3 "- -" 408']
