"""The (method, path) table that picks a handler, with 404 / 405 + Allow, and CORS preflight; which shape
an error has on a path (OpenAI's unless a prefix was given its own).

Knows nothing about what handlers do; it never reads a body.
"""
from __future__ import annotations

import re
import urllib.parse
from typing import Any, Awaitable, Callable

from rawserve.errors import APIError
from rawserve.http.messages import Request, Response, error_response

Handler = Callable[[Request], Awaitable[Any]]

_METHOD = re.compile(r"[A-Z]+\Z")
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(:path)?\}")


class Router:
    """Exact paths are one dict lookup. A path may also hold `{name}` (one segment) or a final
    `{name:path}` (the rest, slashes included, e.g. a model id like `org/model`)."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[str, re.Pattern[str], dict[str, Handler]]] = []
        self._error_shapes: list[tuple[str, Callable[[APIError], Response]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if not _METHOD.match(method):
            raise ValueError(f"method must be an upper-case token like 'GET', got {method!r}")
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', got {path!r}")
        if not callable(handler):
            raise ValueError(f"handler for {method} {path} is not callable")
        if "{" in path:
            table = self._pattern_table(path)
        else:
            table = self._exact.setdefault(path, {})
        if method in table:
            raise ValueError(f"{method} {path} is already routed")
        table[method] = handler

    def _pattern_table(self, path: str) -> dict[str, Handler]:
        for source, _, table in self._patterns:
            if source == path:
                return table
        regex, pos = "", 0
        for match in _PARAM.finditer(path):
            is_rest = match.group(2) is not None
            if is_rest and match.end() != len(path):
                raise ValueError(f"{{{match.group(1)}:path}} must end the path, in {path!r}")
            regex += re.escape(path[pos:match.start()])
            regex += f"(?P<{match.group(1)}>{'.+' if is_rest else '[^/]+'})"
            pos = match.end()
        if "{" in path[pos:] or "}" in path[pos:]:
            raise ValueError(f"malformed path parameter in {path!r}")
        table: dict[str, Handler] = {}
        self._patterns.append((path, re.compile(regex + re.escape(path[pos:]) + r"\Z"), table))
        return table

    def _table(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        table = self._exact.get(path)
        if table is not None:
            return table, {}
        for _, pattern, table in self._patterns:
            match = pattern.match(path)
            if match:
                return table, {name: urllib.parse.unquote(value) for name, value in match.groupdict().items()}
        return None, {}

    def set_error_shape(self, prefix: str, render: Callable[[APIError], Response]) -> None:
        """Errors for `prefix` and the paths under it are rendered by `render` (another API's error shape), those
        the HTTP layer answers itself (401, 404, 405, 413, ...) included."""
        self._error_shapes.append((prefix.rstrip("/"), render))

    def error_response(self, path: str | None, error: APIError) -> Response:
        """`error` as its answer on `path` (None: no request head yet)."""
        if path is not None:
            for prefix, render in self._error_shapes:
                if path == prefix or path.startswith(prefix + "/"):
                    return render(error)
        return error_response(error)

    def allowed_methods(self, path: str) -> list[str]:
        """Methods routed for `path`; empty when the path is unknown."""
        table, _ = self._table(path)
        return sorted(table) if table else []

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler and path parameters, or APIError 404 (unknown path) / 405 (known path)."""
        table, params = self._table(path)
        if table is None:
            raise APIError(404, f"Invalid URL ({method} {path}).", code="not_found")
        handler = table.get(method)
        if handler is None:
            allow = ", ".join(sorted(table))
            raise APIError(405, f"Method {method} is not allowed for {path}; allowed: {allow}.",
                           code="method_not_allowed", headers=[(b"allow", allow.encode())])
        return handler, params


class CORSPolicy:
    """`--allowed-origins`: which browser origins may call us, and the preflight answer.

    Empty means CORS is off: no CORS headers, and OPTIONS is routed like any other method.
    """

    def __init__(self, allowed_origins: list[str]) -> None:
        self._any = "*" in allowed_origins
        self._origins = frozenset(o.rstrip("/") for o in allowed_origins if o != "*")
        self.is_enabled = bool(allowed_origins)

    def allow_origin(self, origin: str | None) -> bytes | None:
        """The Access-Control-Allow-Origin value for `origin`, or None when it is not allowed."""
        if origin is None or not self.is_enabled:
            return None
        if self._any:
            return b"*"
        return origin.encode("latin-1") if origin in self._origins else None

    def response_headers(self, origin: str | None) -> bytes:
        """Header lines added to an ordinary response for an allowed origin."""
        allowed = self.allow_origin(origin)
        if allowed is None:
            return b""
        return b"access-control-allow-origin: " + allowed + b"\r\nvary: origin\r\n"

    def is_preflight(self, method: str, origin: str | None, requested_method: str | None) -> bool:
        return self.is_enabled and method == "OPTIONS" and origin is not None and requested_method is not None

    def preflight(self, router: Router, path: str, origin: str | None, requested_method: str | None,
                  requested_headers: str | None) -> Response:
        """The answer to an OPTIONS preflight: 204 with the grants, 403 for a foreign origin,
        404 for an unknown path and 405 when the requested method is not routed there."""
        allowed = self.allow_origin(origin)
        if allowed is None:
            raise APIError(403, f"Origin {origin!r} is not allowed.", code="origin_not_allowed")
        methods = router.allowed_methods(path)
        if not methods:
            raise APIError(404, f"Invalid URL (OPTIONS {path}).", code="not_found")
        if requested_method not in methods:
            raise APIError(405, f"Method {requested_method} is not allowed for {path}.",
                           code="method_not_allowed", headers=[(b"allow", ", ".join(methods).encode())])
        headers = [
            ("access-control-allow-origin", allowed),
            ("access-control-allow-methods", ", ".join(methods)),
            # Echo what the browser asked for: auth is by bearer key, not by which headers are sent.
            ("access-control-allow-headers", requested_headers or "authorization, content-type"),
            ("access-control-max-age", "600"),
            ("vary", "origin"),
        ]
        return Response(b"", 204, headers)
