"""The guided helper thread's hand-over rules: a runtime the step hands back early is built on before the step
ends, one the step still holds is not; and the GIL's switch interval is lowered only while a helper has work.

The grammar runtimes are fakes that record what they were asked to build (MaskWorker only calls build on them).
"""
from __future__ import annotations

import sys
import threading
import time

import pytest

from rawserve.engine.guided import mask_worker
from rawserve.engine.guided.mask_worker import MaskWorker


class FakeRuntime:
    def __init__(self, gate: threading.Event | None = None) -> None:
        self.built: list[int] = []
        self.gate = gate

    def build(self, cid: int) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.built.append(cid)


class FakeState:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.failed = None


def wait_for(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


@pytest.fixture
def worker():
    w = MaskWorker(lambda: None)
    yield w
    w.close()


def test_a_released_runtime_is_built_on_before_the_step_ends_and_a_held_one_is_not(worker):
    sitting, sampling = FakeRuntime(), FakeRuntime()
    assert worker.try_claim(sitting) and worker.try_claim(sampling)
    worker.enqueue(FakeState(sitting), 7)
    worker.enqueue(FakeState(sampling), 9)
    worker.release({sitting})  # its row sits out: the step will not touch it again
    assert wait_for(lambda: sitting.built == [7])
    time.sleep(0.05)
    assert sampling.built == [] and worker.num_queued == 1  # still the step's until end_step
    worker.end_step()
    assert wait_for(lambda: sampling.built == [9])


def test_releasing_a_runtime_the_step_never_claimed_changes_nothing(worker):
    held, other = FakeRuntime(), FakeRuntime()
    assert worker.try_claim(held)
    worker.release({other})
    worker.enqueue(FakeState(held), 1)
    time.sleep(0.05)
    assert held.built == []


def test_the_switch_interval_is_lowered_while_a_helper_builds_and_restored_when_all_are_idle():
    before = sys.getswitchinterval()
    assert before > mask_worker.BUSY_SWITCH_INTERVAL_S
    first_gate, second_gate = threading.Event(), threading.Event()
    first, second = MaskWorker(lambda: None), MaskWorker(lambda: None)
    try:
        assert first.wait_idle(5) and second.wait_idle(5)
        assert wait_for(lambda: sys.getswitchinterval() == before)  # idle helpers leave it alone
        slow_first, slow_second = FakeRuntime(first_gate), FakeRuntime(second_gate)
        first.enqueue(FakeState(slow_first), 1)
        assert wait_for(lambda: first.is_busy_with(slow_first))
        assert sys.getswitchinterval() == pytest.approx(mask_worker.BUSY_SWITCH_INTERVAL_S)
        second.enqueue(FakeState(slow_second), 2)
        assert wait_for(lambda: second.is_busy_with(slow_second))
        first_gate.set()
        assert first.wait_idle(5)
        time.sleep(0.05)  # one helper went idle, the other still builds: still lowered
        assert sys.getswitchinterval() == pytest.approx(mask_worker.BUSY_SWITCH_INTERVAL_S)
        second_gate.set()
        assert second.wait_idle(5)
        assert wait_for(lambda: sys.getswitchinterval() == pytest.approx(before))
    finally:
        first_gate.set()
        second_gate.set()
        first.close()
        second.close()
        sys.setswitchinterval(before)


def test_closing_a_busy_helper_restores_the_switch_interval():
    before = sys.getswitchinterval()
    gate = threading.Event()
    w = MaskWorker(lambda: None)
    try:
        runtime = FakeRuntime(gate)
        w.enqueue(FakeState(runtime), 1)
        w.enqueue(FakeState(FakeRuntime()), 2)
        assert wait_for(lambda: w.is_busy_with(runtime))
        assert sys.getswitchinterval() < before
    finally:
        gate.set()
        w.close()
    assert sys.getswitchinterval() == pytest.approx(before)
    sys.setswitchinterval(before)


class SpinningRuntime:
    """A build that keeps the CPU busy for `spin_s` of this thread's CPU time."""

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self.built: list[int] = []

    def build(self, cid: int) -> None:
        began = time.thread_time()
        while time.thread_time() - began < self.spin_s:
            pass
        self.built.append(cid)


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks")
def test_the_helpers_cpu_time_counts_its_work_and_not_its_waits(worker):
    assert worker.wait_idle(5)
    before = worker.cpu_s
    gate = threading.Event()
    waiting = FakeRuntime(gate)
    worker.enqueue(FakeState(waiting), 1)
    assert wait_for(lambda: worker.is_busy_with(waiting))
    # the job blocks on its gate: the helper waits while this thread works (the process's CPU grows, not the helper's)
    SpinningRuntime(0.2).build(0)
    gate.set()
    assert worker.wait_idle(5)
    idle = worker.cpu_s - before
    assert idle < 0.1
    spinning = SpinningRuntime(0.15)
    worker.enqueue(FakeState(spinning), 2)
    assert wait_for(lambda: spinning.built == [2])
    assert worker.wait_idle(5)
    assert worker.cpu_s - before - idle >= 0.15


def test_while_the_step_holds_the_floor_no_job_starts_and_one_under_way_runs_on(worker):
    assert worker.wait_idle(5)
    gate = threading.Event()
    running, queued = FakeRuntime(gate), FakeRuntime()
    worker.enqueue(FakeState(running), 1)
    assert wait_for(lambda: worker.is_busy_with(running))
    worker.hold_floor()  # the step's host code runs
    worker.enqueue(FakeState(queued), 2)
    gate.set()
    assert wait_for(lambda: running.built == [1])  # the job under way ran on
    time.sleep(0.05)
    assert queued.built == [] and worker.num_queued == 1 and worker.has_work
    worker.release_floor()  # the forward runs
    assert wait_for(lambda: queued.built == [2])
    assert worker.wait_idle(5) and not worker.has_work


def test_each_wait_of_the_steps_lends_the_floor_and_takes_it_back(worker):
    assert worker.wait_idle(5)
    worker.hold_floor()
    first, later, urgent = FakeRuntime(), FakeRuntime(), FakeRuntime()
    worker.enqueue(FakeState(first), 1)
    worker.wait_until(lambda: first.built == [1], 5)  # the grace after a forward: timed out with the floor kept
    assert first.built == [1]
    worker.enqueue(FakeState(later), 2)
    time.sleep(0.05)
    assert later.built == []  # the floor is the step's again
    state = FakeState(urgent)
    state.config = 3
    worker.claim(urgent)
    worker.start_urgent([state])
    waiter = threading.Thread(target=worker.wait_urgent)  # an urgent batch waited for: hung with the floor kept
    waiter.start()
    waiter.join(5)
    assert not waiter.is_alive() and urgent.built == [3]
    assert worker.wait_progress(5) < 5 and later.built == [2]  # nothing else could run: the helper's next job
    worker.end_step()
    worker.release_floor()
