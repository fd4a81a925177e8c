"""HTTP/1.1 for one connection as a sans-IO state machine: bytes and events in, actions out.

Owns limits, deadlines, keep-alive, pipelining, 100-continue and answers given without a handler;
owns no socket, task or timer, never awaits, and reads time only from the clock it is given.
h11 only parses, a fresh h11.Connection per request; response bytes are made by hand (messages.py).
"""
from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, Any, Callable, Union

import h11

from rawserve.config import ServerConfig
from rawserve.errors import APIError
from rawserve.http.messages import Headers, Request, RequestHead, Response, encode_response
from rawserve.http.sse import SSEResponse, encode_head

if TYPE_CHECKING:
    from rawserve.http.dispatch import Dispatcher
    from rawserve.http.routing import Handler

NEVER = float("inf")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Phase(enum.Enum):
    """Where the connection is in its current exchange; each phase names its deadline, if any."""

    IDLE = "idle"  # no byte of the next head yet; the deadline closes without a word
    HEAD = "head"  # part of a head has arrived; the deadline answers 408
    BODY = "body"  # reading the body of a request its handler will get; the deadline answers 408
    DISCARD = "discard"  # reading, to drop, the small body of a request answered without a handler; 408
    HANDLER = "handler"  # the shell runs the handler and owes respond() or start_stream()
    SENDING = "sending"  # the shell has the response bytes and may still be draining them
    STREAM = "stream"  # the shell writes an SSE body and owes end_stream()
    CLOSED = "closed"  # a Close was returned; next_action() returns it again


# Module globals: an identity test against one is cheaper than an Enum attribute lookup, and these
# run a few times per request.
IDLE, HEAD, BODY, DISCARD = Phase.IDLE, Phase.HEAD, Phase.BODY, Phase.DISCARD
HANDLER, SENDING, STREAM, CLOSED = Phase.HANDLER, Phase.SENDING, Phase.STREAM, Phase.CLOSED


class NeedData:
    """Read more bytes and pass them to receive_data() (b"" when the peer sent EOF)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()


class Write:
    """Write `data`, then ask for the next action: a 100 Continue, or an answer given without a
    handler on a connection that stays open."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Dispatch:
    """Run `handler(request)`; give its Response to respond() or its SSEResponse to start_stream()."""

    __slots__ = ("handler", "request")

    def __init__(self, handler: Handler, request: Request) -> None:
        self.handler = handler
        self.request = request


class Close:
    """Write `data` (maybe nothing), then close. With `linger`, first half-close and read (and drop)
    for a moment: the client's bytes still in flight must not make the kernel answer with a reset
    that eats the response."""

    __slots__ = ("data", "linger")

    def __init__(self, data: bytes, linger: bool) -> None:
        self.data = data
        self.linger = linger

    def __repr__(self) -> str:
        return f"Close({self.data[:40]!r}, linger={self.linger})"


Action = Union[NeedData, Write, Dispatch, Close]


class AfterEOF(enum.Enum):
    """What the shell does when its transport sees the client's EOF (`peer_eof()`).

    A FIN means only that the client has sent everything: a client that half-closed (shutdown(SHUT_WR))
    after a whole request still reads the answer. Nor can the FIN tell a half-close from a full close; a
    write can: a socket closed for good answers it with a reset.
    """

    READ = "read"  # nothing is being answered: the reads take the EOF, after any bytes sent before it
    PROBE = "probe"  # a complete request is being answered: go on, write a probe and watch for a reset
    GONE = "gone"  # an HTTP/1.0 handler runs, and no 1xx may probe a 1.0 client: cancel it as if it left


READ, PROBE, GONE = AfterEOF.READ, AfterEOF.PROBE, AfterEOF.GONE
# The first newline of a head that starts a folded line (obs-fold: SP or HTAB) or ends the head.
_FOLD_OR_END = re.compile(rb"\n(?:([ \t])|\r?\n)")


class _Exchange:
    """One request, from its head to the end of its response; its existence is what counts as busy."""

    __slots__ = ("head", "request", "cors_lines", "keep_alive", "is_head", "handler", "early", "is_continued",
                 "body_parts", "body_size")

    def __init__(self, head: RequestHead, request: Request, cors_lines: bytes) -> None:
        self.head = head
        self.request = request
        self.cors_lines = cors_lines  # owed to every response this request gets
        self.keep_alive = head.http_version == "1.1" and not head.wants_close  # narrowed as it goes
        self.is_head = head.method == "HEAD"  # headers only, whatever the status
        self.handler: Handler | None = None
        self.early: Response | None = None  # the answer to send once a dropped body is read
        self.is_continued = False  # a 100 Continue went out: the response has begun, no error can follow
        self.body_parts: list[bytes] = []
        self.body_size = 0


class HTTPProtocol:
    """One connection's HTTP/1.1, sans I/O.

    The shell loops on `next_action()`: NEED_DATA, read and `receive_data()` (b"" at EOF); Write,
    write; Dispatch, run the handler and pass its response to `respond()` (the bytes to write) or
    `start_stream()` (the head; `end_stream()` after the body); Close, do it and stop. Beside the
    loop: the shell's timer calls `tick(now)` once `deadline` passes and carries out the Close it
    returns; `peer_eof()` when the transport sees EOF (the shell does as the AfterEOF it gets says),
    `peer_gone()` when it sees a reset or loses the connection; `connection_closed()` at the end.
    """

    def __init__(self, config: ServerConfig, dispatcher: Dispatcher, clock: Callable[[], float],
                 client: Any = None) -> None:
        self._config = config
        self._dispatcher = dispatcher
        self._clock = clock
        self._client = client  # the peer address, handed to each Request
        self.phase = IDLE
        self.deadline = NEVER  # on the clock's scale; armed only while waiting for bytes
        self.num_requests = 0
        self.idle_since = clock()  # when the current wait for a request head began (see is_idle)
        self.is_peer_gone = False  # the transport saw a reset or lost the connection: nobody reads our answer
        self.has_peer_eof = False  # the transport saw EOF, maybe before we read every byte sent before it
        self._has_input_ended = False  # we consumed the EOF itself: no byte will follow
        self._parser: h11.Connection | None = None  # the current request's
        self._head: bytes | bytearray = b""  # the bytes fed to the parser since the head began (obs-fold check)
        self._buffer = bytearray()  # bytes past the current request (pipelined), not yet parsed
        self._exchange: _Exchange | None = None
        self._close: Close | None = None

    # --- input ------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the peer, in order; b"" when it sent EOF."""
        phase = self.phase
        if data:
            if phase is IDLE and not self._buffer:
                self._start_head(data)
            elif phase is HEAD:
                self._parser.receive_data(data)
                head = self._head
                if type(head) is not bytearray:  # a head in pieces, rarely: gather them without quadratic copies
                    head = self._head = bytearray(head)
                head += data
            elif phase is BODY or phase is DISCARD:
                self._parser.receive_data(data)
            elif phase is not CLOSED:
                self._buffer += data  # read ahead of next_action(): the next request's bytes
            return
        self.has_peer_eof = self._has_input_ended = True
        if phase is BODY or phase is DISCARD:
            self._parser.receive_data(b"")  # h11 then refuses the short body

    def peer_eof(self) -> AfterEOF:
        """The transport saw EOF; asked again by the shell when it dispatches a request read before it.
        A half-close before a request is complete ends the connection (the reads see it); one after is
        not a disconnect: the request is answered, and the shell probes for a full close (AfterEOF)."""
        self.has_peer_eof = True
        phase = self.phase
        if phase is STREAM:
            return PROBE
        if phase is HANDLER:
            if self._exchange.head.http_version == "1.1":
                return PROBE
            self.is_peer_gone = True
            return GONE
        return READ

    def peer_gone(self) -> bool:
        """The transport saw a reset or lost the connection. True when a handler or its response is in
        progress: the shell must cancel it (that is what aborts its engine request). Otherwise the EOF
        arrives through receive_data() after the bytes the client pipelined before leaving."""
        self.is_peer_gone = True
        phase = self.phase
        return phase is HANDLER or phase is SENDING or phase is STREAM

    def tick(self, now: float) -> Close | None:
        """None before `deadline`; past it, the Close to carry out (the phase is then CLOSED)."""
        if now < self.deadline:
            return None
        phase = self.phase
        exchange = self._exchange
        if phase is IDLE:  # nobody asked anything: a silent close
            return self._shut(b"", linger=False)
        if exchange is not None and exchange.is_continued:
            return self._shut(b"", linger=False)  # the response has begun; a 408 cannot follow it
        config = self._config
        what, limit_s = ("headers", config.header_timeout_s) if phase is HEAD else ("body", config.body_timeout_s)
        error = APIError(408, f"The request {what} did not arrive within {limit_s} s.", code="request_timeout")
        # The client is still dribbling: linger, so that it gets to read the 408.
        self._note_refusal(408)
        path = exchange.head.path if exchange is not None else None
        return self._shut(self._encode(self._dispatcher.error_response(path, error)), linger=True)

    def _note_refusal(self, status: int) -> None:
        """Tell the dispatcher (the access line): the request if its head was read, else a placeholder
        with the client's address."""
        exchange = self._exchange
        self._dispatcher.refused(exchange.request if exchange is not None else
                                 Request("-", "-", "", Headers([]), b"", "1.1", self._client), status)

    @property
    def is_idle(self) -> bool:
        """No request in progress: waiting for a head's first byte, or holding only part of one. Such a
        connection is the first to go when the server is full (evict())."""
        return self.phase is IDLE or self.phase is HEAD

    def evict(self) -> Close:
        """Close an idle connection to make room for another: without a word, as an idle timeout does."""
        return self._shut(b"", linger=False)

    def connection_closed(self) -> None:
        """The shell is done with the connection, whatever the phase: the books on an unfinished
        request are closed."""
        if self.phase is not CLOSED:
            self._shut(b"", linger=False)

    # --- output -----------------------------------------------------------------------------

    def next_action(self) -> Action:
        """What the shell should do next; each call may move the phase on."""
        phase = self.phase
        if phase is HEAD:
            return self._next_head()
        if phase is SENDING:  # the shell wrote (and drained) the response: the exchange is over
            exchange = self._exchange
            self._exchange = None
            self._dispatcher.end()
            if not exchange.keep_alive:
                return self._shut(b"", linger=False)
            self.phase = phase = IDLE
        if phase is IDLE:
            buffer = self._buffer
            if buffer:
                data = bytes(buffer)
                buffer.clear()
                self._start_head(data)
                return self._next_head()
            if self._has_input_ended:
                return self._shut(b"", linger=False)
            # A new connection gets a short wait for its first byte, later requests keep-alive's: sockets
            # opened and left silent must not hold connection slots for long.
            config = self._config
            now = self.idle_since = self._clock()
            self.deadline = now + (config.keep_alive_s if self.num_requests else config.first_byte_timeout_s)
            return NEED_DATA
        if phase is BODY or phase is DISCARD:
            return self._next_body()
        if phase is CLOSED:
            return self._close
        raise RuntimeError(f"next_action() in phase {phase.name}: the shell owes respond(), start_stream() "
                           "or end_stream()")

    def respond(self, response: Response) -> bytes:
        """The whole response to a dispatched request, to go out in one write."""
        assert self.phase is HANDLER, self.phase
        exchange = self._exchange
        keep_alive = exchange.keep_alive = exchange.keep_alive and not self._dispatcher.is_draining
        self.phase = SENDING
        return encode_response(response, keep_alive, exchange.cors_lines, exchange.is_head)

    def start_stream(self, response: SSEResponse) -> tuple[bytes, bool]:
        """The head of a stream, and whether its body is chunked (HTTP/1.1; on 1.0 the close ends it)."""
        assert self.phase is HANDLER, self.phase
        exchange = self._exchange
        is_chunked = exchange.head.http_version == "1.1"
        keep_alive = exchange.keep_alive = exchange.keep_alive and not self._dispatcher.is_draining
        self.phase = STREAM
        return encode_head(response, is_chunked, keep_alive, exchange.cors_lines), is_chunked

    def end_stream(self, is_clean: bool) -> None:
        """The stream's body is written; one that ended in an error event closes the connection."""
        assert self.phase is STREAM, self.phase
        exchange = self._exchange
        exchange.keep_alive = exchange.keep_alive and is_clean and not self._dispatcher.is_draining
        self.phase = SENDING

    # --- one request ------------------------------------------------------------------------

    def _start_head(self, data: bytes) -> None:
        parser = self._parser = h11.Connection(h11.SERVER, max_incomplete_event_size=self._config.max_header_bytes)
        parser.receive_data(data)
        self._head = data
        self.phase = HEAD
        self.deadline = NEVER  # the idle wait is over; the head's own starts if it is incomplete

    def _next_head(self) -> Action:
        try:
            event = self._parser.next_event()
        except h11.RemoteProtocolError as error:
            return self._refuse(APIError(error.error_status_hint, f"Malformed request: {error}.", code="bad_request"))
        if type(event) is h11.Request:
            self.deadline = NEVER
            head, self._head = self._head, b""
            fold = _FOLD_OR_END.search(head)
            if fold is not None and fold.group(1) is not None:
                # h11 unfolds obs-fold into a space; RFC 9112 5.2 lets a server do that or refuse with 400.
                # Refused: a proxy in front may have read the folded line as a header of its own.
                return self._refuse(APIError(400, "Obsolete line folding (a header line that starts with a space "
                                                  "or a tab) is not accepted; send each header on one line.",
                                             code="bad_request"))
            return self._admit(event)
        if self._has_input_ended:  # closed halfway through a head: nobody to answer
            return self._shut(b"", linger=False)
        if self.deadline == NEVER:
            self.deadline = self._clock() + self._config.header_timeout_s
        return NEED_DATA

    def _admit(self, event: h11.Request) -> Action:
        self.num_requests += 1
        config = self._config
        try:
            head = RequestHead(event, config.max_header_bytes)
        except APIError as error:
            return self._refuse(error)
        request = Request(head.method, head.path, head.query, head.headers, b"", head.http_version, self._client)
        target, cors_lines = self._dispatcher.admit(head, request)
        exchange = self._exchange = _Exchange(head, request, cors_lines)
        self._dispatcher.begin()
        if head.is_chunked and head.content_length is not None:
            # Both framings (RFC 9112 6.1): chunked wins, but a proxy in front may have read the other,
            # so bytes after this request could be a smuggled one. Answer it, then close.
            exchange.keep_alive = False
        has_body = head.is_chunked or bool(head.content_length)
        # Every refusal decided from the head goes out before the body is read or a 100 Continue
        # is sent: a body that will be refused is never invited.
        if isinstance(target, Response):
            return self._answer_early(target, has_body)
        if head.content_length is not None and head.content_length > config.max_body_bytes:
            return self._refuse(_too_large(head.content_length, config.max_body_bytes))
        exchange.handler = target
        if not has_body:
            return self._dispatch()
        self.phase = BODY
        if head.expects_continue:
            exchange.is_continued = True
            return Write(CONTINUE)
        return self._next_body()

    def _answer_early(self, response: Response, has_body: bool) -> Action:
        """Answer without a handler. The connection stays open only when the body is small and
        already on its way (it is read and dropped); a client waiting for 100 Continue, or a large
        or chunked body, gets a close instead."""
        exchange = self._exchange
        head = exchange.head
        if not exchange.keep_alive or self._dispatcher.is_draining or (has_body and (
                head.expects_continue or head.is_chunked or head.content_length > self._config.max_body_bytes)):
            return self._shut(self._encode(response), linger=has_body)
        exchange.early = response
        if has_body:
            self.phase = DISCARD
            return self._next_body()
        return self._send_early()

    def _send_early(self) -> Write:
        exchange = self._exchange
        self._buffer += self._parser.trailing_data[0]
        data = encode_response(exchange.early, True, exchange.cors_lines, exchange.is_head)
        self._exchange = None
        self._dispatcher.end()
        self.phase = IDLE
        return Write(data)

    def _next_body(self) -> Action:
        parser = self._parser
        exchange = self._exchange
        limit = self._config.max_body_bytes
        is_chunked = exchange.head.is_chunked
        while True:
            try:
                event = parser.next_event()
            except h11.RemoteProtocolError as error:
                return self._refuse(APIError(error.error_status_hint, f"Malformed request body: {error}.",
                                             code="bad_request"))
            kind = type(event)
            if kind is h11.Data:
                exchange.body_size += len(event.data)
                if exchange.body_size > limit:  # chunked: counted as it arrives, refused at the first byte over
                    return self._refuse(_too_large(exchange.body_size, limit, at_least=True))
                exchange.body_parts.append(event.data)
            elif kind is h11.EndOfMessage:
                break
            elif event is h11.NEED_DATA:
                # A chunk that declares more than the body may hold is refused at its size line, not left
                # to wait for bytes that will be refused (or never sent) until the body deadline.
                declared = exchange.body_size + _chunk_remaining(parser) if is_chunked else 0
                if declared > limit:
                    return self._refuse(APIError(413, f"The request body's chunk sizes declare at least {declared} "
                                                      f"bytes; the limit is {limit}.", code="request_too_large"))
                if self.deadline == NEVER:
                    self.deadline = self._clock() + self._config.body_timeout_s
                return NEED_DATA
            else:
                return self._refuse(APIError(400, "The request body ended unexpectedly.", code="bad_request"))
        self.deadline = NEVER
        if self.phase is DISCARD:
            return self._send_early()
        exchange.request.body = b"".join(exchange.body_parts)
        exchange.body_parts = []
        return self._dispatch()

    def _dispatch(self) -> Action:
        exchange = self._exchange
        # Without a body h11's EndOfMessage is certain; not asking for it saves a tenth of the parse.
        # (Bytes after a request that closes the connection are dropped by the close: _shut.)
        self._buffer += self._parser.trailing_data[0]
        # The client left before its handler could start: it would run for no one. After an EOF, an
        # HTTP/1.1 client is probed once its handler runs (peer_eof); a 1.0 client cannot be.
        if self.is_peer_gone or (self.has_peer_eof and exchange.head.http_version != "1.1"):
            return self._shut(b"", linger=False)
        self.phase = HANDLER
        return Dispatch(exchange.handler, exchange.request)

    # --- endings ----------------------------------------------------------------------------

    def _refuse(self, error: APIError) -> Close:
        """An error answered with the body (if any) unread; then a close, lingering."""
        exchange = self._exchange
        self._note_refusal(error.status)
        if exchange is not None and exchange.is_continued:
            return self._shut(b"", linger=True)  # the response began with 100 Continue; only the close is left
        path = exchange.head.path if exchange is not None else None
        return self._shut(self._encode(self._dispatcher.error_response(path, error)), linger=True)

    def _encode(self, response: Response) -> bytes:
        """`response` as the last one on this connection, for the current request if there is one."""
        exchange = self._exchange
        if exchange is None:
            return encode_response(response, False)
        return encode_response(response, False, exchange.cors_lines, exchange.is_head)

    def _shut(self, data: bytes, linger: bool) -> Close:
        if self._exchange is not None:
            self._exchange = None
            self._dispatcher.end()
        self.phase = CLOSED
        self.deadline = NEVER
        self._parser = None
        self._head = b""
        self._buffer.clear()
        # A client that sent EOF has no bytes left in flight to be reset by: lingering would wait for nothing.
        close = self._close = Close(data, linger and not self.is_peer_gone and not self.has_peer_eof)
        return close


def _chunk_remaining(parser: h11.Connection) -> int:
    """Bytes the chunk being read still declares (0 between chunks). h11 keeps the count private; were it to
    go, this reads 0 and a chunked body is refused as its bytes arrive, as it was before."""
    remaining = getattr(getattr(parser, "_reader", None), "_bytes_in_chunk", 0)
    return remaining if type(remaining) is int else 0


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(413, f"The request body is {'over ' if at_least else ''}{size} bytes; the limit is {limit}.",
                    code="request_too_large")
