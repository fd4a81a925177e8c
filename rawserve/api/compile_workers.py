"""A few spawned processes that run one pure-Python function each at a time, with a deadline: a call past it
has its process killed (it stops using CPU) and replaced. The grammar compiler's pool; it knows nothing of grammars.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

START_TIMEOUT_S = 60.0  # a fresh process imports the compiler (and tokenizers) before its first call


class CallTimedOut(Exception):
    """The call ran past its deadline; its process was killed."""


class WorkerDied(Exception):
    """The process exited in the middle of a call (killed, out of memory) or never started."""


class WorkersBusy(Exception):
    """No process came free within the wait allowed: every one is running a call."""


def _serve(conn: Connection, fn: Callable) -> None:
    """The child's loop: arguments in, ("ok", result) or ("error", exception) out, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent ends this one
    try:
        conn.send(("ready", None))
        while True:
            try:
                args = conn.recv()
            except EOFError:
                return
            try:
                reply = ("ok", fn(*args))
            except Exception as error:  # noqa: BLE001 - sent to the parent, which answers the request with it
                reply = ("error", error)
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as error:  # unpicklable: say what it was
                conn.send(("error", RuntimeError(f"{type(error).__name__}: {error}")))
    except (BrokenPipeError, ConnectionResetError):  # the parent closed the pipe (shutdown, or it gave up on us)
        return


class _Worker:
    """One process and its pipe. Used by one call at a time (the pool hands it out); `kill` may come from any
    thread."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.is_ready = False

    def start(self) -> None:
        with self.lock:
            ctx = multiprocessing.get_context("spawn")  # fork would copy the server, threads and all
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, self.fn), name="rawserve-compile", daemon=True)
            process.start()
            child.close()
            self.process, self.conn, self.is_ready = process, parent, False

    def kill(self) -> None:
        with self.lock:
            process, conn = self.process, self.conn
            self.process = self.conn = None
        if process is not None:
            process.kill()
            process.join(5)
        if conn is not None:
            conn.close()

    def stop(self) -> None:
        """End an idle process: closing its pipe ends its loop; killed if it lingers."""
        with self.lock:
            process, conn = self.process, self.conn
            self.process = self.conn = None
        if conn is not None:
            conn.close()
        if process is not None:
            process.join(2)
            if process.is_alive():
                process.kill()
                process.join(5)

    def call(self, args: tuple, timeout_s: float):
        """Run fn(*args) in the process (started first if need be; its start-up is not part of the deadline)."""
        if self.process is None or not self.process.is_alive():
            self.kill()
            self.start()
        conn = self.conn
        assert conn is not None
        try:
            if not self.is_ready:
                if not conn.poll(START_TIMEOUT_S):
                    raise WorkerDied(f"the worker did not start within {START_TIMEOUT_S:g} s")
                conn.recv()
                self.is_ready = True
            conn.send(args)
            if not conn.poll(timeout_s):
                self.kill()
                self.start()  # replaced now, so the next call does not wait for a start
                raise CallTimedOut(f"the call ran past its {timeout_s:g} s deadline")
            status, value = conn.recv()
        except (EOFError, OSError, ValueError) as error:  # the process died, or close() killed it
            self.kill()
            raise WorkerDied(f"the worker exited ({type(error).__name__})") from None
        if status == "error":
            raise value
        return value


class CompileWorkers:
    """`num_workers` processes running `fn`, each call limited to `timeout_s`. A call waits at most
    `queue_timeout_s` for a free process (WorkersBusy past it), so a slow call holds up only its own process
    and, at worst, others for one deadline. Processes start at their first call."""

    def __init__(self, fn: Callable, num_workers: int = 2, timeout_s: float = 5.0,
                 queue_timeout_s: float | None = None) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError("num_workers must be >= 1 and timeout_s > 0")
        self.fn = fn
        self.timeout_s = timeout_s
        self.queue_timeout_s = timeout_s if queue_timeout_s is None else queue_timeout_s
        self._workers = [_Worker(fn) for _ in range(num_workers)]
        self._idle = list(self._workers)  # the last one used is taken first: one process serves a light load
        self._free: asyncio.Semaphore | None = None
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="rawserve-compile")

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        return [w.process for w in self._workers if w.process is not None]

    async def run(self, *args):
        """fn(*args) in a worker process: its result, or the exception it raised; CallTimedOut, WorkerDied or
        WorkersBusy otherwise. Cancelling the caller does not free the process early: it is handed back when
        the call ends (by its result or its deadline)."""
        loop = asyncio.get_running_loop()
        if self._free is None:
            self._free = asyncio.Semaphore(len(self._workers))
        free = self._free
        try:
            await asyncio.wait_for(free.acquire(), self.queue_timeout_s)
        except TimeoutError:
            raise WorkersBusy(f"all {len(self._workers)} workers stayed busy for {self.queue_timeout_s:g} s") \
                from None
        worker = self._idle.pop()
        try:
            future = self._threads.submit(worker.call, args, self.timeout_s)
        except BaseException:
            self._give_back(worker, free)
            raise

        def done(_) -> None:
            try:
                loop.call_soon_threadsafe(self._give_back, worker, free)
            except RuntimeError:  # the loop closed first (shutdown): nobody will ask for a worker again
                pass

        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    def _give_back(self, worker: _Worker, free: asyncio.Semaphore) -> None:
        self._idle.append(worker)
        free.release()

    def close(self) -> None:
        """End every process (a call in progress fails with WorkerDied). A later call starts new ones."""
        for worker in self._workers:
            if worker in self._idle:
                worker.stop()
            else:
                worker.kill()
