"""Hypothesis: random bytes and mutated requests never crash the server, never get a 500, and
the server keeps serving other connections. The server runs in its own thread and loop; the
fuzzing client uses blocking sockets."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rawserve.http import HTTPServer, JSONResponse, Request, Router
from tests.http.harness import make_config

VALID = [
    b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"a\": [1, 2]}",
    b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n2;x=y\r\nef\r\n0\r\nT: 1\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
    b"GET /ok HTTP/1.1\r\nHost: t\r\n\r\nGET /ok?x=1 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    b"OPTIONS /ok HTTP/1.1\r\nHost: t\r\nOrigin: https://a\r\nAccess-Control-Request-Method: GET\r\n\r\n",
    b"GET /ok HTTP/1.0\r\n\r\n",
]
# Statuses a well-behaved server may answer garbage with. A 500 would mean our code broke.
ALLOWED = {b"100", b"200", b"204", b"400", b"403", b"404", b"405", b"408", b"413", b"431", b"501", b"505"}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_server():
    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"size": len(request.body)})

    router = Router()
    router.add("GET", "/ok", ok)
    router.add("POST", "/echo", echo)
    server = HTTPServer(make_config(header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_s=0.3,
                                    max_header_bytes=2048, max_body_bytes=4096,
                                    allowed_origins=["https://a"]), router)
    loop = asyncio.new_event_loop()
    loop_errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: loop_errors.append(context))
    logs = _Collect()
    logging.getLogger("rawserve.http").addHandler(logs)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="fuzz-server", daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield server, loop_errors, logs.records
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        logging.getLogger("rawserve.http").removeHandler(logs)


def exchange(port: int, data: bytes) -> bytes:
    """Send `data`, half-close, and read until the server closes (it must, within 3 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may already have answered and closed; its answer is still readable
        out = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except socket.timeout:
                raise AssertionError(f"server kept the connection open after {data!r}") from None
            if not chunk:
                break
            out += chunk
        return bytes(out)


def check_answer(data: bytes, answer: bytes) -> None:
    if not answer:
        return  # closing without a word is allowed (e.g. EOF in the middle of a head)
    assert answer.startswith(b"HTTP/1.1 "), (data, answer[:80])
    for part in answer.split(b"HTTP/1.1 ")[1:]:
        status = part[:3]
        if status.isdigit():
            assert status in ALLOWED, (data, answer[:200])


def serves_others(port: int) -> bool:
    return exchange(port, b"GET /ok HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 200 ")


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "repeat"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.sampled_from([b"\r\n", b":", b" ", b"\x00", b"9999999999", b"chunked",
                                                  b"Content-Length: 5\r\n", b"\n", b"\xff\xfe"])
                                  | st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "repeat":
            data += data[:pos]
    return bytes(data)


SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(st.binary(max_size=1024))
def test_random_bytes_never_crash_the_server(fuzz_server, data):
    server, loop_errors, logs = fuzz_server
    check_answer(data, exchange(server.port, data))
    assert serves_others(server.port)
    assert loop_errors == [] and logs == []


@SETTINGS
@given(mutated_requests())
def test_mutated_requests_never_crash_the_server(fuzz_server, data):
    server, loop_errors, logs = fuzz_server
    check_answer(data, exchange(server.port, data))
    assert serves_others(server.port)
    assert loop_errors == [] and logs == []


def test_fuzzing_leaves_no_connection_behind(fuzz_server):
    server, loop_errors, logs = fuzz_server
    deadline = time.monotonic() + 3
    while server.num_connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.num_connections == 0 and server.num_in_flight == 0
    assert loop_errors == [] and logs == []
