"""Server-sent events: `data: <json>` framing, `[DONE]`, the error event and `: ping` comments.

Owns the streaming loop over a handler's async iterator. It does not own the socket: the
connection hands it a sink that frames chunks and waits for the socket to drain.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Protocol

import orjson

from rawserve.errors import APIError
from rawserve.http.messages import HeaderPairs, common_headers, encode_headers, status_line

logger = logging.getLogger("rawserve.http")

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
_HEAD_LINES = (b"content-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
               b"x-accel-buffering: no\r\n")  # tells nginx-style proxies not to buffer the stream
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"


class SSEResponse:
    """A 200 (by default) whose body is the events of `events`: dicts, or bytes of encoded JSON."""

    __slots__ = ("events", "status", "headers")

    def __init__(self, events: AsyncIterator[Any], status: int = 200, headers: HeaderPairs | None = None) -> None:
        if not hasattr(events, "__anext__"):
            raise ValueError("SSEResponse needs an async iterator of events")
        if not 200 <= status <= 599:
            raise ValueError(f"status must be in 200..599, got {status}")
        self.events = events
        self.status = status
        self.headers = encode_headers(headers)


class EventSink(Protocol):
    def write(self, payload: bytes) -> None:
        """Send `payload` as one piece of the body (one chunk), without waiting."""

    def write_event(self, data: bytes) -> None:
        """Send `data: <data>\n\n` as one piece; the same as write() with the framing added,
        but framed in one step on the hot path."""

    async def drain(self) -> None:
        """Wait until the socket's send buffer is below its high-water mark."""


class TransportSink:
    """The EventSink of a connection: chunked framing on HTTP/1.1, raw bytes on HTTP/1.0 (where
    the close ends the body). Writes go straight to the transport, one write per event."""

    __slots__ = ("drain", "_transport", "_is_chunked", "buffered_bytes")

    def __init__(self, writer: asyncio.StreamWriter, is_chunked: bool) -> None:
        self.drain = writer.drain  # the EventSink's drain(): the stream's own, one call less per event
        self._transport = writer.transport
        self._is_chunked = is_chunked
        # Bytes the kernel has not taken yet; 0 means a drain() could not wait, so the hot loop skips it.
        self.buffered_bytes = writer.transport.get_write_buffer_size

    def write(self, payload: bytes) -> None:
        if self._is_chunked:
            self._transport.write(b"%x\r\n%b\r\n" % (len(payload), payload))
        else:
            self._transport.write(payload)

    def write_event(self, data: bytes) -> None:
        if self._is_chunked:
            self._transport.write(b"%x\r\ndata: %b\n\n\r\n" % (len(data) + 8, data))
        else:
            self._transport.write(b"data: %b\n\n" % data)

    def end(self) -> None:
        """The terminal chunk: the body is complete and the connection may carry another request."""
        if self._is_chunked:
            self._transport.write(b"0\r\n\r\n")


def encode_head(response: SSEResponse, is_chunked: bool, keep_alive: bool, extra: bytes = b"") -> bytes:
    return b"".join((status_line(response.status), common_headers(), _HEAD_LINES, _CHUNKED if is_chunked else b"",
                     b"" if keep_alive else _CLOSE, response.headers, extra, b"\r\n"))


def _payload(item: Any) -> bytes:
    return item if type(item) is bytes else bytes(item) if isinstance(item, bytearray) else orjson.dumps(item)


def encode_error(error: BaseException) -> bytes:
    if not isinstance(error, APIError):
        error = APIError(500, "Internal server error while streaming the response.")
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\n"


class _Pinger:
    """Writes `: ping` when nothing has been written for `interval_s`, so proxies keep the stream.

    A timer that re-arms itself from the last write, rather than a timeout around each await:
    the events themselves then cost one float store each.
    """

    __slots__ = ("_loop", "_sink", "_interval_s", "last_write", "_handle")

    def __init__(self, sink: EventSink, interval_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._sink = sink
        self._interval_s = interval_s
        self.last_write = self._loop.time()
        self._handle = self._loop.call_at(self.last_write + interval_s, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        due = self.last_write + self._interval_s
        if now >= due - 0.001:
            self._sink.write(PING)
            self.last_write = now
            due = now + self._interval_s
        self._handle = self._loop.call_at(due, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()


async def stream(response: SSEResponse, sink: EventSink, ping_interval_s: float) -> bool:
    """Write every event (awaiting drain after each, so a slow client slows only itself), then
    `[DONE]`. True when the stream ended cleanly; False when a failure went out as an error event
    (the caller then closes the connection). Cancellation propagates: that is a client leaving."""
    events = response.events
    pinger = _Pinger(sink, ping_interval_s) if ping_interval_s > 0 else None
    clock = asyncio.get_running_loop().time
    write_event, drain, dumps = sink.write_event, sink.drain, orjson.dumps
    # A sink that can tell its buffer is empty lets the loop skip drain() then: it could not wait, and
    # a vanished client is seen by the connection's watcher, not here.
    buffered = getattr(sink, "buffered_bytes", None)
    ok = True
    try:
        try:
            async for item in events:
                write_event(dumps(item) if type(item) is dict else _payload(item))
                if pinger is not None:
                    pinger.last_write = clock()
                if buffered is None or buffered():
                    await drain()
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as error:  # the client sees it as an error event; operators in the log
            if not isinstance(error, APIError):
                logger.exception("SSE event iterator failed after the stream started")
            sink.write(encode_error(error))
            ok = False
        sink.write(DONE)
        await sink.drain()
        return ok
    finally:
        if pinger is not None:
            pinger.cancel()
        # Close the generator now, not at garbage collection: its `finally` is what aborts the
        # engine request when we stop early.
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # a broken generator must not mask the original outcome; log it
                logger.exception("closing the SSE event iterator failed")
