"""One request's frontend state and its stream: TextOutput deltas, coalesced while the consumer is slow.

Touched only on the event loop thread. AsyncLLM feeds the state; the stream hands it back through a release
callback, and knows nothing else of AsyncLLM.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from rawserve.engine.frontend.output_processor import OutputProcessor, TextOutput


class RequestState:
    """Frontend state of one request. Touched only on the event loop thread."""

    __slots__ = ("rid", "processor", "arrival", "first_token_at", "last_token_at", "timer", "pending",
                 "_texts", "error", "waiter", "is_finished", "is_closed", "max_tokens", "scheduled_at",
                 "num_prompt_tokens", "num_output_tokens")

    def __init__(self, rid: str, processor: OutputProcessor, arrival: float, max_tokens: int | None = None) -> None:
        self.rid = rid
        self.processor = processor
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.last_token_at = arrival
        # per-request metrics (vLLM's): the max_tokens asked, when the core first scheduled it, token counts
        self.max_tokens = max_tokens
        self.scheduled_at: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.timer: asyncio.TimerHandle | None = None
        self.pending: TextOutput | None = None  # the one unread output, coalesced
        self._texts: list[str] = []  # its text parts, joined once when read (no quadratic +=)
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.is_finished = False  # no more outputs will be accepted from the core
        self.is_closed = False  # the consumer is done with the stream

    def deliver(self, item: TextOutput) -> None:
        pending = self.pending
        if pending is None:
            self.pending = item
            self._texts = [item.text]
        else:  # the consumer is behind: coalesce instead of queueing
            self._texts.append(item.text)
            pending.new_token_ids.extend(item.new_token_ids)
            if item.logprobs is not None:
                pending.logprobs = (pending.logprobs or []) + item.logprobs
            if pending.prompt_logprobs is None:
                pending.prompt_logprobs = item.prompt_logprobs
            pending.finished, pending.finish_reason, pending.stop_reason = \
                item.finished, item.finish_reason, item.stop_reason
            pending.num_prompt_tokens, pending.num_output_tokens, pending.num_cached_tokens = \
                item.num_prompt_tokens, item.num_output_tokens, item.num_cached_tokens
        self._wake()

    def take(self) -> TextOutput:
        item, self.pending = self.pending, None
        item.text = "".join(self._texts) if len(self._texts) > 1 else item.text
        self._texts = []
        return item

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class RequestStream:
    """One request's TextOutputs, an async iterator returned by AsyncLLM.generate().

    Ending early (break, aclose(), cancellation of the consumer, or dropping the stream) aborts the
    request in the core: every way out calls `release(state)` once the consumer is done with it.
    After the final output, or an error, iteration stops.
    """

    __slots__ = ("_state", "_release", "_loop")

    def __init__(self, state: RequestState, release: Callable[[RequestState], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        self._state = state
        self._release = release
        self._loop = loop  # the state's loop: a stream dropped on another thread releases it there

    @property
    def request_id(self) -> str:
        return self._state.rid

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TextOutput:
        state = self._state
        if state.is_closed:
            raise StopAsyncIteration
        while state.pending is None and state.error is None:
            state.waiter = self._loop.create_future()
            try:
                await state.waiter
            except BaseException:  # cancelled: the consumer is gone, so the core must stop too
                state.waiter = None
                self._release(state)
                raise
            state.waiter = None
        if state.error is not None:
            self._release(state)
            raise state.error
        item = state.take()
        if item.finished:
            self._release(state)
        return item

    async def aclose(self) -> None:
        self._release(self._state)

    def __del__(self) -> None:
        if not self._state.is_closed:  # dropped unread (e.g. `break` out of async for): abort it
            try:
                self._loop.call_soon_threadsafe(self._release, self._state)
            except RuntimeError:  # the loop is closed; the core goes down with the process
                pass
