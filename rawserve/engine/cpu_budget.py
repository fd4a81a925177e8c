"""How many CPUs this process may really use (affinity, cgroup v2 cpu.max, cgroup v1 CFS quota), and the
engine's intra-op thread plan from it: the thread count, why, and the OpenMP environment a spawned core gets.

Standard library only (the seam: the frontend computes a spawned core's environment without loading torch).
"""
from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from rawserve.engine.memory import cgroup_dirs

# At this budget or less the engine takes every CPU: giving the front process one of two CPUs halves every
# matmul, while the front needs a CPU only in bursts (HTTP, detokenizing) that the scheduler interleaves.
# Above it, one CPU is left to the front process, so its work never waits behind a full OpenMP team.
ALL_CPUS_UP_TO = 4
# OpenMP's idle threads spin, then sleep. libgomp's default (up to 300,000 turns per wait) burns the CPU a
# descheduled teammate or a neighbour needs: beside two busy processes an n=8 request on the demo model took 44 s
# with it. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a futex wake-up at each of a step's ~1,200 parallel
# regions, and so did 1,000 turns (0.6B decode at one row, offline, quiet, 2 threads: 67-80 ms a bf16 step and
# 124 ms fp32, against 53-65 and 98-117 at 30,000 or 300,000 turns). 30,000 turns spans the gaps between a
# step's ops, and beside busy processes the ThreadGovernor takes the engine down to the threads that have CPUs,
# so no barrier waits on a descheduled teammate: served on the tiny model beside two busy processes, 1.9-2.2x
# slower than alone, as with 1,000 turns (2.0-2.2x), where llama-server slowed 2-8x.
OMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "0"}  # KMP_*: Intel's OpenMP, when torch uses it
# Either of these says how the user wants OpenMP to wait: then rawserve sets neither.
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """CPUs this process may keep busy at once, and the limit that binds (`source`, for the startup line)."""
    cpus: int
    affinity: int
    quota: float | None  # the tightest cgroup CPU quota, in CPUs; None when no cgroup sets one
    source: str


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """The engine's intra-op threads, why, and what a spawned core's environment gets (the user's own
    OMP_* / KMP_* settings are left out, so they stay as given)."""
    num_threads: int
    reason: str
    env: dict[str, str] = field(default_factory=dict)
    adaptive: bool = False  # auto sized it: a ThreadGovernor may lower it while other processes take CPUs


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _quota_cpus(version: str, directory: pathlib.Path) -> float | None:
    """One cgroup directory's CPU quota in CPUs (quota / period), or None when it sets none."""
    if version == "v2":
        parts = (_read(directory / "cpu.max") or "max").split()
        if len(parts) < 2 or parts[0] == "max":
            return None
        quota, period = parts[0], parts[1]
    else:
        quota, period = (_read(directory / name) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if quota is None or period is None or int(quota) < 0:  # -1: no limit
            return None
    try:
        return int(quota) / int(period) if int(period) > 0 else None
    except ValueError:
        return None


def cgroup_cpu_quota(proc_self: pathlib.Path = pathlib.Path("/proc/self"),
                     mount_prefix: pathlib.Path = pathlib.Path("/")) -> tuple[float, str] | None:
    """(CPUs, where) of the tightest CPU quota over this process's cgroup and its ancestors (each binds);
    None when no cgroup sets one."""
    best: tuple[float, str] | None = None
    for version, directory, top in cgroup_dirs(proc_self, mount_prefix, controller="cpu"):
        while True:
            cpus = _quota_cpus(version, directory)
            if cpus is not None and (best is None or cpus < best[0]):
                best = (cpus, f"cgroup {version} CPU quota {cpus:g} at {directory}")
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return best


def cpu_budget(proc_self: pathlib.Path = pathlib.Path("/proc/self"), mount_prefix: pathlib.Path = pathlib.Path("/"),
               affinity: int | None = None) -> CpuBudget:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota rounded down (at least 1).

    Rounded down because CFS throttles the whole cgroup once the quota is spent: with 2 threads under a
    1.5-CPU quota both run for 75 ms of each 100 ms period and then both stop, and an OpenMP barrier waits for
    the stopped one; one thread runs steadily and leaves the fraction to the front process.
    """
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    found = cgroup_cpu_quota(proc_self, mount_prefix)
    if found is None or found[0] >= affinity:
        where = "" if found is None else f" (under the {found[1]})"
        return CpuBudget(affinity, affinity, None if found is None else found[0], f"{affinity} CPUs in the affinity "
                                                                                  f"mask{where}")
    quota, where = found
    cpus = max(1, math.floor(quota))
    return CpuBudget(cpus, affinity, quota, f"{where}, rounded down to {cpus} (affinity mask: {affinity} CPUs)")


def auto_threads(cpus: int) -> int:
    """auto's thread count for a budget of `cpus`: all of them up to ALL_CPUS_UP_TO, then one fewer."""
    return cpus if cpus <= ALL_CPUS_UP_TO else cpus - 1


def _positive_int(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value >= 1 else None


def plan_threads(setting: int | str, environ: Mapping[str, str] | None = None,
                 budget: CpuBudget | None = None) -> ThreadPlan:
    """The thread plan for --num-threads `setting` (a count, or "auto") in `environ` (default os.environ).

    Order: the flag's count; else the user's OMP_NUM_THREADS; else auto_threads(the budget). The spawned
    core's environment gets OMP_NUM_THREADS (the flag wins over the user's, as flags win over RAWSERVE_*)
    and OMP_DEFAULTS where the user set no wait of their own.
    """
    environ = os.environ if environ is None else environ
    user_count = _positive_int(environ.get("OMP_NUM_THREADS"))
    if setting != "auto":
        count, reason = int(setting), f"--num-threads {setting}"
    elif user_count is not None:
        count, reason = user_count, f"OMP_NUM_THREADS={user_count} from the environment"
    else:
        budget = cpu_budget() if budget is None else budget
        count = auto_threads(budget.cpus)
        spare = "" if count == budget.cpus else ", one left to the front process"
        reason = f"auto: {budget.source}{spare}"
    env = {"OMP_NUM_THREADS": str(count), **wait_environment(environ)}
    waits = ", ".join(f"{name}={environ[name]}" for name in _WAIT_VARS if name in environ)
    reason += f"; OpenMP waits {'as the environment says (' + waits + ')' if waits else 'by a short spin'}"
    adaptive = setting == "auto" and user_count is None and count > 1
    if adaptive:
        reason += "; fewer while other processes keep CPUs busy"
    return ThreadPlan(count, reason, env, adaptive)


def wait_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """OMP_DEFAULTS less what `environ` already says of OpenMP's waits: what a spawned core gets, and what an
    in-process benchmark sets before torch loads OpenMP (it reads them once, at load) to time the engine's waits."""
    env = {}
    if not any(name in environ for name in _WAIT_VARS):
        env["GOMP_SPINCOUNT"] = OMP_DEFAULTS["GOMP_SPINCOUNT"]
    if "KMP_BLOCKTIME" not in environ:
        env["KMP_BLOCKTIME"] = OMP_DEFAULTS["KMP_BLOCKTIME"]
    return env


def export_environment(env: Mapping[str, str]) -> dict[str, str | None]:
    """Set `env` in os.environ (so a process spawned next inherits it); returns the previous values, for
    restore_environment."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    return previous


def restore_environment(previous: Mapping[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
