"""LoraRegistry: the adapters requests may name, loaded at start or at run time, counted per request, dropped on unload.

Core side, beside the scheduler's LoraSlots (which adapter is resident where). It never steps the model: run-time
reads go to reader threads with a deadline, and the core loop collects them with `finished_loads()`.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from rawserve.config import EngineConfig
from rawserve.engine.loader import ModelConfig
from rawserve.engine.lora import LoraAdapter, LoraError, read_adapter
from rawserve.engine.scheduler import Scheduler

log = logging.getLogger("rawserve.engine.lora")

# Reads alive at once, stuck ones included: a load past its deadline is answered at once, but its thread lives until
# the read returns, so this bounds what stuck reads can hold while later loads still get threads of their own.
MAX_READS = 4


class LoraRefused(ValueError):
    """A run-time load or unload the registry will not do. `code` says why, for the frontend's answer:
    "name" (the name is taken, being loaded or unloaded), "disabled" (no runtime updating, or no LoRA at all),
    "busy" (MAX_READS reads alive), "timeout" (the read ran past --lora-load-timeout-s)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Read:
    token: int  # the frontend's, answered by LORA_DONE
    name: str
    future: Future
    deadline: float  # time.monotonic()


class LoraRegistry:
    """Adapters by name (on the CPU), their users, and the reads in flight.

    `load` is the operator's (--lora-modules, the offline LLM): read now, any path. `start_load` is a client's: only
    with --allow-runtime-lora-updating, only under --lora-root, on a reader thread, failed after the deadline.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, scheduler: Scheduler, *, is_enabled: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.is_enabled = is_enabled  # the runner reserved LoRA slots
        self.allows_runtime_updates = is_enabled and config.allow_runtime_lora_updating
        self.root = os.path.realpath(config.lora_root) if config.lora_root is not None else None
        self.load_timeout_s = config.lora_load_timeout_s
        self._model_config = model_config
        self._max_rank = config.max_lora_rank
        self._max_loras = config.max_loras
        self._scheduler = scheduler
        self._clock = clock
        self.adapters: dict[str, LoraAdapter] = {}
        self._users: dict[str, int] = {}  # adapter -> unfinished requests using it
        # adapter -> which load it is: a name unloaded and loaded again from other weights must not share
        # prefix-cache blocks with its old self, so the cache key carries this
        self._load_ids: dict[str, int] = {}
        self._num_loads = itertools.count()
        self._unloading: set[str] = set()  # unloaded while in use: dropped when its last request ends
        self._loading: set[str] = set()  # being read at run time
        self._reads: list[_Read] = []
        self._lock = threading.Lock()  # guards _num_readers, which reader threads decrement
        self._num_readers = 0

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def __getitem__(self, name: str) -> LoraAdapter:
        return self.adapters[name]

    def names(self) -> list[str]:
        """The adapters a new request may ask for (not those being unloaded)."""
        return [name for name in self.adapters if name not in self._unloading]

    def paths(self) -> dict[str, str]:
        """The adapters a request may ask for: {name: directory}."""
        return {name: self.adapters[name].path for name in self.names()}

    # ----- loading

    def load(self, name: str, path: str) -> None:
        """Read, check and register an adapter now (LoraError naming what is wrong): the operator's adapters."""
        self._check_loadable(name)
        self._register(name, read_adapter(name, path, self._model_config, self._max_rank))

    def check_runtime_updates(self) -> None:
        """LoraRefused("disabled") unless clients may load and unload adapters."""
        if not self.allows_runtime_updates:
            raise LoraRefused("lora: runtime adapter updates are off (--allow-runtime-lora-updating)", "disabled")

    def start_load(self, token: int, name: str, path: str) -> None:
        """Start reading a client's adapter on a thread of its own, so the steps go on meanwhile (a 0.6B model's
        rank-64 adapter is ~80 MB: hundreds of ms of decode stalled for every running request if read here).

        The name is taken until `finished_loads` answers `token`. Raises LoraRefused when the load cannot start.
        """
        self.check_runtime_updates()
        self._check_loadable(name)
        with self._lock:
            if self._num_readers >= MAX_READS:
                raise LoraRefused(f"lora: {MAX_READS} adapter reads are in progress (or stuck); try again later",
                                  "busy")
            self._num_readers += 1
        deadline = self._clock() + self.load_timeout_s
        future: Future = Future()
        # A daemon thread, not an executor's: a read stuck in the kernel must neither hold later loads behind it
        # nor keep the process alive at exit (an executor's workers are joined then).
        thread = threading.Thread(target=self._read, args=(future, name, path, deadline), daemon=True,
                                  name=f"lora-reader-{token}")
        self._loading.add(name)
        self._reads.append(_Read(token, name, future, deadline))
        thread.start()

    def _read(self, future: Future, name: str, path: str, deadline: float) -> None:
        try:
            future.set_result(read_adapter(name, path, self._model_config, self._max_rank, root=self.root,
                                           deadline=deadline))
        except Exception as error:  # noqa: BLE001 - any failure is the load's, answered by finished_loads
            future.set_exception(error)
        finally:
            with self._lock:
                self._num_readers -= 1

    @property
    def has_pending_loads(self) -> bool:
        return bool(self._reads)

    def finished_loads(self) -> list[tuple[int, str | None, str | None]]:
        """(token, error or None, code) for each run-time read that has finished (registered, or its error: code
        "bad" for an adapter that cannot be loaded) or run past its deadline (code "timeout"; its thread's result,
        when it comes, is dropped). The others stay pending."""
        done: list[tuple[int, str | None, str | None]] = []
        now = self._clock()
        for read in list(self._reads):
            if read.future.done():
                self._reads.remove(read)
                self._loading.discard(read.name)
                error = read.future.exception()
                if error is None:
                    self._register(read.name, read.future.result())
                    done.append((read.token, None, None))
                elif isinstance(error, LoraError):
                    done.append((read.token, str(error), "bad"))
                else:  # a malformed file must fail its load, never the engine
                    done.append((read.token, f"lora: adapter {read.name!r} could not be read: {error!r}", "bad"))
            elif now >= read.deadline:
                log.warning("lora: reading adapter %r is past its %g s deadline; its thread is left to end",
                            read.name, self.load_timeout_s)
                self._reads.remove(read)
                self._loading.discard(read.name)
                done.append((read.token, f"lora: reading adapter {read.name!r} took more than "
                                         f"{self.load_timeout_s:g} s (--lora-load-timeout-s); the load failed",
                             "timeout"))
        return done

    def _check_loadable(self, name: str) -> None:
        if not self.is_enabled:
            raise LoraRefused("lora: this engine was started without LoRA support (--enable-lora or --lora-modules)",
                              "disabled")
        if name in self._unloading:
            raise LoraRefused(f"lora: adapter {name!r} is being unloaded; its last requests are still running", "name")
        if name in self.adapters:
            raise LoraRefused(f"lora: an adapter named {name!r} is already loaded", "name")
        if name in self._loading:
            raise LoraRefused(f"lora: an adapter named {name!r} is being loaded", "name")

    def _register(self, name: str, adapter: LoraAdapter) -> None:
        self.adapters[name] = adapter
        self._load_ids[name] = next(self._num_loads)

    def close(self) -> None:
        """Drop the reads in flight: their threads end when their reads return, and nothing takes the results."""
        self._reads.clear()
        self._loading.clear()

    # ----- unloading and users

    def unload(self, name: str) -> None:
        """Refuse new requests for the adapter now; drop it once its last request ends (KeyError: unknown)."""
        if name not in self.adapters or name in self._unloading:
            raise KeyError(name)
        if self._users.get(name):
            self._unloading.add(name)
        else:
            self._drop(name)

    def _drop(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            self._scheduler.lora_slots.evict(name)

    def load_id(self, name: str) -> int:
        """Which load of `name` a new request runs on (its prefix-cache key); ValueError when none may be asked for."""
        if name not in self.adapters or name in self._unloading:
            raise ValueError(f"lora: no adapter named {name!r} is loaded")
        return self._load_ids.get(name, 0)

    def add_user(self, name: str) -> None:
        self._users[name] = self._users.get(name, 0) + 1

    def drop_user(self, name: str) -> None:
        """A request on `name` ended: the last one lets an unload in waiting drop the adapter."""
        left = self._users[name] - 1
        if left:
            self._users[name] = left
            return
        del self._users[name]
        if name in self._unloading:
            self._unloading.discard(name)
            self._drop(name)

    def stats(self) -> dict:
        """lora_requests_info's labels, as vLLM exposes them: adapters with running and with waiting requests
        ({} without LoRA)."""
        slots = self._scheduler.lora_slots
        if slots is None:
            return {}
        running = set(slots.running_adapters())
        waiting = {entry[3].lora for entry in self._scheduler.waiting if entry[3].lora is not None}
        return {"lora": {"max_lora": self._max_loras, "running": sorted(running), "waiting": sorted(waiting)}}
