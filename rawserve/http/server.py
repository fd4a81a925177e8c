"""The listener: accepts sockets (at the connection cap, closing the one idle longest to make room; per
client address up to its own cap), owns the connection tasks, and shuts down gracefully on SIGTERM/SIGINT
(a second signal stops at once) within `drain_timeout_s`.

Knows nothing of routes' meaning; the API layer hands it a Router and may watch `is_draining`.
Connections get a Dispatcher (dispatch.py), never the server itself.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from collections.abc import Iterable
from typing import Callable

import orjson

from rawserve.config import ServerConfig
from rawserve.errors import APIError
from rawserve.http.auth import APIKeyAuth
from rawserve.http.connection import SHUTDOWN, Connection, StreamProtocol
from rawserve.http.protocol import NEVER
from rawserve.http.dispatch import Dispatcher
from rawserve.http.messages import Request
from rawserve.http.routing import CORSPolicy, Router

logger = logging.getLogger("rawserve.http")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_STREAM_LIMIT = 256 * 1024  # StreamReader pauses the socket past twice this
_CLOSE_WAIT_S = 2.0  # after the drain, how long stopped connections get to unwind
_STOP_RESERVE_S = 1.0  # of drain_timeout_s, kept for cancelling the rest and stopping the engine
# One timer for all connections' deadlines, instead of TimerHandles per request; timeouts are
# then accurate to this much.
TICK_S = 0.02
# What one recv() may return. asyncio's default (256 KiB) is over glibc's mmap threshold, so every
# read would mmap, mremap and munmap a fresh buffer: three syscalls and a page fault per request,
# about a fifth of a small request's cost. 64 KiB comes from the heap.
_RECV_BYTES = 65536


def _refusal(message: str) -> bytes:
    body = orjson.dumps(APIError(503, message, code="too_many_connections").to_dict())
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%b") % (len(body), body)


_FULL_RESPONSE = _refusal("Too many open connections; try again later.")
_PER_IP_RESPONSE = _refusal("Too many open connections from this address; try again later.")


class HTTPServer:
    """Serve `router` on `config.host:config.port`.

    `await start()` binds (port 0 picks a free port; see `.port`), `await serve_until_shutdown()`
    runs until a signal or `shutdown()`, and `shutdown()` drains: new requests get 503 with Retry-After
    (the listener stays open, so a client or router is told rather than refused, and probes still
    answer), in-flight requests finish, and whatever is left when `drain_timeout_s` is nearly spent is
    cancelled, so that the whole shutdown fits in it.
    """

    def __init__(self, config: ServerConfig, router: Router,
                 on_refusal: Callable[[Request, int], None] | None = None,
                 open_while_draining: Iterable[str] = ()) -> None:
        """on_refusal(request, status): told of each request refused before a handler (503 while draining,
        401, 404, 405), e.g. for an access log. open_while_draining: paths still served during a drain
        (health and readiness probes, /metrics)."""
        self.config = config
        self.router = router
        self.auth = APIKeyAuth(config.api_key, config.open_paths)
        self.cors = CORSPolicy(config.allowed_origins)
        self.port: int | None = None
        self._dispatcher = Dispatcher(router, self.auth, self.cors, self._on_drained, on_refusal,
                                      open_while_draining)
        self._listener: asyncio.base_events.Server | None = None
        self._connections: dict[Connection, asyncio.Task] = {}  # each with the task that serves it
        self._per_address: dict[str, int] = {}  # open connections per client address (--max-connections-per-ip)
        self.num_evicted = 0  # idle connections closed to make room at the cap
        self._drain_callbacks: list[Callable[[], None]] = []
        self._drained: asyncio.Event | None = None  # set when draining and nothing is in flight
        self._stopped: asyncio.Future[int] | None = None
        self._shutdown_task: asyncio.Task | None = None
        self._num_signals = 0
        self._ticker: asyncio.TimerHandle | None = None

    # --- state the API layer reads ---------------------------------------------------------

    @property
    def is_draining(self) -> bool:
        return self._dispatcher.is_draining

    @property
    def num_in_flight(self) -> int:
        """Requests between their head and the end of their response."""
        return self._dispatcher.num_in_flight

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once when the drain begins (e.g. to turn /health to 503)."""
        self._drain_callbacks.append(callback)

    # --- lifecycle -------------------------------------------------------------------------

    def set_router(self, router: Router) -> None:
        """Serve `router` from the next request on, and say the server listens (what scripts wait for): the
        application starts with a loading router while the model loads, then sets its own."""
        self.router = router
        self._dispatcher.router = router
        self._announce()

    def _announce(self) -> None:
        logger.info("listening on %s://%s:%d", self.config.scheme, self.config.host, self.port)

    async def start(self, sock: socket.socket | None = None, announce: bool = True) -> None:
        """Listen on `sock` (from bind_socket(), bound before a slow start-up) or bind now. `announce=False`
        leaves the "listening on" line to set_router, once the real routes are in place."""
        if self._listener is not None:
            raise RuntimeError("the server is already started")
        loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        self._stopped = loop.create_future()

        def new_protocol() -> StreamProtocol:  # what asyncio.start_server builds, with the hook
            return StreamProtocol(asyncio.StreamReader(_STREAM_LIMIT, loop), self._accept, loop)

        _raise_fd_limit(self.config.max_connections)
        if sock is None:
            sock = bind_socket(self.config)
        try:
            self._listener = await loop.create_server(new_protocol, sock=sock, backlog=_backlog(self.config),
                                                      ssl=self._ssl_context())
        except BaseException:
            sock.close()
            raise
        self.port = self._listener.sockets[0].getsockname()[1]
        if announce:
            self._announce()

    def _ssl_context(self) -> ssl.SSLContext | None:
        """TLS with --ssl-certfile/--ssl-keyfile: asyncio's SSL transport under the same connections."""
        if self.config.ssl_certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.ssl_certfile, self.config.ssl_keyfile)
        return context

    async def serve_until_shutdown(self, install_signal_handlers: bool = True) -> int:
        """Serve until `shutdown()` finishes or a signal arrives; returns the process exit status:
        0 after a graceful drain, 128 + signal number when a second signal cut it short."""
        if self._listener is None:
            await self.start()
        assert self._stopped is not None
        loop = asyncio.get_running_loop()
        installed = []
        if install_signal_handlers:
            for sig in _SIGNALS:
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        try:
            return await asyncio.shield(self._stopped)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        self._num_signals += 1
        if self._num_signals == 1:  # the ordinary way to stop a server (an orchestrator, Ctrl-C): info, not a warning
            logger.info("%s: draining (send it again to stop at once)", signal.Signals(sig).name)
            self._shutdown_task = asyncio.get_running_loop().create_task(self.shutdown())
        else:
            logger.warning("second signal %s: stopping at once", signal.Signals(sig).name)
            self._force(128 + sig)

    def _force(self, status: int) -> None:
        self._begin_drain()
        self._close_listener()
        for connection in list(self._connections):
            connection.stop(SHUTDOWN)
        if self._shutdown_task is not None:
            self._shutdown_task.cancel()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(status)

    def _begin_drain(self) -> None:
        if self._dispatcher.is_draining:
            return
        self._dispatcher.is_draining = True
        for callback in self._drain_callbacks:
            try:
                callback()
            except Exception:  # one broken hook must not stop the drain; the log shows it
                logger.exception("drain callback %r failed", callback)

    async def shutdown(self) -> None:
        """Drain gracefully: see the class docstring. Safe to call more than once."""
        if self._listener is None:
            return
        self._begin_drain()
        assert self._drained is not None and self._stopped is not None
        if self.num_in_flight == 0:
            self._drained.set()
        # Part of the budget is kept for cancelling what is left and stopping the engine after it.
        timeout = self.config.drain_timeout_s
        try:
            await asyncio.wait_for(self._drained.wait(), timeout - min(_STOP_RESERVE_S, timeout / 4))
        except asyncio.TimeoutError:
            logger.warning("drain timeout: cancelling %d in-flight request(s)", self.num_in_flight)
        self._close_listener()
        await self._stop_connections()
        if not self._stopped.done():
            self._stopped.set_result(0)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()

    async def _stop_connections(self) -> None:
        tasks = []
        for connection, task in list(self._connections.items()):
            connection.stop(SHUTDOWN)
            tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_CLOSE_WAIT_S)
            if pending:
                logger.warning("%d connection(s) did not stop within %.1f s", len(pending), _CLOSE_WAIT_S)
        if self._ticker is not None and not self._connections:
            self._ticker.cancel()
            self._ticker = None

    async def __aenter__(self) -> HTTPServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # --- connections -----------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      protocol: StreamProtocol) -> None:
        if len(self._connections) >= self.config.max_connections and not self._make_room():
            await _refuse(reader, writer, _FULL_RESPONSE)
            return
        peer = writer.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else ""
        per_address = self._per_address
        limit = self.config.max_connections_per_ip
        if limit and per_address.get(address, 0) >= limit:
            await _refuse(reader, writer, _PER_IP_RESPONSE)
            return
        per_address[address] = per_address.get(address, 0) + 1
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small responses must not wait for Nagle; asyncio usually sets this already.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(getattr(writer.transport, "max_size", None), int):  # selector transports
            writer.transport.max_size = _RECV_BYTES
        connection = Connection(reader, writer, self.config, self._dispatcher)
        protocol.on_peer_eof = connection.peer_eof
        protocol.on_peer_gone = connection.peer_gone
        self._connections[connection] = asyncio.current_task()
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(TICK_S, self._tick)
        try:
            await connection.run()
        finally:
            del self._connections[connection]
            left = per_address[address] - 1
            if left:
                per_address[address] = left
            else:
                del per_address[address]

    def _make_room(self) -> bool:
        """At the cap: close the connection that has been idle longest (waiting for a head, or holding part of
        one), as nginx reuses its oldest keep-alive connection. False when every connection is busy."""
        victim, oldest = None, NEVER
        for connection in self._connections:
            since = connection.idle_since
            if since < oldest:
                victim, oldest = connection, since
        if victim is None:
            return False
        victim.evict()
        self.num_evicted += 1
        logger.debug("at the connection cap (%d): closed an idle connection", self.config.max_connections)
        return True

    def _tick(self) -> None:
        if not self._connections:
            self._ticker = None  # idle: the next accepted connection restarts it
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for connection in list(self._connections):
            connection.tick(now)
        self._ticker = loop.call_later(TICK_S, self._tick)

    def _on_drained(self) -> None:
        if self._drained is not None:
            self._drained.set()


def _raise_fd_limit(max_connections: int) -> None:
    """Lift the soft open-files limit to the hard one: at the connection cap, accept() must not fail for want
    of descriptors (asyncio then stops accepting for a second, health probes included)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < max_connections + 64:
        logger.warning("--max-connections %d is near the open-files limit (%d): raise `ulimit -n`",
                       max_connections, soft)


def _backlog(config: ServerConfig) -> int:
    return min(config.max_connections, 4096)


def bind_socket(config: ServerConfig) -> socket.socket:
    """A listening socket on `config.host:config.port`; OSError (e.g. the port is in use) at once.

    Bound before the engine starts, so a taken port fails in a moment instead of after loading a model.
    """
    family, kind, proto, _, address = socket.getaddrinfo(config.host or None, config.port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's create_server does
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(_backlog(config))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response: bytes) -> None:
    """Answer 503 to a connection over a cap, and close it without a reset (see LINGER_S)."""
    try:
        writer.write(response)
        if writer.can_write_eof():
            writer.write_eof()
        await asyncio.wait_for(reader.read(65536), 0.2)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
    finally:
        writer.close()
