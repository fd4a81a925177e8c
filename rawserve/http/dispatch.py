"""What the server lends each connection, and nothing more: admission of a request head (draining,
CORS, auth, routing) and the count of requests in flight that a graceful drain waits on. Connections
hold this instead of the server, so neither module imports the other. No sockets, no awaits.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

from rawserve.errors import APIError
from rawserve.http.auth import APIKeyAuth
from rawserve.http.messages import Request, RequestHead, Response
from rawserve.http.routing import CORSPolicy, Handler, Router

# How long a client refused by a drain should wait: by then a router or Service has moved it to another replica.
DRAIN_RETRY_AFTER_S = 1


class Dispatcher:
    """Admits requests for one server. `is_draining` is written by the server alone."""

    __slots__ = ("router", "auth", "cors", "is_draining", "num_in_flight", "open_while_draining", "_on_drained",
                 "_on_refusal")

    def __init__(self, router: Router, auth: APIKeyAuth, cors: CORSPolicy,
                 on_drained: Callable[[], None] | None = None,
                 on_refusal: Callable[[Request, int], None] | None = None,
                 open_while_draining: Iterable[str] = ()) -> None:
        """open_while_draining: paths still routed during a drain (probes, metrics); others get 503."""
        self.router = router
        self.open_while_draining = frozenset(open_while_draining)
        self.auth = auth
        self.cors = cors
        self.is_draining = False
        self.num_in_flight = 0  # requests between their head and the end of their response
        self._on_drained = on_drained  # called when a drain is on and the last request ends
        self._on_refusal = on_refusal  # told of each request answered here (its access line)

    def admit(self, head: RequestHead, request: Request) -> tuple[Handler | Response, bytes]:
        """The handler to run for `request`, or the answer to give without one (503 while
        draining, a CORS preflight, 401, 404, 405); with the CORS lines its response owes.

        Sets `request.api_key` and `request.path_params` when a handler is found. Everything
        here is decided from the head alone, so a refusal goes out before any body is read.
        """
        cors = self.cors
        cors_lines = b""
        if head.origin is not None and cors.is_enabled:
            cors_lines = cors.response_headers(head.origin)
        try:
            if self.is_draining and head.path not in self.open_while_draining:
                raise APIError(503, "The server is shutting down.", code="server_shutting_down",
                               headers=[(b"retry-after", b"%d" % DRAIN_RETRY_AFTER_S)])
            requested_method = head.headers.get("access-control-request-method") if cors.is_enabled else None
            if cors.is_preflight(head.method, head.origin, requested_method):
                # The preflight answer carries its own CORS lines.
                return cors.preflight(self.router, head.path, head.origin, requested_method,
                                      head.headers.get("access-control-request-headers")), b""
            request.api_key = self.auth.check(head.path, head.headers)
            handler, request.path_params = self.router.resolve(head.method, head.path)
        except APIError as error:
            self.refused(request, error.status)
            return self.error_response(head.path, error), cors_lines
        return handler, cors_lines

    def error_response(self, path: str | None, error: APIError) -> Response:
        """`error` in the shape its path's API uses (the router's choice)."""
        return self.router.error_response(path, error)

    def refused(self, request: Request, status: int) -> None:
        """A request answered without a handler (here, or by the connection for its framing)."""
        if self._on_refusal is not None:
            self._on_refusal(request, status)

    def begin(self) -> None:
        """A request head arrived: one more request in flight."""
        self.num_in_flight += 1

    def end(self) -> None:
        """A request's response ended (or its connection did)."""
        self.num_in_flight -= 1
        if self.num_in_flight == 0 and self.is_draining and self._on_drained is not None:
            self._on_drained()
