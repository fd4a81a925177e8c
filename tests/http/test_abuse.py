"""Connections that try to hold the server: idle and head-less ones evicted oldest-first at the cap, the
per-address cap, and a request framed both ways (Content-Length and Transfer-Encoding) answered, then closed.
"""
from __future__ import annotations

import asyncio

import pytest

from rawserve.http import JSONResponse, Request, Router
from tests.http.harness import RawClient, build_request, client, serve


def router() -> Router:
    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": request.body.decode()})

    r = Router()
    r.add("GET", "/health", health)
    r.add("POST", "/echo", echo)
    return r


async def settle(server, count: int) -> None:
    for _ in range(200):
        if server.num_connections == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{server.num_connections} connections, expected {count}")


async def test_content_length_with_transfer_encoding_is_answered_then_closed():
    async with serve(router()) as server, client(server.port) as c:
        smuggled = build_request("GET", "/health")
        await c.send(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"2\r\nhi\r\n0\r\n\r\n" + smuggled)
        reply = await c.read_reply()
        assert reply.status == 200 and reply.json() == {"body": "hi"}  # chunked framing wins
        assert reply.headers["connection"] == "close"
        assert await c.read_until_closed() == b""  # the bytes after it were never read as a request


async def test_at_the_cap_the_connection_idle_longest_is_closed_for_a_newcomer():
    async with serve(router(), max_connections=3, first_byte_timeout_s=30, keep_alive_s=30) as server:
        a, b, c = [await RawClient.connect(server.port) for _ in range(3)]
        await settle(server, 3)
        assert (await b.request("GET", "/health")).status == 200  # b's idle wait starts again now
        await c.send(b"GET /health HTTP/1.1\r\n")  # c: half a head, never finished
        d = await RawClient.connect(server.port)
        assert (await d.request("GET", "/health")).status == 200
        assert await a.is_closed(timeout=2)  # the oldest idle went first, without a word
        e = await RawClient.connect(server.port)
        assert (await e.request("GET", "/health")).status == 200
        assert await c.is_closed(timeout=2)  # then the head-less one, idle since it connected
        assert not await b.is_closed(timeout=0.2)
        assert (await b.request("GET", "/health")).status == 200
        assert server.num_evicted == 2
        for conn in (a, b, c, d, e):
            await conn.close()


async def test_connections_in_a_request_are_never_evicted():
    gate = asyncio.Event()

    async def slow(request: Request) -> JSONResponse:
        await gate.wait()
        return JSONResponse({"done": True})

    r = router()
    r.add("GET", "/slow", slow)
    async with serve(r, max_connections=2, first_byte_timeout_s=30) as server:
        async with client(server.port) as a, client(server.port) as b:
            await a.send(build_request("GET", "/slow"))
            await b.send(build_request("GET", "/slow"))
            while server.num_in_flight < 2:
                await asyncio.sleep(0.01)
            async with client(server.port) as c:
                reply = await c.read_reply()
                assert reply.status == 503 and reply.json()["error"]["code"] == "too_many_connections"
            gate.set()
            assert (await a.read_reply()).status == 200 and (await b.read_reply()).status == 200
            assert server.num_evicted == 0


async def test_connections_per_address_are_capped_and_other_addresses_still_get_in():
    async with serve(router(), host="0.0.0.0", max_connections_per_ip=2, first_byte_timeout_s=30) as server:
        async with client(server.port) as a, client(server.port) as b:
            await settle(server, 2)
            async with client(server.port) as c:
                reply = await c.read_reply()
                assert reply.status == 503 and "from this address" in reply.json()["error"]["message"]
            try:  # another loopback address (Linux routes all of 127/8 to lo)
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port,
                                                               local_addr=("127.0.0.2", 0))
            except OSError:
                pytest.skip("127.0.0.2 is not a local address here")
            other = RawClient(reader, writer)
            assert (await other.request("GET", "/health")).status == 200
            await other.close()
            assert (await a.request("GET", "/health")).status == 200
        await settle(server, 0)
        async with client(server.port) as again:  # the count went back down as they closed
            assert (await again.request("GET", "/health")).status == 200
