"""The standard process_* metrics (as Prometheus client libraries export them) read from /proc, the engine
core process's resident memory when it runs apart, and giving memory back: the C heap's policy (keep_freed_heap,
release_free_heap) and pages of memory still in use (release_pages).

Standard library only; on a system without /proc it renders nothing.
"""
from __future__ import annotations

import ctypes
import os
import pathlib
import resource
import sys

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def release_free_heap() -> bool:
    """Return the C heap's free pages to the kernel (glibc's malloc_trim); False where libc has none (musl, macOS).

    glibc gives back only the free memory at the top of its heap on its own. A build that allocates and frees a
    lot leaves the rest resident: loading Qwen3's tokenizer.json (152k tokens, 151k merges) peaks at ~114 MiB over
    a tokenizer that keeps 19, and the core's profiled step leaves ~30 MiB behind.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


_MADV_DONTNEED = 4  # Linux's value (sys/mman.h)


def release_pages(address: int, num_bytes: int) -> int:
    """Hand the whole pages inside [address, address + num_bytes) back to the kernel (madvise MADV_DONTNEED) and
    return how many bytes that was; 0 off Linux, without libc's madvise, or when the kernel refuses.

    For memory a process still owns but will not read until it writes it again (the KV pool's idle blocks: the
    allocator cannot return a chunk that is still in use, and malloc_trim walks only free ones). Anonymous private
    pages read back as zeros afterwards; the partial pages at either end stay as they are.
    """
    start = -(-address // _PAGE_BYTES) * _PAGE_BYTES
    end = (address + num_bytes) // _PAGE_BYTES * _PAGE_BYTES
    if end <= start or not sys.platform.startswith("linux"):
        return 0
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return end - start if madvise(start, end - start, _MADV_DONTNEED) == 0 else 0


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_heap() -> bool:
    """Serve every allocation from glibc's heap and keep what is freed there for the next allocation, until
    release_free_heap hands it back; False where libc has no mallopt (musl, macOS).

    By default glibc maps each allocation above its mmap threshold (at most 32 MiB) afresh and unmaps it on free,
    and hands the heap's top back past its trim threshold: every such tensor a CPU step makes is zero-filled by
    the kernel page by page, at every layer of every step. A 2,048-token prefill of Qwen3-0.6B's shape spent a
    fifth of its time there (bf16: 7.0 against 5.5 s with both turned off; float32 11.0 against 9.5 s). The
    engine's idle trim (HeapRelease) still returns a burst's peak once the work is done.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


class HeapRelease:
    """When to call release_free_heap: once per idle spell that follows work, `idle_s` into it, and no sooner than
    `min_gap_s` after the last call. A burst's transients (a step's activations and vocabulary-sized rows in the
    core, request and stream buffers in the server) stay in glibc's heap once freed, so without it a process holds
    its burst's peak for good; a trim costs a few ms, so never between steps or for an idle spell a request ends
    at once. Times are time.monotonic()'s."""

    def __init__(self, idle_s: float = 0.5, min_gap_s: float = 2.0) -> None:
        self.idle_s, self.min_gap_s = idle_s, min_gap_s
        self.due: float | None = None
        self.last = float("-inf")

    def went_idle(self, now: float) -> float:
        """The work is done: schedule the release; returns the seconds until it is due."""
        self.due = max(now + self.idle_s, self.last + self.min_gap_s)
        return self.due - now

    def went_busy(self) -> None:
        self.due = None  # the next idle spell schedules it again

    def wait_s(self, now: float, poll_s: float) -> float:
        """How long an idle loop may block before the release falls due."""
        return poll_s if self.due is None else max(0.0, min(poll_s, self.due - now))

    def run_if_due(self, now: float) -> bool:
        """Release when due (then True); otherwise nothing. A timer set for `due` may fire a clock tick early."""
        if self.due is None or now < self.due - 0.01:
            return False
        release_free_heap()
        self.due, self.last = None, now
        return True


def _boot_time_s() -> float | None:
    try:
        for line in pathlib.Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def read_process(pid: int | str = "self") -> dict[str, float] | None:
    """{resident_memory_bytes, virtual_memory_bytes, cpu_seconds_total, start_time_seconds, open_fds} of a
    process, from /proc/<pid>/stat and fd/; None when it cannot be read (no /proc, or the process is gone)."""
    root = pathlib.Path("/proc") / str(pid)
    try:
        stat = (root / "stat").read_text()
        num_fds = len(os.listdir(root / "fd"))
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    # fields[0] is stat's 3rd field (state): utime is the 14th, so fields[11]; see proc(5)
    utime, stime, start_ticks = int(fields[11]), int(fields[12]), int(fields[19])
    boot = _boot_time_s()
    out = {"virtual_memory_bytes": float(fields[20]), "resident_memory_bytes": float(int(fields[21]) * _PAGE_BYTES),
           "cpu_seconds_total": (utime + stime) / _TICKS, "open_fds": float(num_fds)}
    if boot is not None:
        out["start_time_seconds"] = boot + start_ticks / _TICKS
    return out


_STANDARD = (
    ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", "virtual_memory_bytes"),
    ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", "resident_memory_bytes"),
    ("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
     "start_time_seconds"),
    ("process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.", "cpu_seconds_total"),
    ("process_open_fds", "gauge", "Number of open file descriptors.", "open_fds"),
)


def _line(name: str, kind: str, help_text: str, value: float, labels: str = "") -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name}{labels} {float(value)!r}\n"


def render_process_metrics(prefix: str, model_name: str, core_pid: int | None) -> str:
    """This process's process_* families, plus `<prefix>engine_core_resident_memory_bytes` and
    `..._cpu_seconds_total` for a core in another process (`core_pid`): the model and KV cache live there."""
    own = read_process()
    if own is None:
        return ""
    parts = [_line(name, kind, help_text, own[key]) for name, kind, help_text, key in _STANDARD if key in own]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        parts.append(_line("process_max_fds", "gauge", "Maximum number of open file descriptors.", soft))
    core = read_process(core_pid) if core_pid is not None and core_pid != os.getpid() else None
    if core is not None:
        label = '{model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"}'
        parts.append(_line(prefix + "engine_core_resident_memory_bytes", "gauge",
                           "Resident memory of the engine core process (weights, KV cache) in bytes.",
                           core["resident_memory_bytes"], label))
        parts.append(_line(prefix + "engine_core_cpu_seconds_total", "counter",
                           "User and system CPU time of the engine core process in seconds.",
                           core["cpu_seconds_total"], label))
    return "".join(parts)
