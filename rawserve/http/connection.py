"""One task per socket: h11 parses, this enforces limits, timeouts and keep-alive, runs the handler,
writes the response, and cancels the handler when the client leaves while it runs.

Knows nothing of what a route means. h11 is used sans-IO and only to parse: a fresh h11.Connection
per request (the bytes it did not consume carry over), and response bytes are written by hand.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import TYPE_CHECKING

import h11

from rawserve.errors import APIError
from rawserve.http import sse
from rawserve.http.messages import Request, RequestHead, Response, encode_response, error_response
from rawserve.http.routing import Handler

if TYPE_CHECKING:
    from rawserve.http.server import HTTPServer

logger = logging.getLogger("rawserve.http")

_READ_BYTES = 65536
_NEVER = float("inf")
# After a refusal with a body left unread, keep reading (and dropping) a little before closing, so
# the kernel does not answer the client's in-flight bytes with a reset that eats our response.
LINGER_S = 0.5
LINGER_BYTES = 256 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# Why this connection's task was cancelled by us; None means someone else cancelled it.
IDLE = "idle timeout"
HEAD_TIMEOUT = "header timeout"
BODY_TIMEOUT = "body timeout"
WRITE_TIMEOUT = "write timeout"
CLIENT_GONE = "client gone"
SHUTDOWN = "server shutdown"


class _Refusal(Exception):
    """An error answered before the handler runs, with the body (if any) unread; then a close."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Connection:
    """Serves one socket until it closes; the server owns the set of these and their tasks."""

    def __init__(self, server: HTTPServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._server = server
        self._config = server.config
        self._reader = reader
        self._writer = writer
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        self._client = writer.get_extra_info("peername")
        self._task: asyncio.Task | None = None
        self._buffer = bytearray()  # bytes read past the current request (pipelined), not yet parsed
        # Deadlines are checked by the server's tick (HTTPServer._tick) instead of a TimerHandle
        # per request: arming one is then a float store, which matters at 10k+ requests/s.
        self.deadline = _NEVER
        self.deadline_reason = IDLE
        self._stop_reason: str | None = None
        self._eof = False  # the peer sent EOF or vanished
        self._in_handler = False  # from the handler's start to the end of its response
        self._stream_keeps_alive = False  # the connection outlives the stream being written
        self._must_linger = False
        self._response_started = False
        self._is_chunked = True
        self._cors_lines = b""  # CORS lines owed to the current request's responses
        self._is_head = False  # the current request is a HEAD: headers only, whatever the status
        self.num_requests = 0
        self.is_busy = False  # between a request head and the end of its response

    # --- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        self._task = asyncio.current_task()
        try:
            try:
                while True:
                    outcome = await self._serve_one()
                    if outcome is True:
                        continue
                    if outcome is False:
                        break
                    # A stream is written from here, at the top of this task's await chain: every
                    # token resumes the whole chain, and each level of it costs ~40 ns a token.
                    is_clean = await sse.stream(outcome, self._transport, self._drain, self._is_chunked,
                                                self._config.sse_ping_interval_s)
                    self._in_handler = False
                    self._set_busy(False)
                    if not (self._stream_keeps_alive and is_clean and not self._server.is_draining):
                        break
            except (ConnectionError, OSError):
                self._eof = True  # the peer vanished mid-write; nobody is left to tell
            except asyncio.CancelledError:
                if self._stop_reason is None:
                    raise
                uncancel = getattr(self._task, "uncancel", None)  # 3.11+: keep timeouts inside sane
                if uncancel is not None:
                    uncancel()
                if self._stop_reason in (HEAD_TIMEOUT, BODY_TIMEOUT) and not self._response_started:
                    self._must_linger = True  # the client is still dribbling; let it read the 408
                    what = "headers" if self._stop_reason == HEAD_TIMEOUT else "body"
                    limit = self._config.header_timeout_s if what == "headers" else self._config.body_timeout_s
                    self._send(error_response(APIError(
                        408, f"The request {what} did not arrive within {limit} s.", code="request_timeout")),
                        keep_alive=False)
            except Exception:  # a bug of ours, not the client's: the log shows it, the client a close
                logger.exception("connection from %s failed", self._client)
                self._must_linger = False
            if self._must_linger and not self._eof:
                await self._linger()
        finally:
            self._set_busy(False)
            self.deadline = _NEVER
            self._in_handler = False
            self._close_transport()
            self._server._forget(self)

    def stop(self, reason: str = SHUTDOWN) -> None:
        """Cancel this connection's task (and so its handler); the first reason given is kept."""
        if self._stop_reason is None:
            self._stop_reason = reason
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _close_transport(self) -> None:
        transport = self._transport
        if transport.is_closing():
            return
        if self._stop_reason == WRITE_TIMEOUT:
            logger.info("dropping %s: it read nothing for %s s", self._client, self._config.write_timeout_s)
            # A reset, as nginx's reset_timedout_connection: a plain close would leave the kernel
            # trickling megabytes of unread response to a client that is not reading.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            transport.abort()
            return
        transport.close()
        if transport.get_write_buffer_size():
            # close() waits for the buffer to flush; a client that never reads must not pin us.
            self._loop.call_later(self._config.write_timeout_s, transport.abort)

    async def _linger(self) -> None:
        async def discard() -> None:
            total = 0
            while total < LINGER_BYTES:
                data = await self._reader.read(_READ_BYTES)
                if not data:
                    return
                total += len(data)
        try:
            if self._transport.can_write_eof():
                self._transport.write_eof()  # our answer is complete: the client sees EOF after it
            await asyncio.wait_for(discard(), LINGER_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    def _set_busy(self, is_busy: bool) -> None:
        if self.is_busy != is_busy:
            self.is_busy = is_busy
            self._server._on_busy(is_busy)

    # --- timers and the peer leaving ------------------------------------------------------

    def tick(self, now: float) -> None:
        """Called by the server every TICK_S: fire a due deadline."""
        if now >= self.deadline:
            self.deadline = _NEVER
            self.stop(self.deadline_reason)

    def peer_gone(self) -> None:
        """The transport saw EOF or a reset (the server's StreamProtocol calls this). While a
        handler runs that cancels it, which is what aborts its engine request; between requests
        the next read sees the EOF by itself. Bytes the client pipelined before leaving stay in
        the reader: EOF is not mistaken for them, nor they for EOF."""
        self._eof = True
        if self._in_handler:
            self.stop(CLIENT_GONE)

    def _arm(self, deadline: float, reason: str) -> None:
        self.deadline = deadline
        self.deadline_reason = reason

    def _disarm(self) -> None:
        self.deadline = _NEVER

    # --- reading ---------------------------------------------------------------------------

    async def _read(self) -> bytes:
        try:
            data = await self._reader.read(_READ_BYTES)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self._eof = True
        return data

    async def _read_head(self, parser: h11.Connection) -> h11.Request | None:
        """The next request head, or None when the client closed (or idled out) between requests."""
        has_bytes = bool(self._buffer)
        if has_bytes:
            parser.receive_data(bytes(self._buffer))
            self._buffer.clear()
        started = self._loop.time()
        event = h11.NEED_DATA  # a fresh parser with no bytes can only say that; skip asking it
        while True:
            try:
                if has_bytes:
                    event = parser.next_event()
            except h11.RemoteProtocolError as error:
                raise _Refusal(APIError(error.error_status_hint, f"Malformed request: {error}.",
                                        code="bad_request")) from None
            if type(event) is h11.Request:
                self._disarm()
                return event
            if event is not h11.NEED_DATA:  # ConnectionClosed: EOF between requests
                self._disarm()
                return None
            if not has_bytes:
                # Idle between requests: the first request gets the header timeout, later ones
                # keep-alive's; running out of either is a silent close, as nobody asked anything.
                idle_s = self._config.keep_alive_s if self.num_requests else self._config.header_timeout_s
                self._arm(started + idle_s, IDLE)
                data = await self._read()
                self._disarm()
                if not data:
                    return None
                has_bytes = True
                started = self._loop.time()
            else:
                if self.deadline == _NEVER:
                    self._arm(started + self._config.header_timeout_s, HEAD_TIMEOUT)
                data = await self._read()
                if not data:
                    self._disarm()
                    return None  # closed halfway through a head: nobody to answer
            parser.receive_data(data)

    async def _read_body(self, parser: h11.Connection) -> bytes:
        limit = self._config.max_body_bytes
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as error:
                raise _Refusal(APIError(error.error_status_hint, f"Malformed request body: {error}.",
                                        code="bad_request")) from None
            kind = type(event)
            if kind is h11.Data:
                size += len(event.data)
                if size > limit:  # chunked: counted as it arrives, refused at the first byte over
                    raise _Refusal(_too_large(size, limit, at_least=True))
                parts.append(event.data)
            elif kind is h11.EndOfMessage:
                break
            elif event is h11.NEED_DATA:
                if self.deadline == _NEVER:
                    self._arm(self._loop.time() + self._config.body_timeout_s, BODY_TIMEOUT)
                data = await self._read()
                parser.receive_data(data)  # b"" tells h11 about EOF; it then raises a protocol error
            else:
                raise _Refusal(APIError(400, "The request body ended unexpectedly.", code="bad_request"))
        self._disarm()
        return b"".join(parts)

    # --- one request -----------------------------------------------------------------------

    async def _serve_one(self) -> bool | sse.SSEResponse:
        """Answer one request: True when the connection stays open for another, False when it
        closes, or a stream whose head is sent, for run() to write (the request stays busy)."""
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=self._config.max_header_bytes)
        self._response_started = self._is_head = False
        self._cors_lines = b""
        outcome: bool | sse.SSEResponse = False
        try:
            head = await self._read_head(parser)
            if head is None:
                return False
            self._set_busy(True)
            self.num_requests += 1
            outcome = await self._handle(parser, head)
            return outcome
        except _Refusal as refusal:
            self._must_linger = True
            if not self._response_started:
                self._send(error_response(refusal.error), keep_alive=False)
            return False
        finally:
            if outcome.__class__ is bool:
                self._set_busy(False)

    async def _handle(self, parser: h11.Connection, event: h11.Request) -> bool | sse.SSEResponse:
        config = self._config
        server = self._server
        try:
            head = RequestHead(event, config.max_header_bytes)
        except APIError as error:
            raise _Refusal(error) from None
        self._is_chunked = head.http_version == "1.1"
        self._is_head = head.method == "HEAD"
        keep_alive = self._is_chunked and not head.wants_close
        has_body = head.is_chunked or bool(head.content_length)
        request = Request(head.method, head.path, head.query, head.headers, b"", head.http_version, self._client)
        cors = server.cors
        if head.origin is not None and cors.is_enabled:
            self._cors_lines = cors.response_headers(head.origin)

        # Every refusal we can decide from the head goes out before the body is read or a
        # 100 Continue is sent: a body that will be refused is never invited.
        try:
            if server.is_draining:
                raise APIError(503, "The server is shutting down.", code="server_shutting_down")
            requested_method = head.headers.get("access-control-request-method") if cors.is_enabled else None
            if cors.is_preflight(head.method, head.origin, requested_method):
                self._cors_lines = b""  # the preflight answer carries its own
                preflight = cors.preflight(server.router, head.path, head.origin, requested_method,
                                           head.headers.get("access-control-request-headers"))
                return await self._answer_early(parser, preflight, head, keep_alive)
            request.api_key = server.auth.check(head.path, head.headers)
            handler, request.path_params = server.router.resolve(head.method, head.path)
        except APIError as error:
            return await self._answer_early(parser, error_response(error), head, keep_alive)
        if head.content_length is not None and head.content_length > config.max_body_bytes:
            raise _Refusal(_too_large(head.content_length, config.max_body_bytes))

        if has_body:
            if head.expects_continue:
                self._write(_CONTINUE)
            request.body = await self._read_body(parser)
        # Without a body h11's EndOfMessage is certain; skip asking for it (a tenth of the parse).
        self._buffer += parser.trailing_data[0]
        if self._buffer and not keep_alive:
            self._buffer.clear()  # bytes after a request that closes the connection are ignored

        response = await self._call(handler, request)
        keep_alive = keep_alive and not server.is_draining
        if isinstance(response, Response):
            self._send(response, keep_alive)
            if self._transport.get_write_buffer_size() > self._transport.get_write_buffer_limits()[1]:
                await self._drain()  # the one case where it can wait (see sse.stream)
            self._in_handler = False
            return keep_alive
        self._stream_keeps_alive = keep_alive and self._is_chunked  # HTTP/1.0: the close ends the body
        self._write(sse.encode_head(response, self._is_chunked, self._stream_keeps_alive, self._cors_lines))
        return response

    async def _answer_early(self, parser: h11.Connection, response: Response, head: RequestHead,
                            keep_alive: bool) -> bool:
        """Answer without running a handler. The connection stays open only when the body is
        small and already on its way (it is read and dropped); a client waiting for 100 Continue,
        or a large or chunked body, gets a close instead."""
        has_body = head.is_chunked or bool(head.content_length)
        close = not keep_alive or self._server.is_draining or (has_body and (
            head.expects_continue or head.is_chunked or head.content_length > self._config.max_body_bytes))
        if not close:
            if has_body:
                await self._read_body(parser)
            self._buffer += parser.trailing_data[0]
        self._must_linger = close and has_body
        self._send(response, keep_alive=not close)
        return not close

    async def _call(self, handler: Handler, request: Request) -> Response | sse.SSEResponse:
        """Run the handler; an APIError or a crash before the response starts becomes its answer."""
        self._in_handler = True
        if self._eof:  # the client left before its handler could start: it runs to no one
            self.stop(CLIENT_GONE)
        try:
            response = await handler(request)
        except APIError as error:
            response = error_response(error)
        except Exception:  # the client gets a 500; the operator gets the traceback
            logger.exception("handler for %s %s failed", request.method, request.path)
            response = _internal_error()
        if self._stop_reason is not None:
            raise asyncio.CancelledError  # the handler swallowed our cancellation; honour it
        if not isinstance(response, (Response, sse.SSEResponse)):
            logger.error("handler for %s %s returned %r, not a Response", request.method, request.path,
                         type(response).__name__)
            response = _internal_error()
        return response

    # --- writing ---------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        self._response_started = True
        self._transport.write(data)

    async def _drain(self) -> None:
        """Wait for the client to take what is buffered, for at most `write_timeout_s`: a client that
        stops reading must not hold its request (and the engine's blocks) for ever."""
        self._arm(self._loop.time() + self._config.write_timeout_s, WRITE_TIMEOUT)
        try:
            await self._writer.drain()
        finally:
            self._disarm()

    def _send(self, response: Response, keep_alive: bool) -> None:
        self._write(encode_response(response, keep_alive, self._cors_lines, head_only=self._is_head))


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(413, f"The request body is {'over ' if at_least else ''}{size} bytes; the limit is {limit}.",
                    code="request_too_large")


def _internal_error() -> Response:
    return error_response(APIError(500, "Internal server error.", code="internal_error"))
