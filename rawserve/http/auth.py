"""API keys (`--api-key`, one or many) on every path but the probes': `Authorization: Bearer <key>`, or
`x-api-key: <key>` as Anthropic's clients send it (the same keys). 401 in the shape the path's API uses.

/health, /ready and /metrics stay open for load balancers and scrapers; `--open-paths` may open more (e.g.
/tokenize, /version). Knows nothing of per-key limits; that is the API layer's business.
"""
from __future__ import annotations

import hmac
from collections.abc import Iterable

from rawserve.errors import APIError
from rawserve.http.messages import Headers

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class APIKeyAuth:
    def __init__(self, api_keys: list[str], open_paths: Iterable[str] = ()) -> None:
        self.open_paths = OPEN_PATHS.union(open_paths)
        for key in api_keys:
            if not key or key != key.strip():
                raise ValueError("--api-key: a key must be non-empty without surrounding spaces")
        self._keys = [key.encode("utf-8") for key in api_keys]
        self.is_enabled = bool(self._keys)

    def check(self, path: str, headers: Headers) -> str | None:
        """The key a protected request presented (None when auth is off or the path is open);
        APIError 401 when the key is missing or wrong."""
        if not self.is_enabled or path in self.open_paths:
            return None
        value = headers.get("authorization")
        if value is not None:
            scheme, _, key = value.partition(" ")
            key = key.strip()
            if scheme.lower() != "bearer" or not key:
                raise _unauthorized("Malformed Authorization header: expected 'Bearer <key>'.")
        else:
            key = (headers.get("x-api-key") or "").strip()
            if not key:
                raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
        presented = key.encode("latin-1")  # the header's bytes exactly as sent
        # Compare against every key without stopping early, so the timing says nothing about
        # which key (or how much of one) matched.
        matched = False
        for candidate in self._keys:
            matched |= hmac.compare_digest(presented, candidate)
        if not matched:
            raise _unauthorized("Incorrect API key provided.")
        return key


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
