"""The listener: connection cap, graceful drain (in process and by signal), second signal."""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import pytest

from rawserve.http import HTTPServer, JSONResponse, Request, Router
from tests.conftest import ROOT
from tests.http.harness import build_request, client, make_config, serve


def slow_router(started: asyncio.Event | None = None, cancelled: list | None = None) -> Router:
    async def fast(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def slow(request: Request) -> JSONResponse:
        if started is not None:
            started.set()
        try:
            await asyncio.sleep(float(request.query.get("s", "0.3")))
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.append(request.path)
            raise
        return JSONResponse({"slept": True})

    router = Router()
    router.add("GET", "/fast", fast)
    router.add("GET", "/slow", slow)
    return router


async def test_start_on_port_zero_exposes_the_bound_port():
    async with serve(slow_router()) as server, client(server.port) as c:
        assert server.port > 0
        assert (await c.request("GET", "/fast")).status == 200


async def test_connection_over_the_cap_gets_503_and_close_when_every_connection_is_busy():
    async with serve(slow_router(), max_connections=2) as server:
        async with client(server.port) as a, client(server.port) as b:
            await a.send(build_request("GET", "/slow?s=2"))
            await b.send(build_request("GET", "/slow?s=2"))
            while server.num_in_flight < 2:
                await asyncio.sleep(0.01)
            async with client(server.port) as third:
                reply = await third.read_reply()
                assert reply.status == 503 and reply.headers["connection"] == "close"
                assert reply.json()["error"]["code"] == "too_many_connections"
                assert await third.is_closed()
            assert server.num_connections == 2
        for _ in range(100):  # the two closed; a newcomer fits again
            if server.num_connections == 0:
                break
            await asyncio.sleep(0.01)
        async with client(server.port) as again:
            assert (await again.request("GET", "/fast")).status == 200


async def test_graceful_shutdown_503s_new_requests_and_lets_in_flight_finish():
    started = asyncio.Event()
    drained: list[bool] = []
    server = HTTPServer(make_config(drain_timeout_s=5.0), slow_router(started))
    server.on_drain(lambda: drained.append(server.is_draining))
    await server.start()
    async with client(server.port) as idle, client(server.port) as busy:
        assert (await idle.request("GET", "/fast")).status == 200
        await busy.send(build_request("GET", "/slow?s=0.3"))
        await started.wait()
        shutdown = asyncio.create_task(server.shutdown())
        await asyncio.sleep(0.05)
        assert server.is_draining and drained == [True]
        reply = await idle.request("GET", "/fast")  # a new request on an open connection
        assert reply.status == 503 and reply.headers["connection"] == "close"
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "server_shutting_down"
        async with client(server.port) as late:  # a new connection is still accepted, and told to go elsewhere
            reply = await late.request("GET", "/fast")
            assert reply.status == 503 and reply.headers["retry-after"] == "1"
        reply = await busy.read_reply()  # the in-flight one finishes normally
        assert reply.status == 200 and reply.json() == {"slept": True}
        assert reply.headers["connection"] == "close"
        await asyncio.wait_for(shutdown, 2)
    assert server.num_connections == 0 and server.num_in_flight == 0


async def test_drain_timeout_cancels_requests_still_in_flight():
    started = asyncio.Event()
    cancelled: list[str] = []
    server = HTTPServer(make_config(drain_timeout_s=0.2), slow_router(started, cancelled))
    await server.start()
    async with client(server.port) as busy:
        await busy.send(build_request("GET", "/slow?s=30"))
        await started.wait()
        began = time.monotonic()
        await server.shutdown()
        assert 0.1 < time.monotonic() - began < 0.5  # the whole shutdown fits in drain_timeout_s, give or take the box
        assert cancelled == ["/slow"]
        reply = await busy.read_reply()  # told why, rather than cut off
        assert reply.status == 503 and reply.json()["error"]["code"] == "server_shutdown"
        assert reply.headers["connection"] == "close"
        assert await busy.is_closed()


async def test_drain_timeout_ends_a_running_stream_with_an_error_event_done_and_the_chunked_end():
    from rawserve.http import SSEResponse

    started = asyncio.Event()

    async def events():
        yield {"n": 1}
        started.set()
        await asyncio.sleep(30)
        yield {"n": 2}

    async def stream(request: Request) -> SSEResponse:
        return SSEResponse(events())

    router = slow_router()
    router.add("GET", "/stream", stream)
    server = HTTPServer(make_config(drain_timeout_s=0.2), router)
    await server.start()
    async with client(server.port) as c:
        await c.send(build_request("GET", "/stream"))
        await started.wait()
        await server.shutdown()
        reply = await c.read_reply()  # h11 parses it to EndOfMessage: the chunked body ended properly
        events = [line[6:] for line in reply.body.decode().split("\n\n") if line.startswith("data: ")]
        assert events[0] == '{"n":1}' and events[-1] == "[DONE]"
        error = json.loads(events[1])["error"]
        assert error["code"] == "server_shutdown" and len(events) == 3
        assert await c.is_closed()


async def start_script(drain_timeout_s: float) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.http.serve_script", str(drain_timeout_s), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE)
    port = int(await asyncio.wait_for(proc.stdout.readline(), 20))
    return proc, port


async def test_sigterm_drains_in_flight_requests_and_exits_zero():
    proc, port = await start_script(drain_timeout_s=5.0)
    try:
        async with client(port) as idle, client(port) as busy:
            assert (await idle.request("GET", "/fast")).status == 200
            await busy.send(build_request("GET", "/slow?s=0.5"))
            await asyncio.sleep(0.15)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"draining\n"
            assert (await idle.request("GET", "/fast")).status == 503
            async with client(port) as late:
                assert (await late.request("GET", "/fast")).status == 503
            reply = await busy.read_reply()
            assert reply.status == 200 and reply.json() == {"slept": True}
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_second_signal_exits_at_once():
    proc, port = await start_script(drain_timeout_s=30.0)
    try:
        async with client(port) as busy:
            await busy.send(build_request("GET", "/slow?s=30"))
            await asyncio.sleep(0.15)
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"draining\n"
            began = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 5) == 128 + signal.SIGINT
            assert time.monotonic() - began < 1.0
            left = await busy.read_until_closed()  # closed; a 503 server_shutdown if it left before the exit
            assert left == b"" or (left.startswith(b"HTTP/1.1 503 ") and b"server_shutdown" in left)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
