"""Server-sent events: `data: <json>` framing, `[DONE]`, the error event and `: ping` comments.

Owns the streaming loop over a handler's async iterator, writing straight to the connection's
transport: chunked framing on HTTP/1.1, raw bytes on HTTP/1.0 (where the close ends the body).
The connection owns the socket and how long a drain may wait; its protocol, the head and whether
the socket stays open afterwards.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson

from rawserve.errors import APIError
from rawserve.http.messages import HeaderPairs, common_headers, encode_headers, status_line

logger = logging.getLogger("rawserve.http")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
_HEAD_LINES = (b"content-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
               b"x-accel-buffering: no\r\n")  # tells nginx-style proxies not to buffer the stream
_CHUNKED = b"transfer-encoding: chunked\r\n"
# [DONE] and the terminal chunk leave in one write: the body is complete and the connection may
# carry another request.
_DONE_AND_END = b"%x\r\n%b\r\n0\r\n\r\n" % (len(DONE), DONE)
_CLOSE = b"connection: close\r\n"


class SSEResponse:
    """A 200 (by default) whose body is the events of `events`: dicts, or bytes of encoded JSON.

    `named`: each event is a dict whose "type" also goes out as its `event:` line, and the stream ends
    without `[DONE]` (the Responses API's framing). `ping`: the bytes written while the stream waits (a
    `: ping` comment; Anthropic's API has a `ping` event of its own).
    """

    __slots__ = ("events", "status", "headers", "named", "ping")

    def __init__(self, events: AsyncIterator[Any], status: int = 200, headers: HeaderPairs | None = None,
                 named: bool = False, ping: bytes = PING) -> None:
        if not hasattr(events, "__anext__"):
            raise ValueError("SSEResponse needs an async iterator of events")
        if not 200 <= status <= 599:
            raise ValueError(f"status must be in 200..599, got {status}")
        self.events = events
        self.status = status
        self.headers = encode_headers(headers)
        self.named = named
        self.ping = ping


def encode_head(response: SSEResponse, is_chunked: bool, keep_alive: bool, extra: bytes = b"") -> bytes:
    return b"".join((status_line(response.status), common_headers(), _HEAD_LINES, _CHUNKED if is_chunked else b"",
                     b"" if keep_alive else _CLOSE, response.headers, extra, b"\r\n"))


def frame(piece: bytes, is_chunked: bool) -> bytes:
    """One piece of the body as it goes on the wire: a chunk, or the bytes themselves."""
    return b"%x\r\n%b\r\n" % (len(piece), piece) if is_chunked else piece


def _payload(item: Any) -> bytes:
    return item if type(item) is bytes else bytes(item) if isinstance(item, bytearray) else orjson.dumps(item)


def encode_error(error: BaseException, named: bool = False) -> bytes:
    if not isinstance(error, APIError):
        error = APIError(500, "Internal server error while streaming the response.")
    if named:  # the Responses API's error event
        body = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\n"


def named_event(item: dict) -> bytes:
    return b"event: %b\ndata: %b\n\n" % (item["type"].encode(), orjson.dumps(item))


class _Pinger:
    """Writes `: ping` when nothing has been written for `interval_s`, so proxies keep the stream.

    A timer that re-arms itself from the last write, rather than a timeout around each await:
    the events themselves then cost one float store each.
    """

    __slots__ = ("_loop", "_send_ping", "_interval_s", "last_write", "_handle")

    def __init__(self, send_ping: Callable[[], None], interval_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._send_ping = send_ping
        self._interval_s = interval_s
        self.last_write = self._loop.time()
        self._handle = self._loop.call_at(self.last_write + interval_s, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        due = self.last_write + self._interval_s
        if now >= due - 0.001:
            self._send_ping()
            self.last_write = now
            due = now + self._interval_s
        self._handle = self._loop.call_at(due, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()


async def stream(response: SSEResponse, transport: asyncio.WriteTransport, drain: Callable[[], Awaitable[None]],
                 is_chunked: bool, ping_interval_s: float,
                 cancel_error: Callable[[], APIError | None] | None = None,
                 body_ending: Callable[[], None] | None = None) -> bool:
    """Write every event (and wait after it while the client is behind, so a slow client slows only
    itself), then `[DONE]` and the end of the body. True when the stream ended cleanly; False when
    a failure went out as an error event (the caller then closes the connection). Cancellation
    propagates: that is a client leaving.

    The loop is the hot path of every token a server sends: it frames and writes in one step, and
    awaits `drain()` (the connection's, which bounds the wait) only when the transport is over its
    high-water mark, the one case where drain() waits. Calling it whenever a few events were
    still unsent cost a coroutine per event exactly when a server is busiest: 12% of SSE throughput.

    `cancel_error()`, asked when the stream is cancelled, says whether the client is still there to be told
    why (the server shutting down): then its error event, `[DONE]` and the end of the body go out first.
    `body_ending()` is called just before the end of the body is written: the connection writes into a
    stream (a probe) only before it.
    """
    events, named = response.events, response.named
    write, buffered, dumps = transport.write, transport.get_write_buffer_size, orjson.dumps
    # drain() can only wait once the transport is over its high-water mark (it has paused us);
    # below it, the kernel is merely behind by a few events and the transport coalesces them.
    full = transport.get_write_buffer_limits()[1]
    ping = frame(response.ping, is_chunked)
    pinger = _Pinger(lambda: write(ping), ping_interval_s) if ping_interval_s > 0 else None
    clock = asyncio.get_running_loop().time
    ok, exhausted = True, False
    try:
        try:
            async for item in events:
                if named:
                    write(frame(named_event(item), is_chunked))
                elif is_chunked:
                    data = dumps(item) if type(item) is dict else _payload(item)
                    write(b"%x\r\ndata: %b\n\n\r\n" % (len(data) + 8, data))
                else:
                    write(b"data: %b\n\n" % (dumps(item) if type(item) is dict else _payload(item)))
                if pinger is not None:
                    pinger.last_write = clock()
                if buffered() > full:
                    await drain()
            exhausted = True
        except asyncio.CancelledError:
            error = cancel_error() if cancel_error is not None else None
            if error is not None:  # ended by us, not by the client: it gets a proper ending
                write(frame(encode_error(error, named), is_chunked))
                if body_ending is not None:
                    body_ending()
                if named:
                    if is_chunked:
                        write(b"0\r\n\r\n")
                else:
                    write(_DONE_AND_END if is_chunked else DONE)
            raise
        except ConnectionError:
            raise
        except Exception as error:  # the client sees it as an error event; operators in the log
            if not isinstance(error, APIError):
                logger.exception("SSE event iterator failed after the stream started")
            write(frame(encode_error(error, named), is_chunked))
            ok = False
        if body_ending is not None:
            body_ending()
        if named:
            if is_chunked:
                write(b"0\r\n\r\n")
        else:
            write(_DONE_AND_END if is_chunked else DONE)
        if buffered() > full:
            await drain()
        return ok
    finally:
        if pinger is not None:
            pinger.cancel()
        # Close the generator now, not at garbage collection: its `finally` is what aborts the
        # engine request when we stop early. One that ran to its end has nothing left to close.
        aclose = None if exhausted else getattr(events, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # a broken generator must not mask the original outcome; log it
                logger.exception("closing the SSE event iterator failed")
