"""The frontend's end of the core: start the core loop (thread or spawned process), send it message batches, pump
its replies onto the event loop, and shut it down.

Knows the transport (engine/ipc.py) and the worker, not requests: what the messages mean is AsyncLLM's.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from rawserve.engine.cpu_budget import export_environment, restore_environment
from rawserve.engine.launch import run_core_loop, spawn_context
from rawserve.engine.ipc import TRANSPORTS, make_channel
from rawserve.engine.messages import Message, MsgKind

log = logging.getLogger("rawserve.engine.frontend.core_client")

_PUMP_POLL_S = 0.1  # a thread core has no sentinel: the pump checks it is alive this often
_JOIN_POLL_S = 0.01
_JOIN_TIMEOUT_S = 5.0


class CoreClient:
    """One core loop and the two channels to it. Its callbacks run on the event loop that called start()."""

    def __init__(self, factory: Callable[[], Any], *, mode: str = "thread", transport: str = "pipe") -> None:
        if mode not in ("thread", "process"):
            raise ValueError(f"mode: must be thread|process, got {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {'|'.join(TRANSPORTS)}, got {transport!r}")
        self.factory = factory
        self.mode = mode
        self.transport = transport
        self._context = spawn_context() if mode == "process" else None
        self._in_tx = self._out_rx = None  # made by start()
        self.worker: threading.Thread | multiprocessing.process.BaseProcess | None = None
        self._pump_thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_stopping = False  # shutdown sent: the core's exit is expected, not a death

    def start(self, loop: asyncio.AbstractEventLoop, on_messages: Callable[[list[Message]], None],
              on_exit: Callable[[str], None]) -> None:
        """Start the core and the pump. `on_messages(batch)` gets each batch the core sends; `on_exit(reason)`
        its unexpected exit. Raises what starting the worker raised (e.g. an unpicklable factory)."""
        self._loop = loop
        # The frontend's sends go through a writer thread: the event loop never waits on a full pipe.
        self._in_tx, in_rx = make_channel(self.transport, self._context, threaded_sender=True)
        out_tx, self._out_rx = make_channel(self.transport, self._context)
        args = (self.factory, in_rx, out_tx)
        threads = getattr(self.factory, "threads", None)  # launch.CoreFactory's ThreadPlan; a test's fake has none
        env = dict(threads.env) if threads is not None else {}
        if self._context is None:
            self.worker = threading.Thread(target=run_core_loop, args=args, name="rawserve-core", daemon=True)
            # The core shares this process: OpenMP reads its variables once, when torch loads its runtime. Before
            # that (the server imports no torch) they are set here for good; after it, only the thread count can
            # still change (torch.set_num_threads in make_engine_core), and the wait policy stays as loaded.
            if env and "torch" not in sys.modules:
                export_environment(env)
            self.worker.start()
        else:
            self.worker = self._context.Process(target=run_core_loop, args=args, name="rawserve-core", daemon=True)
            # The spawned interpreter inherits this environment at exec, before it imports torch; this
            # process's own is put back once it has started.
            previous = export_environment(env)
            try:
                self.worker.start()
            finally:
                restore_environment(previous)
        if self._context is not None:
            in_rx.detach()  # the child's ends: closing ours lets its exit read as end-of-file
            out_tx.detach()
        # A daemon thread, not an executor task: a thread blocked on the transport must never keep
        # the interpreter alive at exit (asyncio.run joins its executor's threads).
        self._pump_thread = threading.Thread(target=self._pump, args=(on_messages, on_exit), name="rawserve-pump",
                                             daemon=True)
        self._pump_thread.start()

    def send(self, msgs: list[Message]) -> None:
        """Hand a batch to the core. Raises OSError or ValueError when the core is unreachable."""
        self._in_tx.send(msgs)

    async def shutdown(self) -> None:
        """Ask the core to exit, then join it (terminating a process that will not), the pump, and the channels."""
        self._is_stopping = True
        try:
            self._in_tx.send([(MsgKind.SHUTDOWN, None)])
        except (OSError, ValueError):  # the core is already gone
            pass
        self._in_tx.close()
        worker = self.worker
        if worker is not None:
            await _join(worker)
            if isinstance(worker, multiprocessing.process.BaseProcess):
                if worker.is_alive():
                    log.warning("engine core did not exit; terminating it")
                    worker.terminate()
                    await _join(worker)
                if worker.is_alive():
                    worker.kill()
                    await _join(worker)
        if self._pump_thread is not None:
            await _join(self._pump_thread)
        self._out_rx.close()

    # ----- the pump (its own daemon thread)

    def _pump(self, on_messages: Callable[[list[Message]], None], on_exit: Callable[[str], None]) -> None:
        """Move core messages onto the event loop; report the core's exit."""
        worker = self.worker
        sentinel = getattr(worker, "sentinel", None)  # a process: wait() wakes the moment it dies
        # With a sentinel the pump sleeps until the core speaks or dies: an idle server wakes it for nothing.
        poll_s = _PUMP_POLL_S if sentinel is None else None
        while True:
            try:
                msgs = self._out_rx.recv(poll_s, watch=sentinel)
            except (EOFError, OSError):
                break
            if msgs and not self._post(on_messages, msgs):
                return
            if not worker.is_alive():
                try:  # its last words (a fatal message) may still be in the transport
                    while msgs := self._out_rx.recv(0):
                        if not self._post(on_messages, msgs):
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
        self._post(self._on_exit, on_exit, reason)

    def _post(self, callback: Callable, *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to serve
            return False
        return True

    def _on_exit(self, on_exit: Callable[[str], None], reason: str) -> None:
        if not self._is_stopping:  # checked on the loop, where shutdown() sets it
            on_exit(reason)


async def _join(worker: Any) -> None:
    # Polls rather than asyncio.to_thread(join): no executor thread may block at interpreter exit.
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    while worker.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(_JOIN_POLL_S)
