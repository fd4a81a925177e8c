"""HTTPProtocol without sockets: bytes and events in, actions out, time from a fake clock."""
from __future__ import annotations

from typing import Any

import h11
import pytest

from rawserve.config import ServerConfig
from rawserve.http import APIKeyAuth, CORSPolicy, JSONResponse, Request, Response, Router, SSEResponse
from rawserve.http.dispatch import Dispatcher
from rawserve.http.protocol import (CONTINUE, NEED_DATA, NEVER, AfterEOF, Close, Dispatch, HTTPProtocol, Phase,
                                    Write)
from tests.http.harness import build_request


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def echo(request: Request) -> Response:  # never awaited here: only its identity matters
    return JSONResponse({})


async def other(request: Request) -> Response:
    return JSONResponse({})


def make(**overrides: Any) -> tuple[HTTPProtocol, Dispatcher, FakeClock]:
    values: dict[str, Any] = dict(keep_alive_s=5.0, header_timeout_s=2.0, body_timeout_s=3.0,
                                  max_header_bytes=2048, max_body_bytes=1000)
    values.update(overrides)
    config = ServerConfig(**values)
    router = Router()
    router.add("GET", "/a", echo)
    router.add("POST", "/a", echo)
    router.add("GET", "/b", other)
    dispatcher = Dispatcher(router, APIKeyAuth(config.api_key), CORSPolicy(config.allowed_origins))
    clock = FakeClock()
    return HTTPProtocol(config, dispatcher, clock, ("127.0.0.1", 5555)), dispatcher, clock


def parse(data: bytes, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """One response, read by an independent parser: (status, headers, body)."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=method, target="/", headers=[("Host", "t")]))
    parser.send(h11.EndOfMessage())
    parser.receive_data(data)
    status, headers, body = 0, {}, b""
    while True:
        event = parser.next_event()
        if isinstance(event, h11.Response):
            status, headers = event.status_code, {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, body
        else:
            raise AssertionError(f"incomplete response: {event!r} after {data!r}")


def feed(protocol: HTTPProtocol, data: bytes) -> Any:
    """What the shell does on NEED_DATA: hand over the bytes, then ask again."""
    assert protocol.next_action() is NEED_DATA
    protocol.receive_data(data)
    return protocol.next_action()


def test_request_is_parsed_and_dispatched_then_answered_in_one_buffer():
    protocol, dispatcher, _ = make()
    action = feed(protocol, build_request("GET", "/a?x=1", headers=[("User-Agent", "ua/1")]))
    assert isinstance(action, Dispatch) and action.handler is echo
    assert (action.request.method, action.request.path, action.request.query_string) == ("GET", "/a", "x=1")
    assert action.request.headers["user-agent"] == "ua/1" and action.request.client == ("127.0.0.1", 5555)
    assert protocol.phase is Phase.HANDLER and dispatcher.num_in_flight == 1
    status, headers, body = parse(protocol.respond(JSONResponse({"ok": True})))
    assert status == 200 and body == b'{"ok":true}' and "connection" not in headers
    assert protocol.next_action() is NEED_DATA
    assert protocol.phase is Phase.IDLE and dispatcher.num_in_flight == 0


def test_pipelined_requests_are_dispatched_in_order_without_reading_again():
    protocol, _, _ = make()
    first = feed(protocol, build_request("GET", "/a") + build_request("POST", "/a", b"hello")
                 + build_request("GET", "/b"))
    assert first.request.path == "/a" and first.request.method == "GET"
    protocol.respond(JSONResponse({}))
    second = protocol.next_action()
    assert isinstance(second, Dispatch) and second.request.body == b"hello"
    protocol.respond(JSONResponse({}))
    third = protocol.next_action()
    assert isinstance(third, Dispatch) and third.handler is other
    protocol.respond(JSONResponse({}))
    assert protocol.next_action() is NEED_DATA and protocol.num_requests == 3


def test_bytes_that_arrive_while_a_handler_runs_are_the_next_request():
    protocol, _, _ = make()
    assert feed(protocol, build_request("GET", "/a")).request.path == "/a"
    protocol.receive_data(build_request("GET", "/b")[:20])  # read ahead, in pieces
    protocol.receive_data(build_request("GET", "/b")[20:])
    protocol.respond(JSONResponse({}))
    assert protocol.next_action().request.path == "/b"


def test_request_split_across_reads_is_reassembled():
    protocol, _, _ = make()
    data = build_request("POST", "/a", b"x" * 300)
    assert feed(protocol, data[:10]) is NEED_DATA
    protocol.receive_data(data[10:200])
    assert protocol.next_action() is NEED_DATA
    protocol.receive_data(data[200:])
    assert protocol.next_action().request.body == b"x" * 300


def test_keep_alive_waits_for_the_next_request_with_the_keep_alive_deadline():
    protocol, _, clock = make()
    assert protocol.next_action() is NEED_DATA and protocol.deadline == clock.now + 2.0  # first: header timeout
    protocol.receive_data(build_request("GET", "/a"))
    protocol.next_action()
    protocol.respond(JSONResponse({}))
    clock.now += 1
    assert protocol.next_action() is NEED_DATA and protocol.deadline == clock.now + 5.0  # later: keep-alive
    assert protocol.tick(clock.now + 4.9) is None
    close = protocol.tick(clock.now + 5.0)
    assert isinstance(close, Close) and close.data == b"" and not close.linger  # idle: a silent close
    assert protocol.phase is Phase.CLOSED and protocol.next_action() is close


@pytest.mark.parametrize("request_bytes", [
    build_request("GET", "/a", headers=[("Connection", "close")]),
    b"GET /a HTTP/1.0\r\n\r\n",
])
def test_connection_close_and_http10_get_an_answer_then_a_close(request_bytes):
    protocol, dispatcher, _ = make()
    action = feed(protocol, request_bytes + build_request("GET", "/b"))  # bytes after it are ignored
    status, headers, _ = parse(protocol.respond(JSONResponse({})))
    assert status == 200 and headers["connection"] == "close"
    close = protocol.next_action()
    assert isinstance(close, Close) and close.data == b"" and not close.linger
    assert action.handler is echo and dispatcher.num_in_flight == 0


def test_expect_continue_gets_100_before_the_body_is_read():
    protocol, _, _ = make()
    head = b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
    action = feed(protocol, head)
    assert isinstance(action, Write) and action.data == CONTINUE
    assert feed(protocol, b"hello").request.body == b"hello"


@pytest.mark.parametrize("head, status", [
    (b"POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n", 404),
    (b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n", 413),
])
def test_expect_continue_for_a_refused_body_gets_no_100_and_a_close(head, status):
    protocol, _, _ = make()
    close = feed(protocol, head)
    assert isinstance(close, Close) and close.linger
    assert parse(close.data)[0] == status and CONTINUE not in close.data


def test_headers_dribbled_past_the_header_timeout_get_408_and_a_lingering_close():
    protocol, dispatcher, clock = make()
    assert feed(protocol, b"GET /a HT") is NEED_DATA
    started = clock.now
    assert protocol.deadline == started + 2.0
    clock.now += 1.5
    protocol.receive_data(b"TP/1.1\r\nHost")  # more bytes do not move the deadline
    assert protocol.next_action() is NEED_DATA and protocol.deadline == started + 2.0
    assert protocol.tick(started + 1.99) is None
    close = protocol.tick(started + 2.0)
    status, headers, body = parse(close.data)
    assert status == 408 and headers["connection"] == "close" and b"headers" in body
    assert close.linger and protocol.phase is Phase.CLOSED and dispatcher.num_in_flight == 0


def test_body_that_stalls_past_the_body_timeout_gets_408():
    protocol, dispatcher, clock = make()
    assert feed(protocol, build_request("POST", "/a", headers=[("Content-Length", "100")]) + b"part") is NEED_DATA
    assert protocol.deadline == clock.now + 3.0 and dispatcher.num_in_flight == 1
    close = protocol.tick(clock.now + 3.0)
    status, _, body = parse(close.data)
    assert status == 408 and b"body" in body and close.linger and dispatcher.num_in_flight == 0


def test_body_timeout_after_100_continue_closes_without_a_408():
    protocol, _, clock = make()
    feed(protocol, b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert protocol.next_action() is NEED_DATA
    close = protocol.tick(clock.now + 3.0)
    assert close.data == b"" and not close.linger


def test_oversized_head_gets_431_whole_or_dribbled():
    protocol, _, _ = make()
    close = feed(protocol, b"GET /a HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n")
    assert isinstance(close, Close) and parse(close.data)[0] == 431 and close.linger

    protocol, _, _ = make()
    assert feed(protocol, b"GET /a HTTP/1.1\r\nHost: t\r\nX-Big: ") is NEED_DATA
    for _ in range(3):
        protocol.receive_data(b"a" * 1000)
        action = protocol.next_action()
    assert isinstance(action, Close) and parse(action.data)[0] == 431


def test_oversized_body_gets_413_before_it_is_read():
    protocol, dispatcher, _ = make()
    close = feed(protocol, build_request("POST", "/a", headers=[("Content-Length", "5000")]) + b"x" * 100)
    status, headers, body = parse(close.data)
    assert status == 413 and headers["connection"] == "close" and b"5000" in body
    assert close.linger and dispatcher.num_in_flight == 0


def test_chunked_body_over_the_limit_gets_413_while_counting():
    protocol, _, _ = make()
    head = b"POST /a HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert feed(protocol, head + b"200\r\n" + b"y" * 512 + b"\r\n") is NEED_DATA
    protocol.receive_data(b"200\r\n" + b"y" * 512 + b"\r\n")
    close = protocol.next_action()
    assert isinstance(close, Close) and parse(close.data)[0] == 413


@pytest.mark.parametrize("garbage, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /a HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
    (b"GET /a HTTP/2.0\r\nHost: t\r\n\r\n", 505),
    (b"POST /a HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n", 400),
])
def test_malformed_request_gets_an_error_and_a_close(garbage, status):
    protocol, dispatcher, _ = make()
    close = feed(protocol, garbage)
    got, headers, body = parse(close.data)
    assert isinstance(close, Close) and got == status and headers["connection"] == "close" and b'"error"' in body
    assert dispatcher.num_in_flight == 0


def test_eof_between_or_halfway_through_a_head_closes_without_a_word():
    protocol, _, _ = make()
    close = feed(protocol, b"")
    assert isinstance(close, Close) and close.data == b"" and not close.linger

    protocol, _, _ = make()
    assert feed(protocol, b"GET /a HTTP/1.1\r\nHo") is NEED_DATA
    protocol.receive_data(b"")
    close = protocol.next_action()
    assert isinstance(close, Close) and close.data == b""


def test_eof_halfway_through_a_body_gets_400_without_lingering():
    protocol, dispatcher, _ = make()
    assert feed(protocol, build_request("POST", "/a", headers=[("Content-Length", "10")]) + b"abc") is NEED_DATA
    protocol.receive_data(b"")
    close = protocol.next_action()
    assert parse(close.data)[0] == 400 and not close.linger and dispatcher.num_in_flight == 0


def test_requests_before_a_half_close_are_all_answered_then_the_connection_closes():
    protocol, _, _ = make()
    protocol.next_action()
    protocol.receive_data(build_request("GET", "/nope") + build_request("GET", "/a"))
    protocol.receive_data(b"")  # the client half-closed after sending both: it still reads the answers
    write = protocol.next_action()
    assert isinstance(write, Write) and parse(write.data)[0] == 404
    dispatch = protocol.next_action()
    assert isinstance(dispatch, Dispatch) and dispatch.request.path == "/a"
    assert protocol.peer_eof() is AfterEOF.PROBE  # the shell probes for a full close while /a runs
    assert parse(protocol.respond(JSONResponse({})))[0] == 200
    close = protocol.next_action()
    assert isinstance(close, Close) and close.data == b"" and not close.linger


def test_eof_before_a_request_is_complete_still_ends_the_connection():
    protocol, dispatcher, _ = make()
    assert feed(protocol, b"POST /a HTTP/1.1\r\nHost: t\r\n") is NEED_DATA
    assert protocol.peer_eof() is AfterEOF.READ  # the reads take it
    protocol.receive_data(b"")
    close = protocol.next_action()
    assert isinstance(close, Close) and close.data == b"" and dispatcher.num_in_flight == 0


def test_eof_seen_by_the_transport_before_the_request_is_read_still_dispatches_it():
    protocol, _, _ = make()
    protocol.next_action()
    assert protocol.peer_eof() is AfterEOF.READ  # the transport got request and FIN before we parsed a byte
    protocol.receive_data(build_request("POST", "/a", b'{"x": 1}'))
    dispatch = protocol.next_action()
    assert isinstance(dispatch, Dispatch) and dispatch.request.body == b'{"x": 1}'
    assert protocol.has_peer_eof and protocol.peer_eof() is AfterEOF.PROBE


def test_eof_while_an_http10_handler_runs_is_a_disconnect():
    protocol, _, _ = make()
    assert isinstance(feed(protocol, b"GET /a HTTP/1.0\r\n\r\n"), Dispatch)
    assert protocol.peer_eof() is AfterEOF.GONE  # no 1xx may probe a 1.0 client
    assert protocol.is_peer_gone


def test_eof_during_a_stream_is_probed_and_after_the_response_is_left_to_the_reads():
    protocol, _, _ = make()
    feed(protocol, build_request("GET", "/a"))
    protocol.start_stream(SSEResponse(_events()))
    assert protocol.peer_eof() is AfterEOF.PROBE
    protocol.end_stream(True)
    assert protocol.peer_eof() is AfterEOF.READ and not protocol.is_peer_gone


def test_peer_leaving_cancels_a_running_handler_only():
    protocol, dispatcher, _ = make()
    assert protocol.next_action() is NEED_DATA
    assert protocol.peer_gone() is False  # idle: the EOF will come through the reads

    protocol, dispatcher, _ = make()
    feed(protocol, build_request("GET", "/a"))
    assert protocol.peer_gone() is True  # the handler runs: the shell must cancel it
    protocol.connection_closed()
    assert dispatcher.num_in_flight == 0 and protocol.phase is Phase.CLOSED


def test_request_parsed_after_the_peer_left_is_not_dispatched():
    protocol, _, _ = make()
    protocol.next_action()
    protocol.peer_gone()  # the transport saw EOF; the request's bytes are still being read
    protocol.receive_data(build_request("GET", "/a"))
    close = protocol.next_action()
    assert isinstance(close, Close) and close.data == b"" and not close.linger


def test_small_body_to_an_unknown_path_is_dropped_and_the_connection_kept():
    protocol, dispatcher, _ = make()
    action = feed(protocol, build_request("POST", "/nope", b'{"a": 1}') + build_request("GET", "/a"))
    assert isinstance(action, Write)
    status, headers, _ = parse(action.data)
    assert status == 404 and "connection" not in headers and dispatcher.num_in_flight == 0
    assert protocol.next_action().request.path == "/a"  # the request behind it is next


def test_head_request_answered_early_gets_the_length_but_no_body():
    protocol, _, _ = make()
    action = feed(protocol, build_request("HEAD", "/nope"))
    status, headers, body = parse(action.data, method="HEAD")
    assert status == 404 and body == b"" and int(headers["content-length"]) > 0


def test_draining_refuses_new_requests_and_closes_after_in_flight_ones():
    protocol, dispatcher, _ = make()
    feed(protocol, build_request("GET", "/a"))
    dispatcher.is_draining = True
    status, headers, _ = parse(protocol.respond(JSONResponse({})))
    assert status == 200 and headers["connection"] == "close"
    assert isinstance(protocol.next_action(), Close)

    protocol, dispatcher, _ = make()
    dispatcher.is_draining = True
    close = feed(protocol, build_request("GET", "/a"))
    assert parse(close.data)[0] == 503 and not close.linger


async def _events():
    yield {"i": 0}


def test_stream_head_is_chunked_and_a_failed_stream_closes():
    protocol, dispatcher, _ = make()
    feed(protocol, build_request("GET", "/a"))
    head, is_chunked = protocol.start_stream(SSEResponse(_events()))
    assert is_chunked and b"transfer-encoding: chunked\r\n" in head and b"connection: close" not in head
    assert dispatcher.num_in_flight == 1
    with pytest.raises(RuntimeError):
        protocol.next_action()  # the shell still owes end_stream()
    protocol.end_stream(is_clean=False)
    close = protocol.next_action()
    assert isinstance(close, Close) and dispatcher.num_in_flight == 0


def test_clean_stream_keeps_the_connection():
    protocol, _, _ = make()
    feed(protocol, build_request("GET", "/a"))
    protocol.start_stream(SSEResponse(_events()))
    protocol.end_stream(is_clean=True)
    assert protocol.next_action() is NEED_DATA and protocol.deadline != NEVER


@pytest.mark.parametrize("target, path, query", [
    (b"http://127.0.0.1:8000/a?x=1", "/a", "x=1"),
    (b"HTTPS://example.com/a", "/a", ""),
    (b"http://example.com:80/b", "/b", ""),
])
def test_absolute_form_target_is_routed_by_its_path_and_query(target, path, query):
    protocol, _, _ = make()
    action = feed(protocol, b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n")
    assert isinstance(action, Dispatch) and action.handler is (echo if path == "/a" else other)
    assert (action.request.path, action.request.query_string) == (path, query)


@pytest.mark.parametrize("target", [b"http://example.com", b"http://example.com?x=1"])
def test_absolute_form_target_without_a_path_is_for_the_root(target):
    protocol, _, _ = make()
    status, _, body = parse(feed(protocol, b"GET " + target + b" HTTP/1.1\r\nHost: t\r\n\r\n").data)
    assert status == 404 and b"(GET /)" in body


def test_chunk_size_over_the_body_limit_gets_413_at_its_size_line():
    protocol, dispatcher, _ = make()  # max_body_bytes=1000
    head = b"POST /a HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    close = feed(protocol, head + b"FFFFFFFFFFFF\r\n")
    assert isinstance(close, Close), close  # not NEED_DATA until the body deadline
    assert parse(close.data)[0] == 413 and dispatcher.num_in_flight == 0

    protocol, _, _ = make()  # the sum counts: a second chunk that would pass the limit, with a few bytes sent
    close = feed(protocol, head + b"258\r\n" + b"x" * 600 + b"\r\n258\r\nxyz")
    assert isinstance(close, Close) and parse(close.data)[0] == 413

    protocol, _, _ = make()  # at the limit exactly, the chunk is awaited as before
    assert feed(protocol, head + b"3E8\r\nxy") is NEED_DATA


@pytest.mark.parametrize("fold", [b" folded", b"\tfolded"])
def test_obs_fold_header_line_gets_400(fold):
    protocol, dispatcher, _ = make()
    close = feed(protocol, b"GET /a HTTP/1.1\r\nHost: t\r\nX-A: one\r\n" + fold + b"\r\n\r\n")
    status, _, body = parse(close.data)
    assert isinstance(close, Close) and status == 400 and b"folding" in body and dispatcher.num_in_flight == 0

    protocol, _, _ = make()  # the same head in pieces, the fold in the second
    assert feed(protocol, b"GET /a HTTP/1.1\r\nHost: t\r\nX-A: one\r\n") is NEED_DATA
    protocol.receive_data(fold + b"\r\n\r\n")
    assert parse(protocol.next_action().data)[0] == 400


def test_spaces_and_tabs_in_a_body_are_not_taken_for_obs_fold():
    protocol, _, _ = make()
    body = b'{\n  "a":\n\t1}'
    action = feed(protocol, build_request("POST", "/a", body, headers=[("X-A", "one  two")]))
    assert isinstance(action, Dispatch) and action.request.body == body
    assert action.request.headers["x-a"] == "one  two"
