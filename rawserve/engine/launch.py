"""How the frontend starts the core without importing it: the core's factory, the core loop's entry point, and the
spawn context that starts it (spawn_context).

Seam: importing this loads no torch and no core module; each callable imports the core inside the call, on the
core's side of the boundary (its thread, or its spawned process). Both are picklable by reference.
"""
from __future__ import annotations

import gc
import io
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing import context as mp_context
from multiprocessing import popen_spawn_posix, spawn, util
from dataclasses import dataclass
from typing import Any

from rawserve.config import EngineConfig
from rawserve.engine.cpu_budget import ThreadPlan, plan_threads
from rawserve.logs import ignore_torch_numpy_warning


@dataclass(frozen=True, slots=True)
class CoreFactory:
    """`CoreFactory(config)()` is `EngineCore(config)` running on `threads`; it pickles as its config, log level
    and thread plan alone.

    `log_level` is the server's --log-level, for a spawned core to set up its own logging with. `threads` is
    planned where the factory is made (the server's process, whose CPUs and environment a spawned core
    inherits), so the core applies the plan and its reason as the launcher saw them.
    """
    config: EngineConfig
    log_level: str = "info"
    threads: ThreadPlan | None = None

    def __post_init__(self) -> None:
        if self.threads is None:
            object.__setattr__(self, "threads", plan_threads(self.config.num_threads))

    def __call__(self) -> Any:
        ignore_torch_numpy_warning()  # the core's first torch import, in its thread or process, is the next line
        from rawserve.engine.core import make_engine_core

        return make_engine_core(self.config, self.threads)


def kv_capacity(info: dict) -> dict[str, int]:
    """The KV pool's {"tokens", "bytes"} from the core's READY info (what it knows of them)."""
    out = {}
    if isinstance(info.get("num_blocks"), int) and isinstance(info.get("block_size"), int):
        out["tokens"] = info["num_blocks"] * info["block_size"]
    if isinstance(info.get("kv_cache_bytes"), int):
        out["bytes"] = info["kv_cache_bytes"]
    return out


class _UntrackedPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn, less the resource tracker it starts for every child.

    spawn's Popen starts (once per parent) a second interpreter, ~15 MiB resident, that unlinks the named
    semaphores and shared memory a process leaves behind, and hands every child its descriptor. The core's pipe
    transport uses neither. A process that does create one (a Queue, for the queue transport; the guided
    decoding pool) still gets a tracker: multiprocessing starts one on the first registration, in that process.
    This is CPython's _launch (3.10-3.13, see spawn_context) with tracker_fd=None, which the child's spawn_main
    takes as "none yet".
    """

    def _launch(self, process_obj: multiprocessing.process.BaseProcess) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            mp_context.reduction.dump(prep_data, fp)
            mp_context.reduction.dump(process_obj, fp)  # the Process args' pipe ends join self._fds here
        finally:
            mp_context.set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=None, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _UntrackedProcess(mp_context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: multiprocessing.process.BaseProcess) -> _UntrackedPopen:
        return _UntrackedPopen(process_obj)


class _UntrackedSpawnContext(mp_context.SpawnContext):
    Process = _UntrackedProcess


def spawn_context() -> mp_context.BaseContext:
    """The spawn context a core process starts from: multiprocessing's, without a resource tracker (_UntrackedPopen),
    on the CPython versions whose private _launch it copies; elsewhere multiprocessing's own, tracker and all."""
    if sys.implementation.name != "cpython" or not (3, 10) <= sys.version_info[:2] <= (3, 13):
        return multiprocessing.get_context("spawn")
    return _UntrackedSpawnContext()


def run_core_loop(factory: Callable[[], Any], inputs: Any, outputs: Any) -> None:
    """The core thread's or process's target: engine/core_loop.py's run_core.

    A spawned process starts with no logging handlers, so without this its lines (load progress, a
    fatal step's traceback) would be lost; a thread shares the server's logging and sets up nothing.
    """
    if multiprocessing.parent_process() is not None:
        from rawserve.logs import setup_logging

        setup_logging(getattr(factory, "log_level", "info"))
    from rawserve.engine.core_loop import run_core

    try:
        run_core(factory, inputs, outputs)
    finally:
        # EngineCore froze all it found alive (gc.freeze, core.py) for the core's lifetime, which ends here. Frozen
        # objects are never freed at interpreter exit, and triton's bindings (the triton backend) would print a
        # `nanobind: leaked ...` line for each one they still hold as the process ends.
        gc.unfreeze()
