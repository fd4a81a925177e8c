"""A client leaving while its handler runs cancels the handler's task within 100 ms."""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import AsyncIterator

import pytest

from rawserve.http import JSONResponse, Request, Router, SSEResponse
from tests.http.harness import build_request, client, serve


class Probe:
    """Records when the code under a handler saw cancellation and whether its cleanup ran."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled_at: float | None = None
        self.cleaned_up = False


def waiting_router(probe: Probe) -> Router:
    async def stream(request: Request) -> SSEResponse:
        async def events() -> AsyncIterator[dict]:
            try:
                yield {"token": "first"}
                probe.started.set()
                await asyncio.sleep(30)  # waiting for the next token that never comes
                yield {"token": "never"}
            except asyncio.CancelledError:
                probe.cancelled_at = time.monotonic()
                raise
            finally:
                probe.cleaned_up = True  # where the API layer will abort the engine request
        return SSEResponse(events())

    async def unary(request: Request) -> JSONResponse:
        probe.started.set()
        try:
            await asyncio.sleep(30)  # a long non-streaming generation
        except asyncio.CancelledError:
            probe.cancelled_at = time.monotonic()
            raise
        return JSONResponse({})

    router = Router()
    router.add("GET", "/stream", stream)
    router.add("GET", "/unary", unary)
    return router


async def wait_for_cancel(probe: Probe, server) -> None:
    for _ in range(100):
        if probe.cancelled_at is not None and server.num_connections == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the handler was not cancelled")


async def test_client_closing_mid_stream_cancels_the_handler_within_100ms():
    probe = Probe()
    async with serve(waiting_router(probe)) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/stream"))
            assert b'data: {"token":"first"}' in await c.read_raw()
            await probe.started.wait()
            closed_at = time.monotonic()
        await wait_for_cancel(probe, server)
        assert probe.cancelled_at - closed_at < 0.1
        assert probe.cleaned_up
        assert server.num_in_flight == 0


async def test_client_closing_during_a_unary_handler_cancels_it_within_100ms():
    probe = Probe()
    async with serve(waiting_router(probe)) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/unary"))
            await probe.started.wait()  # closes right away, while the handler sleeps
            closed_at = time.monotonic()
        await wait_for_cancel(probe, server)
        assert probe.cancelled_at - closed_at < 0.1
        assert server.num_in_flight == 0


async def test_client_reset_mid_stream_cancels_the_handler_within_100ms():
    probe = Probe()
    async with serve(waiting_router(probe)) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/stream"))
            await c.read_raw()
            await probe.started.wait()
            sock = c.writer.get_extra_info("socket")
            # Linger 0: close() sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            closed_at = time.monotonic()
            c.writer.transport.abort()
        await wait_for_cancel(probe, server)
        assert probe.cancelled_at - closed_at < 0.1


async def test_pipelined_request_during_a_slow_handler_is_kept_not_taken_for_eof():
    cancelled = []

    async def slow(request: Request) -> JSONResponse:
        try:
            await asyncio.sleep(0.2)  # /b's bytes arrive meanwhile, and must not read as EOF
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return JSONResponse({"n": request.path})

    router = Router()
    router.add("GET", "/a", slow)
    router.add("GET", "/b", slow)
    async with serve(router) as server, client(server.port) as c:
        await c.send(build_request("GET", "/a"))
        await asyncio.sleep(0.1)
        await c.send(build_request("GET", "/b"))  # arrives while /a runs
        assert (await c.read_reply()).json() == {"n": "/a"}
        assert (await c.read_reply()).json() == {"n": "/b"}
        assert (await c.request("GET", "/a")).status == 200
    assert cancelled == []


async def test_client_leaving_while_the_stream_waits_on_a_full_socket_cancels_it_within_100ms():
    """A client that stops reading makes the stream wait in drain(); its leaving must still be seen
    at once (no write will ever fail to tell us), the stream cancelled and its generator closed."""
    probe = Probe()
    blob = "x" * 65536

    async def flood(request: Request) -> SSEResponse:
        async def events() -> AsyncIterator[dict]:
            try:
                for _ in range(100_000):
                    probe.started.set()
                    yield {"blob": blob}
            finally:  # the cancellation lands in drain(), so the generator sees only its close
                probe.cancelled_at = time.monotonic()
                probe.cleaned_up = True
        return SSEResponse(events())

    router = Router()
    router.add("GET", "/flood", flood)
    async with serve(router) as server:
        async with client(server.port) as c:
            sock = c.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.writer.transport.pause_reading()  # a client that stopped reading
            await c.send(build_request("GET", "/flood"))
            await asyncio.wait_for(probe.started.wait(), 5)
            await asyncio.sleep(0.3)  # the kernel's buffers and the transport's fill; drain() waits
            assert probe.cancelled_at is None and server.num_in_flight == 1
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            closed_at = time.monotonic()
            c.writer.transport.abort()
        await wait_for_cancel(probe, server)
        assert probe.cancelled_at - closed_at < 0.1
        assert probe.cleaned_up
        assert server.num_in_flight == 0


async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout():
    """No EOF ever comes from a client that just stops reading; the write timeout must end its
    stream (closing the generator, which is what aborts an engine request) and its connection."""
    closed_at: list[float] = []
    started = asyncio.Event()
    blob = "x" * 65536

    async def flood(request: Request) -> SSEResponse:
        async def events() -> AsyncIterator[dict]:
            try:
                while True:
                    started.set()
                    yield {"blob": blob}
            finally:
                closed_at.append(time.monotonic())
        return SSEResponse(events())

    router = Router()
    router.add("GET", "/flood", flood)
    async with serve(router, write_timeout_s=0.3) as server:
        async with client(server.port) as c:
            c.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.writer.transport.pause_reading()
            await c.send(build_request("GET", "/flood"))
            await asyncio.wait_for(started.wait(), 5)
            stalled_at = time.monotonic()
            for _ in range(300):
                if closed_at and server.num_connections == 0:
                    break
                await asyncio.sleep(0.01)
            assert closed_at, "the stalled stream was never ended"
            assert 0.25 < closed_at[0] - stalled_at < 1.0
            assert server.num_connections == 0 and server.num_in_flight == 0
            c.writer.transport.resume_reading()
            # The server reset the connection (nothing more trickles out of its kernel buffers).
            with pytest.raises(ConnectionResetError):
                while await asyncio.wait_for(c.reader.read(1 << 20), 2):
                    pass


async def test_a_slow_reader_within_the_write_timeout_gets_the_whole_stream():
    blob = "y" * 65536

    async def burst(request: Request) -> SSEResponse:
        async def events() -> AsyncIterator[dict]:
            for n in range(40):  # 2.6 MB: well past every buffer, so the stream waits on drain()
                yield {"n": n, "blob": blob}
        return SSEResponse(events())

    router = Router()
    router.add("GET", "/burst", burst)
    async with serve(router, write_timeout_s=0.5) as server, client(server.port) as c:
        await c.send(build_request("GET", "/burst"))
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            await asyncio.sleep(0.05)  # reads in slow sips, but never stalls for the whole timeout
            data += await asyncio.wait_for(c.reader.read(256 * 1024), 3)
        assert data.count(b'"blob"') == 40 and b"data: [DONE]" in data


async def test_a_client_that_half_closed_and_then_closed_for_good_is_cancelled_at_the_next_probe():
    """The probe's 100 Continue was read, so the later close sends nothing; the next probe draws a reset."""
    from rawserve.http.connection import PROBE_INTERVAL_S

    probe = Probe()
    async with serve(waiting_router(probe)) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/unary"))
            c.writer.write_eof()  # half-closed: the handler goes on
            await probe.started.wait()
            assert await c.read_raw(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
            await asyncio.sleep(0.2)
            assert probe.cancelled_at is None  # a half-close alone is not leaving
            closed_at = time.monotonic()
        for _ in range(int(PROBE_INTERVAL_S * 100) + 50):
            if probe.cancelled_at is not None and server.num_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert probe.cancelled_at is not None and probe.cancelled_at - closed_at < PROBE_INTERVAL_S + 0.2
        assert server.num_in_flight == 0


async def test_a_half_closed_stream_client_that_resets_is_cancelled_within_100ms():
    probe = Probe()
    async with serve(waiting_router(probe)) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/stream"))
            c.writer.write_eof()
            await c.read_raw()
            await probe.started.wait()
            await asyncio.sleep(0.05)
            assert probe.cancelled_at is None
            sock = c.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            closed_at = time.monotonic()
            c.writer.transport.abort()
        await wait_for_cancel(probe, server)
        assert probe.cancelled_at - closed_at < 0.1
