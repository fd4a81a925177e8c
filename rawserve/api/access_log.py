"""The access log: one line per routed request (method, path, status, tokens, TTFT, total time, finish
reason, client), and the error lines: a 4xx's message at debug, a 5xx or an engine failure at error, with
the request id. Records only; the handlers and the connection do the work.

The handler wrapper puts an AccessRecord in a context variable; the one loop every generation runs
(serving.choice_chunks) fills in the rid, tokens and finish reasons. A stream's line is written when its
last event has gone out (or its client left), so the total time is the client's.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from rawserve.errors import APIError
from rawserve.http import Request, Response, SSEResponse
from rawserve.http.routing import Handler

log = logging.getLogger("rawserve.access")
error_log = logging.getLogger("rawserve.api")


class AccessRecord:
    """What one request did, as the access line reports it."""

    __slots__ = ("start", "rid", "tally", "first_token_s", "finish_reasons", "stream_error")

    def __init__(self, start: float) -> None:
        self.start = start
        self.rid: str | None = None
        self.tally: Any = None  # serving.UsageTally: prompt and completion tokens
        self.first_token_s: float | None = None  # since start
        self.finish_reasons: list[str] = []
        self.stream_error: APIError | None = None  # raised after the 200 went out (an SSE error event)

    def first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.start


ACCESS: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("rawserve_access", default=None)


def current() -> AccessRecord | None:
    """The running request's record; None outside a logged handler (tests, the offline LLM)."""
    return ACCESS.get()


def logged(handler: Handler, is_enabled: bool = True) -> Handler:
    """`handler` with its access line (when `is_enabled`) and its error lines (always)."""

    async def wrapped(request: Request) -> Response | SSEResponse:
        record = AccessRecord(time.monotonic())
        ACCESS.set(record)  # the connection's task runs one request at a time: this is that request's
        try:
            response = await handler(request)
        except APIError as error:
            log_error(request, record, error)
            if is_enabled:
                _access(request, record, error.status)
            raise
        except asyncio.CancelledError:  # the client left (or a deadline or shutdown cut it): nothing was answered
            if is_enabled:
                _access(request, record, 499)  # nginx's "client closed request", not a 500 of ours
            raise
        except BaseException:  # the connection logs the traceback and answers 500; we count the line
            if is_enabled:
                _access(request, record, 500)
            raise
        if isinstance(response, SSEResponse):
            response.events = _watch(response.events, request, record, response.status, is_enabled)
        elif is_enabled:
            _access(request, record, response.status)
        return response

    return wrapped


async def _watch(events: AsyncIterator[Any], request: Request, record: AccessRecord, status: int,
                 is_enabled: bool) -> AsyncIterator[Any]:
    ACCESS.set(record)
    try:
        async for event in events:
            yield event
    except APIError as error:  # sse.stream turns it into an error event; the operator sees it here
        record.stream_error = error
        log_error(request, record, error)
        raise
    finally:
        if is_enabled:
            _access(request, record, status)


def refusal_logger(is_enabled: bool):
    """For HTTPServer(on_refusal=...): the access line of a request the HTTP layer answered itself (401, 404,
    405, 503 while draining), or None when access lines are off."""
    if not is_enabled:
        return None

    def refused(request: Request, status: int) -> None:
        _access(request, AccessRecord(time.monotonic()), status)

    return refused


def _client(request: Request) -> str:
    client = request.client
    if isinstance(client, tuple) and len(client) >= 2:
        return f"{client[0]}:{client[1]}"
    return str(client) if client else "-"


def log_error(request: Request, record: AccessRecord, error: APIError) -> None:
    """The error line of `error`: a 4xx at debug, a 5xx at error. Public for a stream that turns an engine
    failure into its own terminal event (Responses' response.failed) instead of raising it through _watch."""
    level = logging.DEBUG if error.status < 500 else logging.ERROR
    if error_log.isEnabledFor(level):
        error_log.log(level, "%s %s -> %d %s (rid=%s): %s", request.method, request.path, error.status,
                      error.code or error.type, record.rid or "-", error.message)


def _access(request: Request, record: AccessRecord, status: int) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    total_ms = (time.monotonic() - record.start) * 1000
    parts = [f'{_client(request)} "{request.method} {request.path}" {status}']
    if record.stream_error is not None:
        parts.append(f"stream_error={record.stream_error.status}")
    tally = record.tally
    if tally is not None:
        parts.append(f"prompt_tokens={tally.num_prompt_tokens} output_tokens={tally.completion_tokens}")
    if record.first_token_s is not None:
        parts.append(f"ttft_ms={record.first_token_s * 1000:.1f}")
    parts.append(f"total_ms={total_ms:.1f}")
    if record.finish_reasons:
        parts.append("finish=" + ",".join(dict.fromkeys(record.finish_reasons)))
    elif tally is not None:
        parts.append("finish=abort")  # the stream ended (client gone, engine error) before a final output
    if record.rid is not None:
        parts.append(f"rid={record.rid}")
    log.info("%s", " ".join(parts))
