"""The asyncio shell around one connection's HTTPProtocol: owns the transport, the one task that
reads and runs handlers, the write timeout and lingering, and carries out the protocol's actions.
Decides nothing about HTTP (protocol.py does) nor about routes (the Dispatcher it is lent does).
"""
from __future__ import annotations

import asyncio
import logging
import select
import socket
import struct
from typing import Callable

from rawserve.config import ServerConfig
from rawserve.errors import APIError
from rawserve.http import sse
from rawserve.http.dispatch import Dispatcher
from rawserve.http.messages import Request, Response, error_response
from rawserve.http.protocol import (CONTINUE, GONE, HANDLER, NEED_DATA, NEVER, PROBE, Close, Dispatch, HTTPProtocol,
                                    Write)
from rawserve.http.routing import Handler

logger = logging.getLogger("rawserve.http")

_READ_BYTES = 65536
# After a refusal with a body left unread, keep reading (and dropping) a little before closing, so
# the kernel does not answer the client's in-flight bytes with a reset that eats our response.
LINGER_S = 0.5
LINGER_BYTES = 256 * 1024
# A client that half-closed is probed again this often while its answer is pending: one that closed for good
# after reading the last probe answers only the next write with a reset.
PROBE_INTERVAL_S = 1.0
_RESET_EVENTS = getattr(select, "POLLERR", 0) | getattr(select, "POLLHUP", 0)

# Why this connection's task was cancelled by us; None means someone else cancelled it.
TIMED_OUT = "request deadline"  # the protocol's: idle, header or body timeout
WRITE_TIMEOUT = "write timeout"
CLIENT_GONE = "client gone"
SHUTDOWN = "server shutdown"
EVICTED = "evicted"  # idle while the server was full: closed to make room for a new connection


class Connection:
    """Serves one socket until it closes; the server owns the set of these and their tasks."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, config: ServerConfig,
                 dispatcher: Dispatcher) -> None:
        self._config = config
        self._reader = reader
        self._writer = writer
        self._transport = writer.transport
        self._loop = asyncio.get_running_loop()
        self._client = writer.get_extra_info("peername")
        self._protocol = HTTPProtocol(config, dispatcher, self._loop.time, self._client)
        self._task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._expired: Close | None = None  # what the protocol said to do when its deadline passed
        # Deadlines are checked by the server's tick (HTTPServer._tick) instead of a TimerHandle
        # per request: arming one is then a float store, which matters at 10k+ requests/s.
        self._write_deadline = NEVER
        # After the client's EOF, while its answer is pending: the socket polled each tick for the reset a
        # closed socket answers a probe with (select.poll, or None), and when to probe again.
        self._reset_poll: select.poll | None = None
        self._next_probe_at = NEVER
        self._stream_ping: bytes | None = None  # while a stream's body is open: a ping comment, framed

    async def run(self) -> None:
        self._task = asyncio.current_task()
        protocol = self._protocol
        next_action, receive_data, read = protocol.next_action, protocol.receive_data, self._reader.read
        transport = self._transport
        write, buffered = transport.write, transport.get_write_buffer_size
        close: Close | None = None
        try:
            try:
                while True:
                    action = next_action()
                    if action is NEED_DATA:
                        try:
                            data = await read(_READ_BYTES)
                        except (ConnectionError, OSError):
                            data = b""
                        receive_data(data)
                        continue
                    kind = action.__class__
                    if kind is Dispatch:
                        if protocol.has_peer_eof:  # the EOF came before this request was parsed
                            self.peer_eof()
                        response = await self._call(action.handler, action.request)
                        if isinstance(response, Response):
                            write(protocol.respond(response))
                            if buffered() > transport.get_write_buffer_limits()[1]:
                                await self._drain()  # the one case where it can wait (see sse.stream)
                            continue
                        head, is_chunked = protocol.start_stream(response)
                        write(head)
                        self._stream_ping = sse.frame(sse.PING, is_chunked)
                        # A stream is written from here, at the top of this task's await chain:
                        # every token resumes the whole chain, and each level costs ~40 ns a token.
                        protocol.end_stream(await sse.stream(response, transport, self._drain, is_chunked,
                                                             self._config.sse_ping_interval_s, self._cut_short,
                                                             self._body_ending))
                    elif kind is Write:
                        write(action.data)
                    else:
                        close = action
                        break
            except (ConnectionError, OSError):
                protocol.peer_gone()  # it vanished mid-write; nobody is left to tell
            except asyncio.CancelledError:
                if self._stop_reason is None:
                    raise
                self._uncancel()
                close = self._expired  # set for a deadline only: a 408, or a quiet close
                if self._stop_reason == SHUTDOWN and protocol.phase is HANDLER and not protocol.is_peer_gone:
                    write(protocol.respond(error_response(_SHUTDOWN_ERROR)))  # the drain timed out before it
            except Exception:  # a bug of ours, not the client's: the log shows it, the client a close
                logger.exception("connection from %s failed", self._client)
            if close is not None:
                if close.data:
                    write(close.data)
                if close.linger and not protocol.is_peer_gone:
                    await self._linger()
        finally:
            self._write_deadline = NEVER
            self._reset_poll = None
            self._stream_ping = None
            protocol.connection_closed()
            self._close_transport()

    def stop(self, reason: str = SHUTDOWN) -> None:
        """Cancel this connection's task (and so its handler); the first reason given is kept."""
        if self._stop_reason is None:
            self._stop_reason = reason
        if self._task is not None and not self._task.done():
            self._task.cancel()

    @property
    def idle_since(self) -> float:
        """When this connection began waiting for a request head; NEVER while a request is in progress
        (or once it is being stopped)."""
        protocol = self._protocol
        return protocol.idle_since if self._stop_reason is None and protocol.is_idle else NEVER

    def evict(self) -> None:
        """Close this idle connection at once, to make room (the server is at its cap)."""
        if self._stop_reason is None:
            self._expired = self._protocol.evict()
            self.stop(EVICTED)

    def tick(self, now: float) -> None:
        """Called by the server every TICK_S: carry out a deadline that passed; watch a half-closed client."""
        if now >= self._protocol.deadline:
            if self._stop_reason is None:
                self._expired = self._protocol.tick(now)
                self.stop(TIMED_OUT)
        elif now >= self._write_deadline:
            self._write_deadline = NEVER
            self.stop(WRITE_TIMEOUT)
        elif self._reset_poll is not None:
            if self._is_reset():
                self.peer_gone()
            elif now >= self._next_probe_at:
                self.peer_eof()

    def peer_eof(self) -> None:
        """The transport saw EOF (StreamProtocol calls this). A client that half-closed after its request
        still gets the answer; whether it closed for good instead, only a write can tell: the probe (a
        100 Continue before the response, a ping comment in a stream) draws a reset from a closed socket,
        which tick() then sees."""
        after = self._protocol.peer_eof()
        if after is GONE:
            self.stop(CLIENT_GONE)
        elif after is not PROBE:  # nothing pending to probe for (a response already written, say)
            self._reset_poll = None
            self._next_probe_at = NEVER
        elif after is PROBE and self._stop_reason is None:
            probe = CONTINUE if self._protocol.phase is HANDLER else self._stream_ping
            if probe is not None and not self._transport.is_closing():
                self._transport.write(probe)  # a 1xx may precede any HTTP/1.1 response (RFC 9110 15.2)
            self._next_probe_at = self._loop.time() + PROBE_INTERVAL_S
            if self._reset_poll is None:
                sock = self._transport.get_extra_info("socket")
                if sock is not None and hasattr(select, "poll"):
                    self._reset_poll = select.poll()
                    self._reset_poll.register(sock.fileno(), select.POLLIN)  # POLLERR and POLLHUP come anyway

    def peer_gone(self) -> None:
        """The transport saw a reset or lost the connection (StreamProtocol calls this), or tick() saw the
        socket reset."""
        self._reset_poll = None
        if self._protocol.peer_gone():
            self.stop(CLIENT_GONE)

    def _is_reset(self) -> bool:
        if self._transport.is_closing():
            return False
        return any(events & _RESET_EVENTS for _, events in self._reset_poll.poll(0))

    def _body_ending(self) -> None:
        """The stream is about to write its end: a ping after it would be taken for the next response."""
        self._stream_ping = None

    def _cut_short(self) -> APIError | None:
        """Asked by a stream we cancel: the error its client is told, or None when it is the client who left."""
        if self._stop_reason == SHUTDOWN and not self._protocol.is_peer_gone:
            return _SHUTDOWN_ERROR
        return None

    async def _call(self, handler: Handler, request: Request) -> Response | sse.SSEResponse:
        """Run the handler; an APIError or a crash before the response starts becomes its answer."""
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

    async def _drain(self) -> None:
        """Wait for the client to take what is buffered, for at most `write_timeout_s`: a client that
        stops reading must not hold its request (and the engine's blocks) for ever."""
        self._write_deadline = self._loop.time() + self._config.write_timeout_s
        try:
            await self._writer.drain()
        finally:
            self._write_deadline = NEVER

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
        except asyncio.CancelledError:  # a shutdown cuts the linger short
            if self._stop_reason is None:
                raise
            self._uncancel()

    def _uncancel(self) -> None:
        uncancel = getattr(self._task, "uncancel", None)  # 3.11+: keeps timeouts inside sane
        if uncancel is not None:
            uncancel()

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


class StreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio.start_server's protocol, which also tells the connection the moment the peer sends
    EOF or vanishes. The transport reads whether or not anyone awaits the reader, so a client
    leaving mid-handler is seen at once, with no task reading on the side."""

    def __init__(self, reader: asyncio.StreamReader, accept: Callable, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, lambda r, w: accept(r, w, self), loop=loop)
        self.on_peer_eof: Callable[[], None] | None = None
        self.on_peer_gone: Callable[[], None] | None = None

    def eof_received(self) -> bool:
        keep_open = super().eof_received()  # True: our half stays open for the answer
        if self.on_peer_eof is not None:
            self.on_peer_eof()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.on_peer_eof = None
        if self.on_peer_gone is not None:
            self.on_peer_gone()
            self.on_peer_gone = None  # the connection is done with; do not keep it alive


# At the end of --drain-timeout-s, what a request still running is told (an SSE error event once its stream began).
_SHUTDOWN_ERROR = APIError(503, "The server shut down before this response finished.", code="server_shutdown")


def _internal_error() -> Response:
    return error_response(APIError(500, "Internal server error.", code="internal_error"))
