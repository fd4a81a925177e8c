"""Errors that cross layers: the API error in OpenAI's shape, overload and a dead engine.

Standard library only, so every layer (http, api, engine frontend) can raise and catch them.
"""
from __future__ import annotations

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error a client caused or must see, rendered as {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or []

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Overloaded(Exception):
    """The server will not take more work now (too many in flight, draining). Maps to 503."""


class EngineDead(Exception):
    """The engine core failed or exited; no request can be served until a restart. Maps to 503."""
