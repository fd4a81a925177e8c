"""Request and response objects passed between a connection and its handlers; heads both ways.

Knows HTTP framing only: no routing, no sockets. Response heads are serialized here, by hand:
h11's send path would double h11's cost per request (about 37 µs with it, 18 µs parsing only).
"""
from __future__ import annotations

import email.utils
import http
import re
import time
import urllib.parse
from typing import Any, Iterable

import h11
import orjson

from rawserve.errors import APIError

HeaderPairs = Iterable[tuple[str | bytes, str | bytes]]

# RFC 9110 token characters for a field name; a value may hold anything visible but CR, LF and NUL.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(rb"[\r\n\x00]")
# A request target in absolute-form (RFC 9112 3.2.2): the scheme and authority before the path, which a server
# must accept though clients send it only to proxies.
_ABSOLUTE_FORM = re.compile(rb"https?://[^/?#]*", re.IGNORECASE)


class Headers:
    """Request headers with case-insensitive lookup; names arrive lowercased from h11."""

    __slots__ = ("raw", "_index")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw  # [(lowercase name, value)] in arrival order
        self._index: dict[str, list[str]] | None = None

    def _build(self) -> dict[str, list[str]]:
        index: dict[str, list[str]] = {}
        for name, value in self.raw:
            index.setdefault(name.decode("latin-1"), []).append(value.decode("latin-1"))
        self._index = index
        return index

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of `name`, or `default`."""
        values = (self._index or self._build()).get(name.lower())
        return values[0] if values else default

    def get_all(self, name: str) -> list[str]:
        return list((self._index or self._build()).get(name.lower(), ()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in (self._index or self._build())

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def items(self) -> list[tuple[str, str]]:
        return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw]

    def __len__(self) -> int:
        return len(self.raw)

    def __repr__(self) -> str:
        return f"Headers({self.items()!r})"


class RequestHead:
    """What the connection needs from an h11 request head, gathered in one pass over the headers.

    Raises APIError 431 (head over `max_header_bytes`: h11 only bounds a head that arrives in
    pieces) or 505 (h11 parses any d.d version; we speak 1.0 and 1.1).
    """

    __slots__ = ("method", "path", "query", "http_version", "headers", "content_length", "is_chunked",
                 "expects_continue", "wants_close", "origin")

    def __init__(self, event: h11.Request, max_header_bytes: int) -> None:
        content_length: int | None = None
        is_chunked = expects_continue = wants_close = False
        origin: str | None = None
        raw: list[tuple[bytes, bytes]] = []
        size = len(event.target) + len(event.method) + 14
        # h11 keeps (raw name, lowercase name, value) triples; its public iterator rebuilds pairs
        # through __getitem__, which costs more than this whole loop. Fall back to it if the
        # private list ever goes away.
        try:
            triples = event.headers._full_items
        except AttributeError:
            triples = [(name, name, value) for name, value in event.headers]
        for _, name, value in triples:
            raw.append((name, value))
            size += len(name) + len(value) + 4
            if name == b"content-length":
                content_length = int(value)  # h11 already checked it is digits and consistent
            elif name == b"transfer-encoding":
                is_chunked = True  # h11 refuses every transfer-coding but chunked
            elif name == b"connection":
                wants_close = b"close" in value.lower()
            elif name == b"expect":
                expects_continue = value.lower() == b"100-continue"
            elif name == b"origin":
                origin = value.decode("latin-1")
        if size > max_header_bytes:
            raise APIError(431, f"The request line and headers exceed {max_header_bytes} bytes.",
                           code="headers_too_large")
        if event.http_version not in (b"1.1", b"1.0"):
            raise APIError(505, f"HTTP/{event.http_version.decode()} is not supported.",
                           code="http_version_not_supported")
        self.http_version = event.http_version.decode("ascii")
        self.method = event.method.decode("ascii")  # h11 allows token characters only
        target = event.target
        if target[:1] != b"/":
            absolute = _ABSOLUTE_FORM.match(target)
            if absolute is not None:  # routed by its path and query; an empty path is "/"
                target = target[absolute.end():]
                if target[:1] != b"/":
                    target = b"/" + target
        self.path, _, self.query = target.decode("latin-1").partition("?")
        self.headers = Headers(raw)
        self.content_length = content_length
        self.is_chunked = is_chunked
        self.expects_continue = expects_continue and self.http_version == "1.1"
        self.wants_close = wants_close
        self.origin = origin


class Request:
    """One parsed request with its whole body; handlers receive this."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "http_version", "client",
                 "path_params", "api_key", "_json")

    def __init__(self, method: str, path: str, query_string: str, headers: Headers, body: bytes,
                 http_version: str = "1.1", client: Any = None) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.http_version = http_version
        self.client = client  # the peer address as the socket reports it
        self.path_params: dict[str, str] = {}
        self.api_key: str | None = None  # the bearer key that passed auth (for per-key limits)
        self._json: dict | None = None

    @property
    def query(self) -> dict[str, str]:
        """Query parameters; the first value wins when a name repeats."""
        out: dict[str, str] = {}
        for name, value in urllib.parse.parse_qsl(self.query_string, keep_blank_values=True):
            out.setdefault(name, value)
        return out

    def json(self) -> dict:
        """The body as a JSON object, or APIError 400 in OpenAI's shape."""
        if self._json is None:
            try:
                value = orjson.loads(self.body)
            except orjson.JSONDecodeError as error:
                # orjson calls every invalid UTF-8 sequence "surrogates not allowed"; say what is wrong instead.
                try:
                    self.body.decode("utf-8")
                except UnicodeDecodeError as bad:
                    raise APIError(400, f"The request body is not valid UTF-8: byte 0x{self.body[bad.start]:02x} "
                                        f"at offset {bad.start}.", code="invalid_json") from None
                raise APIError(400, f"The request body is not valid JSON: {error}.",
                               code="invalid_json") from None
            if not isinstance(value, dict):
                raise APIError(400, f"The request body must be a JSON object, got {_json_kind(value)}.",
                               code="invalid_json")
            self._json = value
        return self._json

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path}>"


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array"}.get(type(value), type(value).__name__)


def encode_headers(headers: HeaderPairs | None) -> bytes:
    """Validated `name: value\\r\\n` lines; a CR or LF from a handler must never split a response."""
    if not headers:
        return b""
    out = bytearray()
    for name, value in headers:
        name_b = name.encode("latin-1") if isinstance(name, str) else name
        value_b = value.encode("latin-1") if isinstance(value, str) else value
        if not _TOKEN.match(name_b) or _BAD_VALUE.search(value_b):
            raise ValueError(f"invalid response header {name!r}: {value!r}")
        out += name_b + b": " + value_b + b"\r\n"
    return bytes(out)


_KNOWN_TYPES = frozenset({"application/json", "application/octet-stream", "text/plain; charset=utf-8"})


class Response:
    """A complete response whose body is known up front; sent with Content-Length."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, body: bytes = b"", status: int = 200, headers: HeaderPairs | None = None,
                 content_type: str = "application/octet-stream") -> None:
        if not 200 <= status <= 599:
            raise ValueError(f"status must be a final status in 200..599, got {status}")
        if type(body) is not bytes and not isinstance(body, (bytes, bytearray)):
            raise TypeError(f"a response body is bytes, got {type(body).__name__}")
        if status in _NO_BODY and body:
            raise ValueError(f"a {status} response carries no body")
        if content_type not in _KNOWN_TYPES and _BAD_VALUE.search(content_type.encode("latin-1")):
            raise ValueError(f"invalid content type {content_type!r}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = encode_headers(headers)


class JSONResponse(Response):
    __slots__ = ()

    def __init__(self, content: Any, status: int = 200, headers: HeaderPairs | None = None) -> None:
        super().__init__(orjson.dumps(content), status, headers, "application/json")


class TextResponse(Response):
    """Plain text, e.g. Prometheus exposition for /metrics."""

    __slots__ = ()

    def __init__(self, text: str, status: int = 200, headers: HeaderPairs | None = None,
                 content_type: str = "text/plain; charset=utf-8") -> None:
        super().__init__(text.encode("utf-8"), status, headers, content_type)


# What a client may retry: the openai SDK retries 408, 409, 429 and every 5xx unless `x-should-retry` says
# otherwise. Our 500s are deterministic (the same request fails the same way), so only these are worth a retry.
RETRYABLE_STATUSES = frozenset({408, 409, 429, 502, 503, 504})
# 429 and 503 always say when to come back; an error that knows better (a token bucket's refill) sets its own.
DEFAULT_RETRY_AFTER_S = 1


def error_response(error: APIError) -> Response:
    """Every error the server answers, in OpenAI's shape: `x-should-retry: false` on what a retry cannot fix,
    `retry-after` on 429 and 503."""
    headers = list(error.headers)
    names = {name.lower() for name, _ in headers}
    if error.status not in RETRYABLE_STATUSES and b"x-should-retry" not in names:
        headers.append((b"x-should-retry", b"false"))
    if error.status in (429, 503) and b"retry-after" not in names:
        headers.append((b"retry-after", b"%d" % DEFAULT_RETRY_AFTER_S))
    return Response(orjson.dumps(error.to_dict()), error.status, headers, "application/json")


_NO_BODY = (204, 304)
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = http.HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode("ascii")
    return line


class _DateCache:
    """`date:` and `server:` lines, formatted once a second rather than once a request."""

    second = -1
    lines = b""


def common_headers() -> bytes:
    now = int(time.time())
    if now != _DateCache.second:
        _DateCache.second = now
        _DateCache.lines = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\nserver: rawserve\r\n"
    return _DateCache.lines


def encode_response(response: Response, keep_alive: bool, extra: bytes = b"", head_only: bool = False) -> bytes:
    """The whole response as one buffer, so it leaves in one `write` (one syscall when idle)."""
    if response.status in _NO_BODY:  # RFC 9110 forbids Content-Length on a 204
        return b"".join((status_line(response.status), common_headers(),
                         b"" if keep_alive else b"connection: close\r\n", response.headers, extra, b"\r\n"))
    head = b"".join((
        status_line(response.status), common_headers(),
        b"content-type: ", response.content_type.encode("latin-1"),
        b"\r\ncontent-length: ", str(len(response.body)).encode(),
        b"\r\n" if keep_alive else b"\r\nconnection: close\r\n",
        response.headers, extra, b"\r\n",
    ))
    return head if head_only else head + response.body
