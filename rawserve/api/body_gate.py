"""A cap on concurrent large-body work: parsing, rendering and tokenizing a request body of megabytes costs
several times its size in memory, so only a few such requests do it at once; the rest wait their turn holding
only their bytes. Memory is handed back to the system when the last of them is done.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rawserve.http import Request
from rawserve.process_stats import release_free_heap

log = logging.getLogger("rawserve.api")

LARGE_BODY_BYTES = 1 << 20  # bodies from here on take a slot
LARGE_BODY_SLOTS = 2

_held: contextvars.ContextVar[list | None] = contextvars.ContextVar("rawserve_large_body", default=None)


class BodyGate:
    """At most `slots` requests with a body of `threshold` bytes or more run their handler's preparation at
    once. A handler gives its slot back as soon as its prompt is admitted (`release_early`), or when it ends."""

    def __init__(self, threshold: int = LARGE_BODY_BYTES, slots: int = LARGE_BODY_SLOTS) -> None:
        self.threshold = threshold
        self._slots = asyncio.Semaphore(slots)
        self._num_active = 0

    def wrap(self, handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
        @functools.wraps(handler)
        async def gated(request: Request) -> Any:
            if len(request.body) < self.threshold:
                return await handler(request)
            await self._slots.acquire()
            self._num_active += 1
            held = [self]
            token = _held.set(held)
            try:
                return await handler(request)
            finally:
                _held.reset(token)
                if held[0] is not None:
                    self._release(held)
        return gated

    def _release(self, held: list) -> None:
        held[0] = None
        self._num_active -= 1
        self._slots.release()
        if self._num_active == 0:
            release_free_heap()  # the peak is over: a few ms, once per burst of large bodies


def release_early() -> None:
    """The current request's large-body work is done (its prompt is admitted): free its slot now rather than
    when its response ends."""
    held = _held.get()
    if held is not None and held[0] is not None:
        held[0]._release(held)
