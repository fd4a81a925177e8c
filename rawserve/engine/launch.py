"""How the frontend starts the core without importing it: the core's factory and the core loop's entry point.

Seam: importing this loads no torch and no core module; each callable imports the core inside the call, on the
core's side of the boundary (its thread, or its spawned process). Both are picklable by reference.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rawserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class CoreFactory:
    """`CoreFactory(config)()` is `EngineCore(config)`; it pickles as its config alone."""
    config: EngineConfig

    def __call__(self) -> Any:
        from rawserve.engine.core import make_engine_core

        return make_engine_core(self.config)


def run_core_loop(factory: Callable[[], Any], inputs: Any, outputs: Any) -> None:
    """The core thread's or process's target: engine/core_loop.py's run_core."""
    from rawserve.engine.core_loop import run_core

    run_core(factory, inputs, outputs)
