"""SSE responses over real sockets: framing, [DONE], error events, pings, backpressure."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, Router, SSEResponse
from tests.http.harness import client, serve


def stream_router(make_events, named: bool = False) -> Router:
    async def events(request: Request) -> SSEResponse:
        return SSEResponse(make_events(), named=named)

    router = Router()
    router.add("GET", "/events", events)

    async def ping(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})
    router.add("GET", "/ok", ping)
    return router


async def three() -> AsyncIterator[dict]:
    for i in range(3):
        yield {"i": i}


async def test_stream_frames_each_event_as_a_chunk_and_ends_with_done():
    async with serve(stream_router(three)) as server, client(server.port) as c:
        await c.send(b"GET /events HTTP/1.1\r\nHost: t\r\n\r\n")
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            raw += await c.read_raw()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"content-type: text/event-stream; charset=utf-8" in head
        assert b"transfer-encoding: chunked" in head and b"content-length" not in head
        assert body == (b'f\r\ndata: {"i":0}\n\n\r\n' b'f\r\ndata: {"i":1}\n\n\r\n' b'f\r\ndata: {"i":2}\n\n\r\n'
                        b"e\r\ndata: [DONE]\n\n\r\n" b"0\r\n\r\n")
        assert (await c.request("GET", "/ok")).status == 200  # keep-alive after a clean stream


async def test_bytes_events_are_sent_as_given():
    async def encoded() -> AsyncIterator[bytes]:
        yield b'{"pre":"encoded"}'

    async with serve(stream_router(encoded)) as server, client(server.port) as c:
        reply = await c.request("GET", "/events")
        assert reply.body == b'data: {"pre":"encoded"}\n\ndata: [DONE]\n\n'


async def test_failure_mid_stream_sends_error_event_then_done_then_closes(caplog):
    async def failing() -> AsyncIterator[dict]:
        yield {"i": 0}
        raise RuntimeError("engine exploded")

    async with serve(stream_router(failing)) as server, client(server.port) as c:
        reply = await c.request("GET", "/events")
        assert reply.status == 200
        assert reply.body == (b'data: {"i":0}\n\n'
                              b'data: {"error":{"message":"Internal server error while streaming the response.",'
                              b'"type":"server_error","param":null,"code":null}}\n\n'
                              b"data: [DONE]\n\n")
        assert reply.headers.get("connection") is None  # it was not known when the head went out
        assert await c.is_closed()
    assert any("engine exploded" in (r.exc_text or "") for r in caplog.records)


async def test_api_error_mid_stream_is_sent_in_its_own_shape():
    async def limited() -> AsyncIterator[dict]:
        yield {"i": 0}
        raise APIError(400, "Prompt too long.", param="messages", code="context_length_exceeded")

    async with serve(stream_router(limited)) as server, client(server.port) as c:
        reply = await c.request("GET", "/events")
        assert b'data: {"error":{"message":"Prompt too long.","type":"invalid_request_error","param":"messages",' \
               b'"code":"context_length_exceeded"}}\n\n' in reply.body
        assert reply.body.endswith(b"data: [DONE]\n\n")


async def test_named_events_carry_event_lines_and_end_without_done():
    async def typed() -> AsyncIterator[dict]:
        yield {"type": "response.created", "sequence_number": 0}
        raise APIError(500, "boom", code="internal_error")

    async with serve(stream_router(typed, named=True)) as server, client(server.port) as c:
        await c.send(b"GET /events HTTP/1.1\r\nHost: t\r\n\r\n")
        raw = b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            raw += await c.read_raw()
        body = raw.partition(b"\r\n\r\n")[2]
        first = b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
        error = b'event: error\ndata: {"type":"error","code":"internal_error","message":"boom","param":null}\n\n'
        assert body == b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(first), first, len(error), error)


async def test_api_error_before_the_stream_starts_is_a_plain_status():
    async def refuse(request: Request) -> SSEResponse:
        raise APIError(503, "Engine is overloaded.", code="overloaded")

    router = Router()
    router.add("POST", "/v1/chat/completions", refuse)
    async with serve(router) as server, client(server.port) as c:
        reply = await c.request("POST", "/v1/chat/completions", body=b'{"stream": true}')
        assert reply.status == 503 and reply.headers["content-type"] == "application/json"
        assert reply.json()["error"]["code"] == "overloaded"


async def test_pings_are_sent_while_the_stream_waits():
    async def slow_first() -> AsyncIterator[dict]:
        await asyncio.sleep(0.35)  # a long prefill
        yield {"i": 0}

    async with serve(stream_router(slow_first), sse_ping_interval_s=0.1) as server, client(server.port) as c:
        reply = await c.request("GET", "/events")
        before, _, after = reply.body.partition(b'data: {"i":0}\n\n')
        assert 2 <= before.count(b": ping\n\n") <= 4 and before == b": ping\n\n" * before.count(b": ping\n\n")
        assert after == b"data: [DONE]\n\n"


async def test_no_pings_while_events_flow_faster_than_the_interval():
    async def steady() -> AsyncIterator[dict]:
        for i in range(6):
            await asyncio.sleep(0.05)
            yield {"i": i}

    async with serve(stream_router(steady), sse_ping_interval_s=0.15) as server, client(server.port) as c:
        reply = await c.request("GET", "/events")
        assert b": ping" not in reply.body and reply.body.count(b"data: ") == 7


async def test_slow_reader_applies_backpressure_to_its_own_stream_only():
    produced = 0
    chunk = {"pad": "x" * 65536}

    async def big() -> AsyncIterator[dict]:
        nonlocal produced
        for _ in range(400):  # 26 MB if nobody waited for the socket
            produced += 1
            yield chunk

    async with serve(stream_router(big)) as server, client(server.port) as slow, client(server.port) as other:
        await slow.send(b"GET /events HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.3)  # the slow client reads nothing
        stalled_at = produced
        await asyncio.sleep(0.1)
        assert produced == stalled_at < 300  # stalled on full socket buffers (~4 MB here), not done
        assert (await other.request("GET", "/ok")).status == 200  # others are served meanwhile
        reply = await slow.read_reply(timeout=20)
        assert reply.body.count(b"data: ") == 401 and produced == 400


async def test_http10_stream_is_close_delimited_without_chunking():
    async with serve(stream_router(three)) as server, client(server.port) as c:
        await c.send(b"GET /events HTTP/1.0\r\n\r\n")
        data = await c.read_until_closed()
        head, _, body = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head and b"connection: close" in head
        assert body == b'data: {"i":0}\n\ndata: {"i":1}\n\ndata: {"i":2}\n\ndata: [DONE]\n\n'
