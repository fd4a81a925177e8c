"""Generic HTTP/1.1 on asyncio streams with h11: the public names the API layer builds on.

Imports only the standard library, h11, orjson, rawserve.errors and rawserve.config; never
anything that knows about models.
"""
from __future__ import annotations

from rawserve.http.auth import APIKeyAuth
from rawserve.http.messages import Headers, JSONResponse, Request, Response, TextResponse
from rawserve.http.routing import CORSPolicy, Handler, Router
from rawserve.http.schema import FieldError, parse
from rawserve.http.server import HTTPServer, bind_socket
from rawserve.http.sse import SSEResponse

__all__ = [
    "APIKeyAuth", "CORSPolicy", "FieldError", "Handler", "Headers", "HTTPServer", "JSONResponse", "Request", "Response",
    "Router", "SSEResponse", "TextResponse", "bind_socket", "parse",
]
