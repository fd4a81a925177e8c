"""Transports between the engine frontend and the core loop: one batch of messages per send.

Owns the wire: "pipe" (default; one pickle-5 frame of compact tuples per send over an os pipe),
"queue" (multiprocessing.Queue, the baseline) and "local" (thread mode). It knows no asyncio and
no engine logic. Messages are (MsgKind, payload) tuples of engine/types.py objects (engine/messages.py).
"""
from __future__ import annotations

import collections
import contextlib
import multiprocessing.connection as mp_connection
import operator
import pickle
import queue
import threading
import time
from dataclasses import fields
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from rawserve.engine.messages import Message, MsgKind
from rawserve.engine.types import AddRequest, RequestOutput

TRANSPORTS = ("pipe", "queue")

_EOF = ("__eof__", None)  # posted by close() where the transport has no end-of-file of its own
_F_SETPIPE_SZ = 1031  # Linux fcntl
_PIPE_BYTES = 1 << 20  # the default max for unprivileged users (/proc/sys/fs/pipe-max-size)
_POLL_SLICE_S = 0.05

_OUT_FIELDS = tuple(f.name for f in fields(RequestOutput))
_ADD_FIELDS = tuple(f.name for f in fields(AddRequest))
_out_tuple = operator.attrgetter(*_OUT_FIELDS)
_add_tuple = operator.attrgetter(*_ADD_FIELDS)


class Sender(Protocol):
    def send(self, msgs: list[Message]) -> None: ...
    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout: float | None, watch: Any = None) -> list[Message]:
        """Every message waiting, or [] after `timeout` (None: block) or once `watch` (a sentinel
        such as Process.sentinel) is ready. Raises EOFError when the sending side has closed."""
        ...

    def close(self) -> None: ...


def encode(msgs: list[Message]) -> bytes:
    """Slots dataclasses pickle as a dict of slot names per object; a step of 256 outputs costs
    ~400 us that way and ~60 us as plain tuples, so outputs and adds travel as tuples."""
    wire = []
    for kind, payload in msgs:
        if kind == MsgKind.OUTPUTS:
            payload = [_out_tuple(out) for out in payload]
        elif kind == MsgKind.ADD:
            payload = _add_tuple(payload)
        wire.append((kind, payload))
    return pickle.dumps(wire, protocol=5)


def decode(data: bytes) -> list[Message]:
    msgs = pickle.loads(data)
    for i, (kind, payload) in enumerate(msgs):
        if kind == MsgKind.OUTPUTS:
            msgs[i] = (kind, [RequestOutput(*row) for row in payload])
        elif kind == MsgKind.ADD:
            msgs[i] = (kind, AddRequest(*payload))
    return msgs


def _check_eof(batch: list[Message], out: list[Message]) -> bool:
    """Append `batch` to `out`; True when it carried the EOF marker."""
    for msg in batch:
        if msg == _EOF:
            return True
        out.append(msg)
    return False


class LocalSender:
    """Thread mode: batches go by reference through a SimpleQueue. Neither side may mutate a message
    after sending it."""

    def __init__(self, q: queue.SimpleQueue) -> None:
        self._q = q

    def send(self, msgs: list[Message]) -> None:
        if msgs:
            self._q.put(msgs)

    def close(self) -> None:
        self._q.put([_EOF])


class _BatchReceiver:
    """Shared by the queue-backed receivers: after the first batch, take every batch already waiting."""

    def __init__(self, q: Any) -> None:
        self._q = q
        self._eof = False

    def _take_rest(self, batch: list, out: list[Message]) -> list[Message]:
        while True:
            if _check_eof(batch, out):
                self._eof = True
                if not out:
                    raise EOFError("sender closed")
                return out
            try:
                batch = self._q.get_nowait()
            except queue.Empty:
                return out


class LocalReceiver(_BatchReceiver):
    def recv(self, timeout: float | None, watch: Any = None) -> list[Message]:
        if self._eof:
            raise EOFError("sender closed")
        out: list[Message] = []
        try:
            batch = self._q.get(timeout=timeout) if timeout is None or timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return out
        return self._take_rest(batch, out)

    def close(self) -> None:
        pass


class QueueSender:
    """The baseline: multiprocessing.Queue pickles each batch of dataclasses in its feeder thread."""

    def __init__(self, q: Any) -> None:
        self._q = q

    def send(self, msgs: list[Message]) -> None:
        if msgs:
            self._q.put(msgs)

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):  # already closed
            self._q.put([_EOF])

    def detach(self) -> None:
        """The parent's copy of an end handed to the child: a Queue is one object on both sides."""


class QueueReceiver(_BatchReceiver):
    def recv(self, timeout: float | None, watch: Any = None) -> list[Message]:
        if self._eof:
            raise EOFError("sender closed")
        out: list[Message] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # A Queue can't be waited on together with a sentinel, so poll in slices.
            remaining = _POLL_SLICE_S if deadline is None else min(_POLL_SLICE_S, deadline - time.monotonic())
            try:
                batch = self._q.get(timeout=max(remaining, 0.0)) if remaining > 0 else self._q.get_nowait()
                break
            except queue.Empty:
                if (deadline is not None and time.monotonic() >= deadline) or \
                        (watch is not None and mp_connection.wait([watch], 0)):
                    return out
        return self._take_rest(batch, out)

    def close(self) -> None:
        pass

    def detach(self) -> None:
        pass


class PipeSender:
    """One pickle-5 frame per send on an os pipe.

    threaded=True hands frames to a daemon writer thread: the frontend's event loop must never block
    on a full pipe while the core is busy stepping. The core writes inline: the frontend's pump reads
    continuously and the pipe holds about a megabyte, so the write does not wait in practice.
    """

    def __init__(self, conn: mp_connection.Connection, threaded: bool = False) -> None:
        self._conn = conn
        self._threaded = threaded
        self._lock = threading.Lock()
        self._pending: collections.deque[bytes | None] = collections.deque()  # None: close
        self._wakeup = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._is_closed = False
        self.error: BaseException | None = None

    def __getstate__(self) -> dict:
        # Handed to the spawned child (via Process args): only the connection travels.
        return {"conn": self._conn, "threaded": self._threaded}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["conn"], state["threaded"])

    def send(self, msgs: list[Message]) -> None:
        if not msgs:
            return
        # Encoded by the caller, so a message that cannot be pickled fails its sender, not the writer.
        data = encode(msgs)
        with self._lock:
            if not self._threaded:
                self._conn.send_bytes(data)
                return
            if self.error is not None or self._is_closed:
                raise BrokenPipeError(f"engine core connection is closed ({self.error!r})")
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop, name="rawserve-ipc-writer", daemon=True)
                self._thread.start()
            self._pending.append(data)
            self._wakeup.notify()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._wakeup.wait()
                frames = list(self._pending)
                self._pending.clear()
            try:
                for data in frames:
                    if data is None:
                        self._conn.close()
                        return
                    self._conn.send_bytes(data)
            except OSError as error:  # the core is gone; its death is reported by the frontend's pump
                with self._lock:
                    self.error = error
                return

    def close(self) -> None:
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            if self._thread is not None:
                self._pending.append(None)  # the writer closes after flushing what is queued
                self._wakeup.notify()
                return
        with contextlib.suppress(OSError):
            self._conn.close()

    def detach(self) -> None:
        self._conn.close()


class PipeReceiver:
    def __init__(self, conn: mp_connection.Connection) -> None:
        self._conn = conn

    def recv(self, timeout: float | None, watch: Any = None) -> list[Message]:
        waitables: list[Any] = [self._conn] if watch is None else [self._conn, watch]
        if not mp_connection.wait(waitables, timeout) or not self._conn.poll(0):
            return []
        out = decode(self._conn.recv_bytes())  # EOFError when the sender closed
        # Take every frame already waiting, so the caller sees one batch per wakeup.
        while self._conn.poll(0):
            try:
                out.extend(decode(self._conn.recv_bytes()))
            except EOFError:
                break  # reported on the next call, after these messages are handled
        return out

    def close(self) -> None:
        self._conn.close()

    def detach(self) -> None:
        self._conn.close()


def _grow_pipe(conn: mp_connection.Connection) -> None:
    try:
        import fcntl
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or over the system's limit: the default 64 KiB works
        pass


def make_channel(transport: str | None, context: BaseContext | None,
                 threaded_sender: bool = False) -> tuple[Any, Any]:
    """A (sender, receiver) pair. context None: both ends in this process (thread mode), transport ignored.

    For a spawned child, pass the child's end in the Process args and call `detach()` on the parent's
    copy after start, so the child's exit reads as end-of-file here.
    """
    if context is None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        return LocalSender(q), LocalReceiver(q)
    if transport == "queue":
        mq = context.Queue()
        return QueueSender(mq), QueueReceiver(mq)
    if transport == "pipe":
        reader, writer = context.Pipe(duplex=False)
        _grow_pipe(writer)
        return PipeSender(writer, threaded=threaded_sender), PipeReceiver(reader)
    raise ValueError(f"transport: must be one of {'|'.join(TRANSPORTS)}, got {transport!r}")
