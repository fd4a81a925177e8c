"""The engine frontend: starts the core loop (thread or spawned process), pumps its messages onto the
event loop, and turns each request's token ids into text deltas (detokenizer, stop strings, latency).

It reaches the core only through a picklable factory and engine/ipc.py; it never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from rawserve.engine.core_loop import run_core
from rawserve.engine.ipc import TRANSPORTS, Message, make_channel
from rawserve.engine.request_stream import RequestState, RequestStream, TextOutput
from rawserve.engine.types import AddRequest, EngineStats, RequestOutput, SamplingParams
from rawserve.errors import EngineDead, Overloaded
from rawserve.metrics import FINISH_REASONS, Metrics
from rawserve.text.detokenizer import IncrementalDetokenizer
from rawserve.text.stop import StopChecker

__all__ = ["AsyncLLM", "RequestStream", "TextOutput"]

log = logging.getLogger("rawserve.engine.async_llm")

_PUMP_POLL_S = 0.1  # a thread core has no sentinel: the pump checks it is alive this often
_JOIN_POLL_S = 0.01
_JOIN_TIMEOUT_S = 5.0


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
        if mode not in ("thread", "process"):
            raise ValueError(f"mode: must be thread|process, got {mode!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {start_timeout_s}")
        self.factory = factory
        self.tokenizer = tokenizer
        self.mode = mode
        self.transport = transport
        self.max_pending = max_pending
        self.request_timeout_s = request_timeout_s
        self.start_timeout_s = start_timeout_s
        self.metrics = metrics if metrics is not None else Metrics(model_name)
        self.model_name = model_name
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {'|'.join(TRANSPORTS)}, got {transport!r}")
        self._context = multiprocessing.get_context("spawn") if mode == "process" else None
        self._in_tx = self._in_rx = self._out_tx = self._out_rx = None  # made by start()
        self._worker: threading.Thread | multiprocessing.process.BaseProcess | None = None
        self._pump_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._states: dict[str, RequestState] = {}
        self._info: dict | None = None
        self._core_stats = EngineStats()
        self._dead_reason: str | None = None
        self._is_closing = False
        self._is_stopping = False  # shutdown sent: the core's exit is expected, not a death
        self._is_stopped = False

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

    def render_metrics(self) -> str:
        stats = self._core_stats
        return self.metrics.render({
            "num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": stats.kv_cache_usage, "requests_in_flight": len(self._states)})

    # ----- lifecycle

    async def start(self) -> None:
        """Start the core and the pump; return once the model is loaded. A core that fails to start
        (bad checkpoint, unpicklable factory, a crash while loading) raises EngineDead here, never hangs."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLM.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        # The frontend's sends go through a writer thread: the event loop never waits on a full pipe.
        self._in_tx, self._in_rx = make_channel(self.transport, self._context, threaded_sender=True)
        self._out_tx, self._out_rx = make_channel(self.transport, self._context)
        args = (self.factory, self._in_rx, self._out_tx)
        if self._context is None:
            self._worker = threading.Thread(target=run_core, args=args, name="rawserve-core", daemon=True)
        else:
            self._worker = self._context.Process(target=run_core, args=args, name="rawserve-core", daemon=True)
        try:
            self._worker.start()
        except Exception as error:  # e.g. an unpicklable factory: the caller's start() sees why
            self._dead_reason = f"engine core failed to start: {error!r}"
            raise EngineDead(self._dead_reason) from error
        if self._context is not None:
            self._in_rx.detach()  # the child's ends: closing ours lets its exit read as end-of-file
            self._out_tx.detach()
        # A daemon thread, not an executor task: a thread blocked on the transport must never keep
        # the interpreter alive at exit (asyncio.run joins its executor's threads).
        self._pump_thread = threading.Thread(target=self._pump, name="rawserve-pump", daemon=True)
        self._pump_thread.start()
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.start_timeout_s)
        except TimeoutError:
            self._dead_reason = f"engine core was not ready within start_timeout_s={self.start_timeout_s}"
        except EngineDead:
            pass
        if self._dead_reason is not None:
            await self._shutdown_worker()
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
                self._send([("abort", state.rid)])
            self._fail(state, EngineDead("the server shut down before this request finished"))
        await self._shutdown_worker()

    async def _shutdown_worker(self) -> None:
        self._is_stopping = True
        self._is_stopped = True
        self._send([("shutdown", None)])
        self._in_tx.close()
        worker = self._worker
        if worker is not None:
            await self._join(worker)
            if isinstance(worker, multiprocessing.process.BaseProcess):
                if worker.is_alive():
                    log.warning("engine core did not exit; terminating it")
                    worker.terminate()
                    await self._join(worker)
                if worker.is_alive():
                    worker.kill()
                    await self._join(worker)
        if self._pump_thread is not None:
            await self._join(self._pump_thread)
        self._out_rx.close()

    @staticmethod
    async def _join(worker: Any) -> None:
        # Polls rather than asyncio.to_thread(join): no executor thread may block at interpreter exit.
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        while worker.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(_JOIN_POLL_S)

    # ----- requests

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, *, cache_salt: str | None = None, lora: str | None = None,
                 features: object | None = None) -> RequestStream:
        """Submit one request and return its stream of TextOutputs (an async iterator).

        Admission happens here, synchronously, so a refusal comes before any response header:
        EngineDead (engine failed), Overloaded (draining, or max_pending in flight), ValueError (n != 1,
        a duplicate id, bad stop strings). Leaving the stream early, aclose(), or cancelling the
        consumer aborts the request in the core. A request the core rejects raises ValueError from
        the stream; one past request_timeout_s raises TimeoutError.
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
        if len(self._states) >= self.max_pending:
            raise Overloaded(f"{len(self._states)} requests are in flight (max_pending={self.max_pending})")
        if params.n != 1:
            raise ValueError(f"n: generate() runs one sample, got n={params.n}; submit params.child(j) per sample")
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if rid in self._states:
            raise ValueError(f"request_id: {rid!r} is already in flight")
        state = RequestState(rid, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                             StopChecker(params.stop, params.include_stop_str_in_output), time.monotonic())
        # Sent before registering: if the core is unreachable, nothing is left behind. Its outputs
        # reach this loop only after generate() returns, so none can miss the state.
        self._send([("add", AddRequest(rid, list(prompt_ids), params, priority, lora, features, cache_salt))])
        state.timer = loop.call_later(self.request_timeout_s, self._on_timeout, state)
        self._states[rid] = state
        return RequestStream(self, state)

    def abort(self, request_id: str) -> None:
        """Stop a request: the core frees it, and its stream ends with finish_reason "abort"."""
        state = self._states.get(request_id)
        if state is None or state.is_finished:
            return
        self._send([("abort", request_id)])
        state.deliver(TextOutput(request_id, "", [], True, "abort", None,
                                 num_prompt_tokens=state.num_prompt_tokens,
                                 num_output_tokens=state.num_output_tokens,
                                 num_cached_tokens=state.num_cached_tokens))
        self._finish(state, "abort")

    def _send(self, msgs: list[Message]) -> None:
        try:
            self._in_tx.send(msgs)
        except (OSError, ValueError) as error:  # the core is gone; the pump reports how it died
            if msgs and msgs[0][0] == "add":
                raise EngineDead(self._dead_reason or f"engine core is unreachable: {error!r}") from error

    def _release(self, state: RequestState) -> None:
        """The consumer is done with a stream (read the end, failed, closed, cancelled or dropped it)."""
        if state.is_closed:
            return
        state.is_closed = True
        if not state.is_finished:  # it left early: free the core's blocks at its next step
            self._send([("abort", state.rid)])
            self._finish(state, "abort")
        if self._states.get(state.rid) is state:
            del self._states[state.rid]
        if not self._states and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _finish(self, state: RequestState, reason: str | None) -> None:
        state.is_finished = True
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if reason in FINISH_REASONS:
            self.metrics.inc("request_success_total", label_value=reason)
        self.metrics.observe("e2e_request_latency_seconds", time.monotonic() - state.arrival)

    def _fail(self, state: RequestState, error: BaseException) -> None:
        if state.is_finished and state.pending is not None and state.pending.finished:
            return  # it completed; let the consumer read the end
        state.is_finished = True
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        state.fail(error)

    def _on_timeout(self, state: RequestState) -> None:
        state.timer = None
        if state.is_finished:
            return
        self._send([("abort", state.rid)])
        self._finish(state, "abort")
        state.fail(TimeoutError(f"request {state.rid} exceeded request_timeout_s={self.request_timeout_s}"))

    # ----- messages from the core (event loop thread)

    def _pump(self) -> None:
        """Move core messages onto the event loop; report the core's exit. Runs in a daemon thread."""
        worker = self._worker
        sentinel = getattr(worker, "sentinel", None)  # a process: wait() wakes the moment it dies
        while True:
            try:
                msgs = self._out_rx.recv(_PUMP_POLL_S, watch=sentinel)
            except (EOFError, OSError):
                break
            if msgs and not self._post(self._handle_messages, msgs):
                return
            if not worker.is_alive():
                try:  # its last words (a fatal message) may still be in the transport
                    while msgs := self._out_rx.recv(0):
                        if not self._post(self._handle_messages, msgs):
                            return
                except (EOFError, OSError):
                    pass
                break
        exitcode = getattr(worker, "exitcode", None)
        if exitcode is None and isinstance(worker, multiprocessing.process.BaseProcess):
            worker.join(1.0)  # EOF can come a moment before the child is reaped
            exitcode = worker.exitcode
        reason = "engine core thread exited" if exitcode is None else \
            f"engine core process exited with code {exitcode}"
        self._post(self._on_core_exit, reason)

    def _post(self, callback: Callable, *args: Any) -> bool:
        loop = self._loop
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to serve
            return False
        return True

    def _handle_messages(self, msgs: list[Message]) -> None:
        for kind, payload in msgs:
            if kind == "outputs":
                self._on_outputs(payload)
            elif kind == "stats":
                self._on_stats(payload)
            elif kind == "queued":
                for _rid, queue_time_s in payload:
                    self.metrics.observe("request_queue_time_seconds", queue_time_s)
            elif kind == "error":
                rid, message = payload
                state = self._states.get(rid)
                if state is not None and not state.is_finished:
                    self._fail(state, ValueError(message))
            elif kind == "ready":
                self._info = payload
                if not self._ready.done():
                    self._ready.set_result(payload)
            elif kind == "fatal":
                self._die(payload)
            else:
                log.error("frontend ignores unknown core message %r", kind)

    def _on_stats(self, stats: EngineStats) -> None:
        self._core_stats = stats
        self.metrics.set_total("prefix_cache_queries_total", stats.prefix_cache_queries)
        self.metrics.set_total("prefix_cache_hits_total", stats.prefix_cache_hits)
        self.metrics.set_total("num_preemptions_total", stats.num_preemptions)

    def _on_core_exit(self, reason: str) -> None:
        if not self._is_stopping:
            self._die(reason)

    def _die(self, reason: str) -> None:
        """The core failed or exited: fail every request now, and every new one (EngineDead)."""
        if self._dead_reason is None:
            self._dead_reason = reason
            log.error("engine is dead: %s", reason)
        if not self._ready.done():
            self._ready.set_exception(EngineDead(self._dead_reason))
            self._ready.exception()  # retrieved: start() reports it from _dead_reason
        for state in list(self._states.values()):
            self._fail(state, EngineDead(self._dead_reason))

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
            num_new = len(out.new_token_ids)
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
                self._process_output(state, out)
            except Exception as error:  # noqa: BLE001 - a frontend bug fails this request alone; its consumer sees it
                log.exception("processing output of %s failed", out.request_id)
                self._send([("abort", out.request_id)])
                self._fail(state, error)
        # Recorded per step, not per output: one lock round per metric keeps the hand-off cheap.
        metrics = self.metrics
        if ttft:
            metrics.observe_many("time_to_first_token_seconds", ttft)
            metrics.inc("prompt_tokens_total", num_prompt)
        if itl:
            metrics.observe_many("inter_token_latency_seconds", itl)
        if num_generated:
            metrics.inc("generation_tokens_total", num_generated)

    def _process_output(self, state: RequestState, out: RequestOutput) -> None:
        """Token ids -> visible text for one request: detokenize, check stop strings, deliver."""
        state.num_prompt_tokens = out.num_prompt_tokens
        state.num_output_tokens = out.num_output_tokens
        state.num_cached_tokens = out.num_cached_tokens
        text = state.detok.add(out.new_token_ids)
        if out.finished:
            text += state.detok.flush()
        visible = state.stop.add(text)
        finished, reason, stop_reason = out.finished, out.finish_reason, out.stop_reason
        if state.stop.stopped is not None:
            if not out.finished:
                self._send([("abort", out.request_id)])  # the core knows no stop strings
            finished, reason, stop_reason = True, "stop", state.stop.stopped
        elif finished:
            visible += state.stop.finish()
        logprobs = list(out.logprobs) if out.logprobs is not None else None  # thread mode shares the core's list
        state.deliver(TextOutput(out.request_id, visible, list(out.new_token_ids), finished, reason, stop_reason,
                                 logprobs, out.prompt_logprobs, out.num_prompt_tokens, out.num_output_tokens,
                                 out.num_cached_tokens))
        if finished:
            self._finish(state, reason)
