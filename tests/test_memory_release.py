"""Memory a burst leaves behind: a spawned core hands its heap back once it goes idle, and starts no helper process."""
from __future__ import annotations

import os
import sys
import pathlib
import time

import pytest

from tests.test_memory import burst, container_checkpoint

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc")


def status_kib(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is `pid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                out[int(entry)] = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def settled_rss_kib(pid: int, timeout_s: float = 6.0) -> int:
    """The process's RSS once two readings half a second apart agree within 1 MiB (or the last one)."""
    deadline = time.monotonic() + timeout_s
    last = status_kib(pid, "VmRSS")
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = status_kib(pid, "VmRSS")
        if abs(now - last) < 1024:
            return now
        last = now
    return last


def test_a_spawned_core_gives_a_burst_back_and_runs_no_resource_tracker(tmp_path):
    from tests.test_cli import Server

    model_dir = container_checkpoint(tmp_path, "float32")  # 2 layers, hidden 256, a 152k vocabulary
    command = [sys.executable, "-m", "rawserve", "serve", str(model_dir), "--port", "0",
               "--engine-mode", "process", "--no-log-requests", "--dtype", "float32", "--max-num-seqs", "32",
               "--max-model-len", "256"]
    with Server(command) as server:
        helpers = children(server.proc.pid)
        # The core alone: multiprocessing's resource tracker (a second interpreter, ~15 MiB) is not started.
        assert len(helpers) == 1, helpers
        core = next(iter(helpers))
        idle = settled_rss_kib(core)
        assert burst(server.port) == [(200, ["length"], 48)] * 32
        end = status_kib(core, "VmRSS")  # the burst's last step is just over: the release is HEAP_RELEASE_IDLE_S away
        peak = status_kib(core, "VmHWM")
        after = settled_rss_kib(core)
        print(f"core RSS idle {idle / 1024:.0f} MiB, burst peak {peak / 1024:.0f}, at its end {end / 1024:.0f}, "
              f"settled {after / 1024:.0f}")
        assert peak - idle > 40 * 1024  # the burst's steps did hold vocabulary-sized rows and activations
        # What the steps freed goes back to the kernel (without the release the core stays at `end` for good). The
        # rest above idle is in use, not free: ~40 MiB of heap that the first burst allocates and later ones reuse.
        assert end - after > 10 * 1024, (idle, peak, end, after)
        assert children(server.proc.pid).keys() == {core}
