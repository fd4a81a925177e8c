"""Fit the engine's intra-op threads, while it steps, to the CPUs other processes leave it.

An OpenMP team larger than the free CPUs waits at every barrier for a teammate the kernel has descheduled:
beside one busy process, two threads read weights slower than one (bf16 matrix-vector products of a 0.6B
model's layers, 2 cores: 14.5 against 16.6 GB/s). Standard library only; the caller hands in torch's setter.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("rawserve.engine")

PERIOD_S = 0.5  # how long a window of busy stepping is before the count is judged again
STALE_S = 5.0  # a tick this long after the last one starts a new window (the engine was idle in between)
SLACK = 0.5  # CPUs: others must keep more than half a CPU busy to cost a thread (the front process streaming
# tokens and a local client take a few tenths; on 2 CPUs a thread lost is half of every matmul)
UP_WINDOWS = 2  # windows in a row that must find a CPU free before a thread comes back


def read_cpu_jiffies(cpus: Iterable[int], stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) jiffies summed over `cpus` since boot, or None where /proc/stat is unreadable.
    Busy is everything but idle and iowait; steal counts as busy (the hypervisor had the CPU)."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    try:
        with open(stat) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    fields = [int(v) for v in rest.split()[:8]]
                    idle = fields[3] + fields[4]
                    total += sum(fields)
                    busy += sum(fields) - idle
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


class ThreadGovernor:
    """Call tick() once per engine step. Every PERIOD_S it compares how much of the allowed CPUs' time went
    to other processes (system busy time less this process's own) and sets the thread count to the CPUs left,
    between 1 and max_threads: down at once, up only after UP_WINDOWS windows that agree (no flapping).

    A window is judged at the first tick PERIOD_S or more after it began (a long prefill step makes a longer
    one); an idle engine does not tick, and a tick STALE_S after the last starts a new window."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], cpus: Iterable[int] | None = None,
                 *, read_jiffies: Callable[[], tuple[int, int] | None] | None = None,
                 own_cpu_s: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic,
                 jiffies_per_s: int | None = None) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
        self.num_cpus = len(cpus)
        self.max_threads = max_threads
        self.threads = max_threads
        self._set = set_threads
        self._read = read_jiffies or (lambda: read_cpu_jiffies(cpus))
        self._own = own_cpu_s or (lambda: sum(os.times()[:2]))
        self._clock = clock
        self._hz = jiffies_per_s or os.sysconf("SC_CLK_TCK")
        self._start: tuple[float, float, tuple[int, int]] | None = None
        self._last_tick = 0.0
        self._ups = 0
        self.changes = 0  # how often the count moved (for tests and the log)

    def tick(self) -> None:
        now = self._clock()
        if self._start is None or now - self._last_tick > STALE_S:  # first tick, or the engine was idle
            self._begin(now)
            return
        self._last_tick = now
        wall = now - self._start[0]
        if wall < PERIOD_S:
            return
        jiffies = self._read()
        if jiffies is None:
            self._start = None
            return
        own_s = self._own() - self._start[1]
        busy_s = (jiffies[0] - self._start[2][0]) / self._hz
        others = max(0.0, busy_s - own_s) / wall  # CPUs other processes kept busy over the window
        self._judge(int(self.num_cpus - others + SLACK))
        self._begin(now, jiffies)

    def _begin(self, now: float, jiffies: tuple[int, int] | None = None) -> None:
        jiffies = jiffies if jiffies is not None else self._read()
        self._start = None if jiffies is None else (now, self._own(), jiffies)
        self._last_tick = now

    def _judge(self, free: int) -> None:
        target = max(1, min(self.max_threads, free))
        if target < self.threads:
            self._ups = 0
            self._apply(target)
        elif target > self.threads:
            self._ups += 1
            if self._ups >= UP_WINDOWS:
                self._ups = 0
                self._apply(self.threads + 1)
        else:
            self._ups = 0

    def _apply(self, count: int) -> None:
        log.debug("engine threads %d -> %d (CPUs other processes left free)", self.threads, count)
        self.threads = count
        self.changes += 1
        self._set(count)
