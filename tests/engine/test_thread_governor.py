"""ThreadGovernor: the engine's threads follow the CPUs other processes leave free (fake /proc/stat readings
and clock: the outside of the unit), and /proc/stat read for real."""
from __future__ import annotations

import os

import pytest

from rawserve.engine.cpu_budget import CpuBudget, plan_threads
from rawserve.engine.thread_governor import PERIOD_S, STALE_S, ThreadGovernor, read_cpu_jiffies

HZ = 100


class Machine:
    """Two CPUs' jiffy counters and this process's CPU seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0
        self.total = 0
        self.own = 0.0
        self.threads_set: list[int] = []

    def run(self, seconds: float, own_cpus: float, other_cpus: float, num_cpus: int = 2) -> None:
        self.now += seconds
        self.own += own_cpus * seconds
        self.busy += round((own_cpus + other_cpus) * seconds * HZ)
        self.total += round(num_cpus * seconds * HZ)

    def governor(self, max_threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(max_threads, self.threads_set.append, cpus=range(2),
                              read_jiffies=lambda: (self.busy, self.total), own_cpu_s=lambda: self.own,
                              clock=lambda: self.now, jiffies_per_s=HZ)


def step(machine: Machine, gov: ThreadGovernor, steps: int, own: float, others: float, step_s: float = 0.1):
    for _ in range(steps):
        gov.tick()
        machine.run(step_s, own, others)


def test_two_threads_stay_while_only_the_front_process_works_beside_them():
    m = Machine()
    gov = m.governor()
    step(m, gov, 30, own=2.0, others=0.1)  # the front process writing tokens: under SLACK
    step(m, gov, 30, own=1.8, others=0.4)  # and a local client reading them
    assert gov.threads == 2 and m.threads_set == []


def test_a_busy_neighbour_takes_a_thread_at_once_and_gives_it_back_after_two_calm_windows():
    m = Machine()
    gov = m.governor()
    step(m, gov, 8, own=1.3, others=0.7)  # a neighbour holds most of a CPU
    assert gov.threads == 1 and m.threads_set == [1]
    step(m, gov, 6, own=1.0, others=0.7)  # still there: stay at one
    assert m.threads_set == [1]
    step(m, gov, 6, own=1.0, others=0.0)  # gone: one calm window (5 steps) is not enough ...
    assert gov.threads == 1
    step(m, gov, 12, own=1.0, others=0.0)  # ... two are
    assert gov.threads == 2 and m.threads_set == [1, 2]


def test_never_below_one_thread_and_never_above_the_plan():
    m = Machine()
    gov = m.governor(max_threads=2)
    step(m, gov, 20, own=0.7, others=1.3)  # two busy neighbours on two CPUs
    assert gov.threads == 1
    step(m, gov, 40, own=1.0, others=0.0)
    assert gov.threads == 2 and max(m.threads_set) == 2


def test_a_window_is_judged_only_after_a_period_and_an_idle_gap_starts_a_new_one():
    m = Machine()
    gov = m.governor()
    gov.tick()
    m.run(PERIOD_S / 2, own_cpus=0.0, other_cpus=2.0)
    gov.tick()  # half a period: nothing judged yet
    assert m.threads_set == []
    m.run(STALE_S * 2, own_cpus=0.0, other_cpus=2.0)  # the engine idled while others worked, then steps again
    gov.tick()  # starts a fresh window rather than judging the idle one
    assert m.threads_set == []
    m.run(PERIOD_S, own_cpus=1.0, other_cpus=0.0)
    gov.tick()
    assert m.threads_set == []


def test_an_unreadable_proc_stat_leaves_the_threads_as_planned():
    gov = ThreadGovernor(2, lambda n: pytest.fail("no reading, no change"), cpus=range(2),
                         read_jiffies=lambda: None, own_cpu_s=lambda: 0.0, clock=iter(range(100)).__next__)
    for _ in range(20):
        gov.tick()
    assert gov.threads == 2


def test_proc_stat_is_read_for_the_cpus_this_process_may_use(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 1 2 3 40 4 5 6 7 0 0\n"
                    "cpu1 10 0 10 60 1 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    assert read_cpu_jiffies([0], str(stat)) == (1 + 2 + 3 + 5 + 6 + 7, 68)
    assert read_cpu_jiffies([0, 1], str(stat)) == (24 + 20, 68 + 81)
    assert read_cpu_jiffies([5], str(stat)) is None  # a CPU the file does not list: no reading
    real = read_cpu_jiffies(sorted(os.sched_getaffinity(0)))
    assert real is not None and 0 < real[0] < real[1]


def test_only_an_auto_sized_plan_of_several_threads_is_adaptive():
    budget = CpuBudget(2, 2, None, "2 CPUs in the affinity mask")
    auto = plan_threads("auto", {}, budget)
    assert auto.adaptive and "fewer while other processes keep CPUs busy" in auto.reason
    assert not plan_threads("2", {}, budget).adaptive  # the user's count stays
    assert not plan_threads("auto", {"OMP_NUM_THREADS": "2"}, budget).adaptive
    assert not plan_threads("auto", {}, CpuBudget(1, 1, None, "1 CPU")).adaptive
