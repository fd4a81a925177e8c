"""The guided helper thread: builds token masks ahead of need, across steps, so a cold mask never holds up
the batch; and the hand-over that keeps each grammar runtime in one thread's hands at a time.

Core side. A runtime is either the step's (claimed, for the step's length) or the helper's (busy, one mask).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rawserve.engine.guided")

# The GIL's switch interval while a helper builds (CPython's default is 5 ms). A mask walk is mostly Python and keeps
# the GIL; the core thread, back from each torch op of its forward or sampler (which release it), waits for the
# interval to pass before the helper must hand it over: up to 5 ms per op, a convoy. At 0.5 ms, with a thread
# building real cold masks beside batch-32 steps of the tiny shape, the helper built 1.6x the masks per step
# (169 against 108) in about the same step time (143 against 138 ms; loaded 2-core box). None leaves it alone.
BUSY_SWITCH_INTERVAL_S: float | None = 0.0005

# The interval is process-wide, and tests and benches run several workers in one process: the first helper to get
# busy lowers it, the last to go idle puts back what it was.
_switch_lock = threading.Lock()
_num_lowered = 0
_saved_switch_s = 0.0


def _lower_switch_interval() -> bool:
    """-> whether it was lowered (undo with _restore_switch_interval)."""
    global _num_lowered, _saved_switch_s
    if BUSY_SWITCH_INTERVAL_S is None:
        return False
    with _switch_lock:
        if _num_lowered == 0:
            _saved_switch_s = sys.getswitchinterval()
            sys.setswitchinterval(min(BUSY_SWITCH_INTERVAL_S, _saved_switch_s))
        _num_lowered += 1
    return True


def _restore_switch_interval() -> None:
    global _num_lowered
    with _switch_lock:
        _num_lowered -= 1
        if _num_lowered == 0:
            sys.setswitchinterval(_saved_switch_s)


class MaskWorker:
    """One daemon thread and its jobs: a queue of (state, configuration) masks to build in the background,
    and the step's urgent batch (rows that must sample this step: a prompt's last chunk, drafted positions).

    The rule that makes it safe: the helper builds a background job only on a runtime the step has not claimed,
    and the step claims only a runtime the helper is not busy with (`try_claim`), or waits for that one mask
    (`claim`). An urgent batch is built on runtimes the step claimed and promises not to touch until
    `wait_urgent` returns (the forward runs meanwhile). A runtime whose rows all sit the step out goes back before
    the step ends (`release`). States and runtimes are hashed by identity.

    The floor (`hold_floor`): while the step runs its own host code, the helper starts no job (one under way runs
    on), and each wait of the step's lends it the floor back. The step holds it where its forward runs on a device:
    there its host code is short runs of Python and kernel launches, each of which hands the GIL over, and beside a
    helper walking in Python each hand-over waits for the helper (bench.gil_convoy: a step of 400 short ops around a
    5 ms device wait took 15-16x its time beside a helper that always had work, 0.95-1.06x beside one that started
    masks only in the wait, which built ~60 cold masks a step there).
    """

    def __init__(self, prepare: Callable[[], None]) -> None:
        self._cv = threading.Condition()
        self._queue: dict[Any, int] = {}  # GuidedState -> the configuration whose mask it waits for, in order
        self._claimed: set[Any] = set()  # GrammarRuntimes the step holds now
        self._busy: Any = None  # the GrammarRuntime the helper builds on now (a background job)
        self._building: Any = None  # and the GuidedState it builds for
        self._urgent: list | None = None  # the step's batch, taken (None) once built
        self._num_done = 0  # jobs finished: what an idle step waits to see move
        self._closing = False
        self.num_built = 0  # background masks built, in all
        self.build_s = 0.0  # the helper's time on them
        self._has_lowered = False  # this helper holds the GIL's switch interval lowered (it has work)
        self._floor = False  # the step runs its host code: no job starts (hold_floor)
        self._thread = threading.Thread(target=self._run, args=(prepare,), name="guided-ahead", daemon=True)
        self._thread.start()

    # ----- the step's side (the core thread)

    def try_claim(self, runtime: Any) -> bool:
        """Claim `runtime` for this step unless the helper is building on it now (then False: its rows sit out)."""
        with self._cv:
            if runtime is self._busy:
                return False
            self._claimed.add(runtime)
            return True

    def claim(self, runtime: Any) -> None:
        """Claim `runtime` for this step, waiting for the one mask the helper may be building on it."""
        with self._cv:
            while runtime is self._busy:
                self._cv.wait()
            self._claimed.add(runtime)

    def release(self, runtimes: Any) -> None:
        """The step will not touch these runtimes again (their rows sit this step out): the helper may build on
        them now, while the step samples its other rows, rather than from the step's end."""
        with self._cv:
            held = len(self._claimed)
            self._claimed.difference_update(runtimes)
            if len(self._claimed) != held:
                self._cv.notify_all()

    def enqueue(self, state: Any, cid: int) -> None:
        """Build `state`'s mask at configuration `cid` in the background (once; a newer cid replaces an older)."""
        with self._cv:
            if self._queue.get(state) != cid:
                self._queue[state] = cid
                self._cv.notify_all()

    def is_pending(self, state: Any) -> bool:
        """Its mask is queued or under way."""
        return state in self._queue or state is self._building

    def forget(self, state: Any) -> None:
        """Drop `state`'s job not started yet (its request ended); one under way finishes and is dropped."""
        with self._cv:
            self._queue.pop(state, None)

    def end_step(self) -> None:
        """The step touches no grammar any more: hand every claimed runtime back to the helper."""
        with self._cv:
            if self._claimed:
                self._claimed.clear()
                self._cv.notify_all()

    def hold_floor(self) -> None:
        """The step's host code runs from now: start no job until release_floor (see the class)."""
        with self._cv:
            self._floor = True

    def release_floor(self) -> None:
        with self._cv:
            if self._floor:
                self._floor = False
                self._cv.notify_all()

    @property
    def has_work(self) -> bool:
        """Jobs are queued or under way (read without the lock: a hint)."""
        return bool(self._queue) or self._busy is not None or self._urgent is not None

    @contextlib.contextmanager
    def _floor_lent(self):
        """Inside a wait of the step's, under self._cv: the helper may start jobs meanwhile (they are what the step
        waits for); the floor is the step's again after."""
        held = self._floor
        if held:
            self._floor = False
            self._cv.notify_all()
        try:
            yield
        finally:
            self._floor = held

    def wait_progress(self, timeout_s: float) -> float:
        """Nothing could run: block until the helper finishes a job (or timeout_s), without a spin -> seconds
        waited. Returns at once when it has nothing to do."""
        began = time.perf_counter()
        with self._cv, self._floor_lent():
            seen = self._num_done
            self._cv.wait_for(lambda: self._num_done != seen or self._closing
                              or (not self._queue and self._busy is None), timeout_s)
        return time.perf_counter() - began

    def wait_until(self, is_done: Callable[[], bool], timeout_s: float) -> None:
        """Block until is_done() (checked as each job ends), or timeout_s."""
        with self._cv, self._floor_lent():
            self._cv.wait_for(lambda: is_done() or self._closing, timeout_s)

    def is_busy_with(self, runtime: Any) -> bool:
        return runtime is self._busy

    def start_urgent(self, states: list) -> None:
        """Build these states' masks now, ahead of any background job (their runtimes are claimed)."""
        with self._cv:
            assert self._urgent is None, "one urgent batch at a time"
            self._urgent = states
            for state in states:  # built now: a job queued for them is stale
                self._queue.pop(state, None)
            self._cv.notify_all()

    def wait_urgent(self) -> None:
        with self._cv, self._floor_lent():
            while self._urgent is not None and not self._closing:
                self._cv.wait()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until the queue is empty and nothing is being built (benches and tests: a quiet start)."""
        with self._cv, self._floor_lent():
            return self._cv.wait_for(lambda: not self._queue and self._busy is None and self._urgent is None
                                     and self._num_done > 0, timeout_s)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def cpu_s(self) -> float | None:
        """The helper thread's CPU seconds so far, every job and its waits for the GIL left out (benches: what
        the step paid beside it is then told apart from the work itself); None where the platform has no
        per-thread clock."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):  # no pthread clocks (Windows), or the thread has ended
            return None

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join()

    # ----- the helper thread

    def _set_busy(self, busy: bool) -> None:
        if busy and not self._has_lowered:
            self._has_lowered = _lower_switch_interval()
        elif not busy and self._has_lowered:
            self._has_lowered = False
            _restore_switch_interval()

    def _run(self, prepare: Callable[[], None]) -> None:
        self._set_busy(True)  # the vocabulary's lazy parts: about a second of Python beside the steps
        try:
            prepare()
        except Exception:  # noqa: BLE001 - the vocabulary's lazy parts are built again by the first mask that needs them
            log.warning("preparing the guided vocabulary failed; masks build it when they need it", exc_info=True)
        with self._cv:
            self._num_done += 1
            self._cv.notify_all()
        while True:
            with self._cv:
                job = None
                while job is None:
                    if self._closing:
                        self._set_busy(False)
                        return
                    if self._floor:  # the step runs its host code: wait for its forward or its next wait
                        self._set_busy(False)
                        self._cv.wait()
                        continue
                    if self._urgent is not None:
                        job = self._urgent
                        break
                    for state, cid in self._queue.items():
                        if state.runtime not in self._claimed:
                            del self._queue[state]
                            self._busy = state.runtime
                            self._building = state
                            job = (state, cid)
                            break
                    else:
                        self._set_busy(False)  # nothing to build: the GIL's hand-offs as they were
                        self._cv.wait()
            self._set_busy(True)
            if isinstance(job, list):
                for state in job:
                    _build(state, state.config)
                with self._cv:
                    self._urgent = None
                    self._num_done += 1
                    self._cv.notify_all()
                continue
            began = time.perf_counter()
            _build(*job)
            with self._cv:
                self._busy = self._building = None
                self._num_done += 1
                self.num_built += 1
                self.build_s += time.perf_counter() - began
                self._cv.notify_all()


def _build(state: Any, cid: int) -> None:
    """A mask that fails to build is kept as the state's failure at `cid`: the step then fails that request alone."""
    try:
        state.runtime.build(cid)
    except Exception as error:  # noqa: BLE001 - this request's grammar: the step raises it in its row (_fail_alone)
        state.failed = (cid, error)
