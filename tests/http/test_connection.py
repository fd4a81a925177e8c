"""Connection behaviour over real sockets: keep-alive, pipelining, bodies, limits, timeouts, errors."""
from __future__ import annotations

import asyncio
import socket
import time

import orjson
import pytest

from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, Response, Router, SSEResponse, TextResponse
from tests.http.harness import RawClient, build_request, client, serve


def echo_router(calls: list[Request] | None = None) -> Router:
    async def echo(request: Request) -> Response:
        if calls is not None:
            calls.append(request)
        return JSONResponse({"method": request.method, "path": request.path, "query": request.query_string,
                             "size": len(request.body), "body": request.body.decode("latin-1"),
                             "ua": request.headers.get("USER-AGENT")})

    async def text(request: Request) -> Response:
        return TextResponse("# HELP up\nup 1\n", content_type="text/plain; version=0.0.4")

    router = Router()
    router.add("GET", "/echo", echo)
    router.add("POST", "/echo", echo)
    router.add("HEAD", "/echo", echo)
    router.add("GET", "/metrics", text)
    return router


async def test_json_response_has_content_length_and_body():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("GET", "/echo?x=1&y=2", headers=[("User-Agent", "ua/1")])
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        assert int(reply.headers["content-length"]) == len(reply.body)
        assert reply.json() == {"method": "GET", "path": "/echo", "query": "x=1&y=2", "size": 0, "body": "",
                                "ua": "ua/1"}


async def test_text_response_for_metrics():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("GET", "/metrics")
        assert reply.status == 200 and reply.body == b"# HELP up\nup 1\n"
        assert reply.headers["content-type"] == "text/plain; version=0.0.4"


async def test_head_response_has_no_body_but_the_length():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("HEAD", "/echo")
        assert reply.status == 200 and reply.body == b""
        assert int(reply.headers["content-length"]) > 0
        assert (await c.request("GET", "/echo")).status == 200  # the connection is still in sync


async def test_thousand_keep_alive_requests_on_one_connection_all_succeed():
    calls: list[Request] = []
    async with serve(echo_router(calls)) as server, client(server.port) as c:
        for i in range(1000):
            reply = await c.request("POST", f"/echo?i={i}", body=b"x" * (i % 7))
            assert reply.status == 200 and reply.json()["query"] == f"i={i}"
        assert server.num_connections == 1
    assert len(calls) == 1000


async def test_pipelined_pair_gets_answers_in_order():
    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.1)  # the first answer is slower, yet must come first
        return JSONResponse({"n": 1})

    async def fast(request: Request) -> Response:
        return JSONResponse({"n": 2})

    router = Router()
    router.add("GET", "/slow", slow)
    router.add("GET", "/fast", fast)
    async with serve(router) as server, client(server.port) as c:
        await c.send(build_request("GET", "/slow") + build_request("GET", "/fast"))
        assert (await c.read_reply()).json() == {"n": 1}
        assert (await c.read_reply()).json() == {"n": 2}


async def test_content_length_body_is_delivered_whole():
    body = bytes(range(256)) * 300
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(build_request("POST", "/echo", headers=[("Content-Length", str(len(body)))]))
        for i in range(0, len(body), 10_000):  # arrives in pieces
            await c.send(body[i:i + 10_000])
        reply = await c.read_reply()
        assert reply.json()["size"] == len(body) and reply.json()["body"] == body.decode("latin-1")


async def test_chunked_body_is_reassembled():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\n\r\n")
        reply = await c.read_reply()
        assert reply.json()["body"] == "hello world"
        assert (await c.request("GET", "/echo")).status == 200


async def test_expect_continue_gets_100_then_the_answer():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert await c.read_raw(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
        await c.send(b"hello")
        reply = await c.read_reply()
        assert reply.status == 200 and reply.json()["body"] == "hello"


async def test_expect_continue_for_a_refused_body_gets_no_100():
    async with serve(echo_router(), max_body_bytes=1000) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
        data = await c.read_until_closed()
        assert data.startswith(b"HTTP/1.1 413 ")
        assert b"100 Continue" not in data


async def test_expect_continue_to_unknown_path_gets_404_and_no_100():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(b"POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        data = await c.read_until_closed()
        assert data.startswith(b"HTTP/1.1 404 ") and b"100 Continue" not in data


async def test_ten_megabyte_body_against_one_megabyte_limit_gets_413_without_being_read():
    calls: list[Request] = []
    async with serve(echo_router(calls), max_body_bytes=1024 * 1024) as server, client(server.port) as c:
        size = 10 * 1024 * 1024
        await c.send(build_request("POST", "/echo", headers=[("Content-Length", str(size))]))
        await c.send(b"x" * 65536)  # a first slice; the other 9.9 MB are never sent
        reply = await c.read_reply()
        assert reply.status == 413
        assert reply.headers["connection"] == "close"
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and str(size) in error["message"]
        assert await c.is_closed()
    assert calls == []


async def test_chunked_body_over_the_limit_gets_413_while_counting():
    calls: list[Request] = []
    async with serve(echo_router(calls), max_body_bytes=1000) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            await c.send(b"200\r\n" + b"y" * 512 + b"\r\n")
        reply = await c.read_reply()
        assert reply.status == 413 and reply.json()["error"]["code"] == "request_too_large"
        assert await c.is_closed()
    assert calls == []


async def test_oversized_headers_get_431_and_close():
    async with serve(echo_router(), max_header_bytes=2048) as server, client(server.port) as c:
        await c.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
        reply = await c.read_reply()
        assert reply.status == 431 and reply.headers["connection"] == "close"
        assert await c.is_closed()


async def test_oversized_header_dribbled_in_pieces_gets_431():
    async with serve(echo_router(), max_header_bytes=2048) as server, client(server.port) as c:
        await c.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: ")
        for _ in range(5):
            await c.send(b"a" * 1000)
        assert (await c.read_reply()).status == 431


async def test_headers_dribbled_slowly_get_408_and_close():
    async with serve(echo_router(), header_timeout_s=0.3) as server, client(server.port) as c:
        started = time.monotonic()
        request = build_request("GET", "/echo")
        first = b""
        for byte in request[:-4]:  # one byte every 50 ms: never a complete head in time
            await c.send(bytes([byte]))
            try:
                first = await c.read_raw(timeout=0.05)
                break
            except asyncio.TimeoutError:
                continue
        c.leftover = first
        reply = await c.read_reply()
        assert reply.status == 408 and reply.headers["connection"] == "close"
        assert 0.25 < time.monotonic() - started < 1.5
        assert await c.is_closed()


async def test_body_that_stalls_gets_408_and_close():
    calls: list[Request] = []
    async with serve(echo_router(calls), body_timeout_s=0.2) as server, client(server.port) as c:
        await c.send(build_request("POST", "/echo", headers=[("Content-Length", "100")]) + b"only part")
        reply = await c.read_reply()
        assert reply.status == 408 and "body" in reply.json()["error"]["message"]
        assert await c.is_closed()
    assert calls == []


async def test_idle_keep_alive_connection_is_closed_quietly():
    async with serve(echo_router(), keep_alive_s=0.2) as server, client(server.port) as c:
        assert (await c.request("GET", "/echo")).status == 200
        assert await c.read_until_closed(timeout=1.5) == b""


async def test_connection_that_never_sends_is_closed_after_the_first_byte_timeout():
    async with serve(echo_router(), first_byte_timeout_s=0.2, keep_alive_s=5.0) as server, \
            client(server.port) as c:
        started = time.monotonic()
        assert await c.read_until_closed(timeout=1.5) == b""
        assert time.monotonic() - started < 1.0  # the first byte's wait, not keep-alive's
        assert server.num_connections == 0


async def test_a_first_byte_starts_the_header_timeout():
    async with serve(echo_router(), first_byte_timeout_s=0.2, header_timeout_s=0.6) as server, \
            client(server.port) as c:
        await c.send(b"GET /echo HTTP/1.1\r\n")
        await asyncio.sleep(0.4)  # past the first byte's wait; the head's own has not run out
        await c.send(b"Host: test\r\n\r\n")
        assert (await c.read_reply()).status == 200


async def test_connection_close_header_is_honoured():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("GET", "/echo", headers=[("Connection", "close")])
        assert reply.status == 200 and reply.headers["connection"] == "close"
        assert await c.is_closed()


async def test_http10_request_gets_an_answer_and_a_close():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(b"GET /echo HTTP/1.0\r\n\r\n")
        data = await c.read_until_closed()
        assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close\r\n" in data


@pytest.mark.parametrize("garbage", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: t\r\n\r\n",
    b"GET /echo HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n",
])
async def test_malformed_request_gets_4xx_or_501_and_close(garbage):
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(garbage)
        data = await c.read_until_closed()
        status = int(data.split(b" ", 2)[1])
        assert status in (400, 501, 505), data
        assert b"connection: close" in data and b'"error"' in data


async def test_malformed_chunked_body_gets_400_and_close():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n")
        data = await c.read_until_closed()
        assert data.startswith(b"HTTP/1.1 400 ")


async def test_handler_exception_before_response_is_500_in_openai_shape_and_keeps_the_connection(caplog):
    async def broken(request: Request) -> Response:
        raise RuntimeError("boom")

    router = echo_router()
    router.add("GET", "/broken", broken)
    async with serve(router) as server, client(server.port) as c:
        reply = await c.request("GET", "/broken")
        assert reply.status == 500
        assert reply.json() == {"error": {"message": "Internal server error.", "type": "server_error",
                                          "param": None, "code": "internal_error"}}
        assert b"boom" not in reply.body
        assert (await c.request("GET", "/echo")).status == 200
    assert any("boom" in (r.exc_text or "") for r in caplog.records)


async def test_api_error_raised_by_handler_becomes_its_status_and_headers():
    async def limited(request: Request) -> Response:
        raise APIError(429, "Slow down.", code="rate_limited", headers=[(b"retry-after", b"3")])

    router = Router()
    router.add("GET", "/limited", limited)
    async with serve(router) as server, client(server.port) as c:
        reply = await c.request("GET", "/limited")
        assert reply.status == 429 and reply.headers["retry-after"] == "3"
        assert reply.json() == {"error": {"message": "Slow down.", "type": "rate_limit_error", "param": None,
                                          "code": "rate_limited"}}


async def test_handler_returning_a_non_response_is_a_500():
    async def wrong(request: Request) -> dict:
        return {"not": "a response"}

    router = Router()
    router.add("GET", "/wrong", wrong)
    async with serve(router) as server, client(server.port) as c:
        assert (await c.request("GET", "/wrong")).status == 500


async def test_invalid_json_body_is_a_400_in_openai_shape():
    async def takes_json(request: Request) -> Response:
        return JSONResponse(request.json())

    router = Router()
    router.add("POST", "/j", takes_json)
    async with serve(router) as server, client(server.port) as c:
        reply = await c.request("POST", "/j", body=b"{not json")
        assert reply.status == 400 and reply.json()["error"]["type"] == "invalid_request_error"
        reply = await c.request("POST", "/j", body=b"[1, 2]")
        assert reply.status == 400 and "JSON object" in reply.json()["error"]["message"]
        reply = await c.request("POST", "/j", body=b'{"a": 1}')
        assert reply.status == 200 and reply.json() == {"a": 1}


async def test_response_header_with_a_newline_is_refused_at_construction():
    with pytest.raises(ValueError):
        Response(b"", 200, [("x-evil", "a\r\nset-cookie: b")])


async def test_small_body_sent_to_an_unknown_path_is_drained_and_the_connection_kept():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("POST", "/nope", body=b'{"a": 1}')
        assert reply.status == 404 and "connection" not in reply.headers
        assert (await c.request("GET", "/echo")).status == 200


async def test_reply_is_written_once_for_a_large_body():
    big = orjson.dumps({"x": "y" * 500_000})

    async def large(request: Request) -> Response:
        return Response(big, content_type="application/json")

    router = Router()
    router.add("GET", "/large", large)
    async with serve(router) as server:
        c = await RawClient.connect(server.port)
        try:
            reply = await c.request("GET", "/large")
            assert reply.body == big
        finally:
            await c.close()


async def test_requests_pipelined_behind_an_early_refusal_are_still_answered():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(build_request("GET", "/nope") + build_request("GET", "/echo?after=404"))
        assert (await c.read_reply()).status == 404
        reply = await c.read_reply()
        assert reply.status == 200 and reply.json()["query"] == "after=404"


async def test_head_request_to_an_unknown_path_gets_a_bodiless_404():
    async with serve(echo_router()) as server, client(server.port) as c:
        reply = await c.request("HEAD", "/nope")
        assert reply.status == 404 and reply.body == b"" and int(reply.headers["content-length"]) > 0
        assert (await c.request("GET", "/echo")).status == 200


async def test_query_parameters_are_parsed_on_demand():
    seen: list[dict] = []

    async def query(request: Request) -> Response:
        seen.append(request.query)
        return JSONResponse({})

    router = Router()
    router.add("GET", "/q", query)
    async with serve(router) as server, client(server.port) as c:
        await c.request("GET", "/q?a=1&b=x%20y&a=2&empty=")
    assert seen == [{"a": "1", "b": "x y", "empty": ""}]


async def test_handler_that_swallows_its_cancellation_still_loses_the_connection():
    swallowed = asyncio.Event()

    async def stubborn(request: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # a badly behaved handler: it returns instead of re-raising
        return JSONResponse({"late": True})

    router = Router()
    router.add("GET", "/stubborn", stubborn)
    async with serve(router) as server:
        async with client(server.port) as c:
            await c.send(build_request("GET", "/stubborn"))
            await asyncio.sleep(0.05)
        await asyncio.wait_for(swallowed.wait(), 1)
        for _ in range(100):
            if server.num_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert server.num_connections == 0 and server.num_in_flight == 0


# --- RFC 9112 corners (issue 33, item 5) ----------------------------------------------------------------


async def test_absolute_form_request_target_is_routed_by_its_path():
    async with serve(echo_router()) as server, client(server.port) as c:
        await c.send(f"POST http://127.0.0.1:{server.port}/echo?x=1 HTTP/1.1\r\nHost: t\r\n"
                     "Content-Length: 2\r\n\r\nhi".encode())
        reply = await c.read_reply()
        assert reply.status == 200 and reply.json()["path"] == "/echo" and reply.json()["query"] == "x=1"
        assert reply.json()["body"] == "hi"


def half_close_router() -> Router:
    async def slow(request: Request) -> Response:
        await asyncio.sleep(0.2)  # the client's FIN arrives while this runs
        return JSONResponse({"body": request.body.decode()})

    async def stream(request: Request) -> SSEResponse:
        async def events():
            for i in range(4):
                await asyncio.sleep(0.05)
                yield {"i": i}
        return SSEResponse(events())

    router = Router()
    router.add("POST", "/slow", slow)
    router.add("GET", "/stream", stream)
    return router


async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer():
    async with serve(half_close_router()) as server, client(server.port) as c:
        await c.send(build_request("POST", "/slow", b'{"q": 1}'))
        c.writer.write_eof()  # shutdown(SHUT_WR): the request is complete, the client still reads
        reply = await c.read_reply()
        assert reply.status == 200 and reply.json() == {"body": '{"q": 1}'}
        assert reply.informational in ([], [100])  # a probe for a full close may come first
        assert await c.is_closed()  # nothing more can come from this client: the server closes after


async def test_a_request_sent_with_its_fin_in_one_go_is_answered():
    async with serve(half_close_router()) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(build_request("POST", "/slow", b"x"))
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(3)
            data = await asyncio.get_running_loop().run_in_executor(None, _read_all, sock)
        assert b"HTTP/1.1 200 " in data and data.endswith(b'{"body":"x"}')


def _read_all(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


async def test_a_stream_to_a_half_closed_client_runs_to_done():
    async with serve(half_close_router()) as server, client(server.port) as c:
        await c.send(build_request("GET", "/stream"))
        c.writer.write_eof()
        reply = await c.read_reply()
        assert reply.status == 200
        assert [line for line in reply.body.split(b"\n\n") if line.startswith(b"data:")] == [
            b'data: {"i":0}', b'data: {"i":1}', b'data: {"i":2}', b'data: {"i":3}', b"data: [DONE]"]
        assert await c.is_closed()


async def test_a_half_close_before_the_request_is_complete_ends_the_connection():
    calls: list[Request] = []
    async with serve(echo_router(calls)) as server, client(server.port) as c:
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        c.writer.write_eof()
        data = await c.read_until_closed()
        assert data == b"" or data.startswith(b"HTTP/1.1 400 ")
    assert calls == []


async def test_chunk_size_over_the_body_limit_gets_413_at_once():
    calls: list[Request] = []
    async with serve(echo_router(calls), max_body_bytes=1000, body_timeout_s=10) as server, \
            client(server.port) as c:
        started = time.monotonic()
        await c.send(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\nab")
        reply = await c.read_reply()
        assert reply.status == 413 and reply.json()["error"]["code"] == "request_too_large"
        assert time.monotonic() - started < 1.0  # not after the body timeout
        assert await c.is_closed()
    assert calls == []


async def test_obs_fold_header_line_gets_400_and_close():
    calls: list[Request] = []
    async with serve(echo_router(calls)) as server, client(server.port) as c:
        await c.send(b"GET /echo HTTP/1.1\r\nHost: t\r\nUser-Agent: ua\r\n\tfolded/1\r\n\r\n")
        reply = await c.read_reply()
        assert reply.status == 400 and "folding" in reply.json()["error"]["message"]
        assert reply.headers["connection"] == "close"
    assert calls == []


@pytest.mark.parametrize("body", [b'{"a": "\xff"}', b'{"a": "\xed\xa0\x80"}', b'{"a": "caf\xc3"}'])
async def test_invalid_utf8_in_a_json_body_says_so(body):
    async def takes_json(request: Request) -> Response:
        return JSONResponse(request.json())

    router = Router()
    router.add("POST", "/j", takes_json)
    async with serve(router) as server, client(server.port) as c:
        reply = await c.request("POST", "/j", body=body)
        error = reply.json()["error"]
        assert reply.status == 400 and "body is not valid UTF-8" in error["message"], error
        assert "surrogates" not in error["message"] and error["type"] == "invalid_request_error"
