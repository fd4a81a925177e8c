"""The engine frontend on the event loop: admission, one stream per request, output processing and latency metrics.

It reaches the core through CoreClient (core_client.py) and a picklable factory, never blocks the event loop,
and hands each core output to the request's OutputProcessor, acting on what it decides.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from rawserve.engine.frontend.core_client import CoreClient
from rawserve.engine.frontend.output_processor import OutputProcessor, TextOutput
from rawserve.engine.frontend.request_stream import RequestState, RequestStream
from rawserve.engine.launch import kv_capacity
from rawserve.engine.messages import HEARTBEAT_INTERVAL_S, Message, MsgKind
from rawserve.engine.rules import check_one_sample
from rawserve.engine.types import AddRequest, EngineStats, RequestFailed, RequestOutput, SamplingParams
from rawserve.errors import EngineDead, Overloaded
from rawserve.metrics import FINISH_REASONS, Metrics
from rawserve.process_stats import HeapRelease, render_process_metrics

__all__ = ["AsyncLLM", "RequestStream", "TextOutput"]

log = logging.getLogger("rawserve.engine.frontend.async_llm")
# /metrics counters -> the keys the core's multimodal manager reports them under in EngineStats.extra.
MM_STAT_COUNTERS = (("mm_encoder_seconds_total", "mm_encoder_seconds"),
                    ("mm_encoder_cache_hits_total", "mm_encoder_cache_hits"),
                    ("mm_encoder_cache_misses_total", "mm_encoder_cache_misses"))


class LoraOpError(ValueError):
    """The core refused or failed a LoRA load/unload. `code` is LORA_DONE's (engine/messages.py): "bad" means the
    message names paths and file contents, for the server's log only."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class AsyncLLM:
    """Serve one engine core to many concurrent generate() streams.

    Backpressure: a request buffers at most one pending TextOutput; while its consumer is slow, new
    deltas are coalesced into it (text and token ids appended), as vLLM's output collector does.
    Coalescing rather than a bounded queue that fails the request: a client that stalls briefly (a TCP
    hiccup) loses nothing and catches up in one larger chunk, and memory stays bounded anyway, because
    a request's pending output can never exceed its own output (max_tokens <= max_model_len tokens),
    the request timeout ends it, and max_pending caps how many requests exist.

    Metrics: `render_metrics()` is the /metrics page (core gauges, counters and frontend latencies).
    """

    def __init__(self, factory: Callable[[], Any], tokenizer: Any, *, mode: str = "thread",
                 transport: str = "pipe", max_pending: int = 1024, request_timeout_s: float = 600.0,
                 metrics: Metrics | None = None, model_name: str = "rawserve",
                 start_timeout_s: float = 600.0) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {start_timeout_s}")
        self.tokenizer = tokenizer
        self._client = CoreClient(factory, mode=mode, transport=transport)
        self.max_pending = max_pending
        self.request_timeout_s = request_timeout_s
        self.start_timeout_s = start_timeout_s
        self.metrics = metrics if metrics is not None else Metrics(model_name)
        self.model_name = model_name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._states: dict[str, RequestState] = {}
        self._info: dict | None = None
        self._core_stats = EngineStats()
        self._dead_reason: str | None = None
        self._is_closing = False
        self._is_stopped = False
        self._lora_tokens = itertools.count()
        self._lora_waiters: dict[int, asyncio.Future] = {}
        self._last_heard = time.monotonic()  # when the core last sent anything (its heartbeat included)
        self._is_stalled = False  # for the log: said once when a stall is seen, once when it ends
        self._heap = HeapRelease()  # the server's side of a burst (streams, buffers) goes back once it is over

    # ----- public state

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def info(self) -> dict | None:
        """The core's ready payload: max_model_len, num_blocks, vocab_size, pid."""
        return self._info

    @property
    def core_stats(self) -> EngineStats:
        return self._core_stats

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def stall_reason(self, timeout_s: float) -> str | None:
        """Why the engine looks frozen, or None: requests are waiting and the core has sent nothing, not even
        its heartbeat (every HEARTBEAT_INTERVAL_S), for `timeout_s`. It clears when the core speaks again."""
        silent_s = time.monotonic() - self._last_heard
        waiting = 0
        if silent_s >= timeout_s and self._dead_reason is None:
            waiting = sum(1 for state in self._states.values() if not state.is_finished)
        if not waiting:
            if self._is_stalled:
                self._is_stalled = False
                log.warning("engine core is responding again")
            return None
        if not self._is_stalled:
            self._is_stalled = True
            log.error("engine core has sent nothing for %.1f s with %d request(s) waiting", silent_s, waiting)
        return (f"the engine core has sent nothing for {silent_s:.1f} s (its heartbeat comes every "
                f"{HEARTBEAT_INTERVAL_S:g} s) while {waiting} request(s) wait")

    def render_metrics(self) -> str:
        stats = self._core_stats
        info = self._info or {}
        capacity = kv_capacity(info)
        page = self.metrics.render({
            "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": stats.kv_cache_usage, "requests_in_flight": len(self._states),
            "kv_cache_bytes": capacity.get("bytes", 0), "kv_cache_capacity_tokens": capacity.get("tokens", 0),
            "engine_threads": stats.num_threads})
        lora = stats.extra.get("lora")
        if lora is not None:
            page += self.metrics.render_lora_info(lora["max_lora"], lora["running"], lora["waiting"], time.time())
        return page + render_process_metrics(self.metrics.prefix, self.metrics.model_name, info.get("pid"))

    async def lora_op(self, op: str, name: str, path: str | None = None) -> None:
        """Load ("load", name, path) or unload ("unload", name) an adapter in the core and wait for its answer.

        Raises LoraOpError (a ValueError: a bad adapter, a name in use, updates off, a timeout; its code says which)
        or KeyError (no such adapter), with the core's message.
        """
        if self.is_dead:
            raise EngineDead(self._dead_reason)
        token = next(self._lora_tokens)
        future = self._loop.create_future()
        self._lora_waiters[token] = future
        try:
            self._send([(MsgKind.LORA, (token, op, name, path))])
            error, code = await future
        finally:
            self._lora_waiters.pop(token, None)
        if error is not None:
            if code == "unknown":
                raise KeyError(error)
            raise LoraOpError(error, code or "bad")

    # ----- lifecycle

    async def start(self) -> None:
        """Start the core and the pump; return once the model is loaded. A core that fails to start
        (bad checkpoint, unpicklable factory, a crash while loading) raises EngineDead here, never hangs."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLM.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        try:
            self._client.start(self._loop, self._handle_messages, self._die)
        except Exception as error:  # e.g. an unpicklable factory: the caller's start() sees why
            self._dead_reason = f"engine core failed to start: {error!r}"
            raise EngineDead(self._dead_reason) from error
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout_s)
        except TimeoutError:
            self._dead_reason = f"engine core was not ready within start_timeout_s={self.start_timeout_s}"
        except EngineDead:
            pass
        if self._dead_reason is not None:
            await self._shutdown_core()
            raise EngineDead(self._dead_reason)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new work, let in-flight streams finish until the deadline, then abort the rest
        (they raise EngineDead), shut the core down and join it."""
        if self._is_stopped or self._loop is None:
            return
        self._is_closing = True
        if self._states and not self.is_dead:
            self._drained = self._loop.create_future()
            await asyncio.wait([self._drained], timeout=drain_timeout_s)
        for state in list(self._states.values()):
            if not state.is_finished:
                self._send([(MsgKind.ABORT, state.rid)])
            self._fail(state, EngineDead("the server shut down before this request finished"))
        await self._shutdown_core()

    async def _shutdown_core(self) -> None:
        self._is_stopped = True
        await self._client.shutdown()

    # ----- requests

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, *, cache_salt: str | None = None, lora: str | None = None,
                 features: object | None = None, timeout_s: float | None = None) -> RequestStream:
        """Submit one request and return its stream of TextOutputs (an async iterator).

        Admission happens here, synchronously, so a refusal comes before any response header:
        EngineDead (engine failed), Overloaded (draining, or max_pending in flight), ValueError (n != 1,
        a duplicate id, bad stop strings). Leaving the stream early, aclose(), or cancelling the
        consumer aborts the request in the core. A request the core rejects raises ValueError from
        the stream. At its deadline (`timeout_s`, at most request_timeout_s) the request is aborted in the core
        and its stream ends with what it generated so far and finish_reason "length".
        """
        loop = self._loop
        if loop is None or self._ready is None or not self._ready.done():
            raise RuntimeError("AsyncLLM.start() has not completed")
        if asyncio.get_running_loop() is not loop:
            raise RuntimeError("generate() must be called on the event loop that ran start()")
        if self._dead_reason is not None:
            raise EngineDead(self._dead_reason)
        if self._is_closing:
            raise Overloaded("the server is draining and takes no new requests")
        self.check_capacity(1)
        check_one_sample(params)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._states:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        state = RequestState(rid, OutputProcessor(rid, self.tokenizer, params), time.monotonic(), params.max_tokens)
        # Sent before registering: if the core is unreachable, nothing is left behind. Its outputs
        # reach this loop only after generate() returns, so none can miss the state.
        self._send([(MsgKind.ADD, AddRequest(rid, list(prompt_ids), params, priority, lora, features, cache_salt))])
        deadline_s = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        state.timer = loop.call_later(deadline_s, self._on_timeout, state)
        self._states[rid] = state
        self._heap.went_busy()
        return RequestStream(state, self._release, loop)

    def check_capacity(self, num_requests: int) -> None:
        """Raise Overloaded unless `num_requests` more fit under max_pending. The one owner of that rule:
        generate() checks each request, and a caller fanning out n samples checks them all first."""
        if len(self._states) + num_requests > self.max_pending:
            raise Overloaded(f"{len(self._states)} requests in flight; this one needs {num_requests} more "
                             f"(max_pending={self.max_pending})")

    def abort(self, request_id: str) -> None:
        """Stop a request: the core frees it, and its stream ends with finish_reason "abort"."""
        state = self._states.get(request_id)
        if state is None or state.is_finished:
            return
        self._send([(MsgKind.ABORT, request_id)])
        state.deliver(state.processor.aborted())
        self._finish(state, "abort")

    def _send(self, msgs: list[Message]) -> None:
        try:
            self._client.send(msgs)
        except (OSError, ValueError) as error:  # the core is gone; the pump reports how it died
            if msgs and msgs[0][0] == MsgKind.ADD:
                raise EngineDead(self._dead_reason or f"engine core is unreachable: {error!r}") from error

    def _release(self, state: RequestState) -> None:
        """The consumer is done with a stream (read the end, failed, closed, cancelled or dropped it)."""
        if state.is_closed:
            return
        state.is_closed = True
        if not state.is_finished:  # it left early: free the core's blocks at its next step
            self._send([(MsgKind.ABORT, state.rid)])
            self._finish(state, "abort")
        if self._states.get(state.rid) is state:
            del self._states[state.rid]
        if not self._states and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if not self._states and self._loop is not None:
            self._loop.call_later(self._heap.went_idle(time.monotonic()), self._release_heap)

    def _release_heap(self) -> None:
        if not self._states:  # still idle: a request that came and went since rescheduled it, and this is a no-op
            self._heap.run_if_due(time.monotonic())

    def _finish(self, state: RequestState, reason: str | None) -> None:
        state.is_finished = True
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        metrics = self.metrics
        if reason in FINISH_REASONS:
            metrics.inc("request_success_total", label_value=reason)
        metrics.observe("e2e_request_latency_seconds", time.monotonic() - state.arrival)
        metrics.observe("request_prompt_tokens", state.num_prompt_tokens)
        metrics.observe("request_generation_tokens", state.num_output_tokens)
        if state.max_tokens is not None:
            metrics.observe("request_params_max_tokens", state.max_tokens)
        if state.first_token_at is not None and state.scheduled_at is not None:
            # vLLM's phases: prefill from first scheduling to the first token, decode from there to the last
            metrics.observe("request_prefill_time_seconds", max(0.0, state.first_token_at - state.scheduled_at))
            metrics.observe("request_decode_time_seconds", state.last_token_at - state.first_token_at)
            metrics.observe("request_inference_time_seconds", max(0.0, state.last_token_at - state.scheduled_at))

    def _fail(self, state: RequestState, error: BaseException) -> None:
        if state.is_finished and state.pending is not None and state.pending.finished:
            return  # it completed; let the consumer read the end
        if not state.is_finished:  # counted once: a request that had already ended was counted then
            self.metrics.inc("request_success_total", label_value="error")
        state.is_finished = True
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        state.fail(error)

    def _on_timeout(self, state: RequestState) -> None:
        state.timer = None
        if state.is_finished:
            return
        # Not an error: a client told "length" keeps what it got, and retrying (as it would a 408) costs a whole
        # generation again.
        self._send([(MsgKind.ABORT, state.rid)])
        out = state.processor.cut()
        state.deliver(out)
        self._finish(state, out.finish_reason)

    # ----- messages from the core (event loop thread; CoreClient's pump posts them)

    def _handle_messages(self, msgs: list[Message]) -> None:
        self._last_heard = time.monotonic()
        for kind, payload in msgs:
            if kind == MsgKind.OUTPUTS:
                self._on_outputs(payload)
            elif kind == MsgKind.STATS:
                self._on_stats(payload)
            elif kind == MsgKind.QUEUED:
                for rid, queue_time_s in payload:
                    self.metrics.observe("request_queue_time_seconds", queue_time_s)
                    state = self._states.get(rid)
                    if state is not None:  # the core's queue time on this clock: arrival here + time queued there
                        state.scheduled_at = state.arrival + queue_time_s
            elif kind == MsgKind.ERROR:
                rid, message = payload
                state = self._states.get(rid)
                if state is not None and not state.is_finished:
                    self._fail(state, ValueError(message))
            elif kind == MsgKind.READY:
                self._info = payload
                if payload.get("max_model_len"):
                    self.metrics.set_engine_info(payload["max_model_len"], payload.get("block_size"),
                                                 payload.get("num_blocks"))
                if not self._ready.done():
                    self._ready.set_result(payload)
            elif kind == MsgKind.LORA_DONE:
                token, error, code = payload
                future = self._lora_waiters.get(token)
                if future is not None and not future.done():
                    future.set_result((error, code))
            elif kind == MsgKind.FATAL:
                self._die(payload)
            elif kind != MsgKind.HEARTBEAT:  # a heartbeat says only that the core lives: _last_heard, above
                log.error("frontend ignores unknown core message %r", kind)

    def _on_stats(self, stats: EngineStats) -> None:
        if self._dead_reason is not None:
            return  # its last words: the gauges of a dead core stay at zero
        self._core_stats = stats
        self.metrics.set_total("prefix_cache_queries_total", stats.prefix_cache_queries)
        self.metrics.set_total("prefix_cache_hits_total", stats.prefix_cache_hits)
        self.metrics.set_total("num_preemptions_total", stats.num_preemptions)
        for name, key in MM_STAT_COUNTERS:  # the vision tower's totals, from a core serving a vision model
            if key in stats.extra:
                self.metrics.set_total(name, stats.extra[key])
        spec = stats.extra.get("spec")
        if spec is not None:  # speculative decoding's counters, under vLLM's names
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                self.metrics.set_total(f"spec_decode_{name}_total", spec[name])
            for position, count in enumerate(spec["accepted_per_pos"]):
                self.metrics.set_total("spec_decode_num_accepted_tokens_per_pos_total", count, str(position))

    def _die(self, reason: str) -> None:
        """The core failed or exited: fail every request now, and every new one (EngineDead)."""
        if self._dead_reason is None:
            self._dead_reason = reason
            log.error("engine is dead: %s", reason)
            # Nothing runs, waits or holds KV any more; the counters keep their totals.
            self._core_stats = dataclasses.replace(self._core_stats, num_running=0, num_waiting=0,
                                                   kv_cache_usage=0.0, num_free_blocks=self._core_stats.num_blocks,
                                                   extra={})
        if not self._ready.done():
            self._ready.set_exception(EngineDead(self._dead_reason))
            self._ready.exception()  # retrieved: start() reports it from _dead_reason
        for state in list(self._states.values()):
            self._fail(state, EngineDead(self._dead_reason))
        for future in self._lora_waiters.values():
            if not future.done():
                future.set_exception(EngineDead(self._dead_reason))

    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        """One step's outputs: time them where the client would, then turn ids into text per request."""
        now = time.monotonic()
        states = self._states
        ttft: list[float] = []
        itl: list[float] = []
        num_prompt = num_generated = 0
        for out in outs:
            state = states.get(out.request_id)
            if state is None or state.is_finished:
                continue  # aborted, timed out, or already ended by a stop string
            if out.error is not None:  # the core failed this request alone (its sampling or grammar): a 500
                self._fail(state, RequestFailed(out.error))
                continue
            num_new = len(out.new_token_ids)
            state.num_prompt_tokens = out.num_prompt_tokens
            state.num_output_tokens += num_new
            if num_new:
                if state.first_token_at is None:
                    state.first_token_at = now
                    ttft.append(now - state.arrival)
                    num_prompt += out.num_prompt_tokens
                else:
                    itl.append((now - state.last_token_at) / num_new)
                state.last_token_at = now
                num_generated += num_new
            try:
                text_out, abort = state.processor.process(out)
            except Exception as error:  # noqa: BLE001 - a frontend bug fails this request alone; its consumer sees it
                log.exception("processing output of %s failed", out.request_id)
                self._send([(MsgKind.ABORT, out.request_id)])
                self._fail(state, error)
                continue
            dropped = num_new - len(text_out.new_token_ids)
            if dropped > 0:  # a stop string inside a speculative run: the tokens after it are not output
                state.num_output_tokens -= dropped
                num_generated -= dropped
            if abort:
                self._send([(MsgKind.ABORT, out.request_id)])
            state.deliver(text_out)
            if text_out.finished:
                self._finish(state, text_out.finish_reason)
        # Recorded per step, not per output: one lock round per metric keeps the hand-off cheap.
        metrics = self.metrics
        if ttft:
            metrics.observe_many("time_to_first_token_seconds", ttft)
            metrics.inc("prompt_tokens_total", num_prompt)
        if itl:
            metrics.observe_many("inter_token_latency_seconds", itl)
        if num_generated:
            metrics.inc("generation_tokens_total", num_generated)
        if num_prompt + num_generated:  # vLLM's iteration tokens: prompts that finished prefill plus new tokens
            metrics.observe("iteration_tokens_total", num_prompt + num_generated)
