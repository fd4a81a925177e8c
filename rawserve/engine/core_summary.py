"""The core's half of the startup summary (describe_core): what only the built core knows about itself, sent in
its READY message. Core side: called in the core's thread or process, never by the frontend.
"""
from __future__ import annotations

from typing import Any

from rawserve.engine.cpu_budget import ThreadPlan


def describe_core(core: Any) -> dict:
    """What the startup summary needs that only the core knows: the resolved device and dtype, the parameter
    count, the block size, the KV pool's bytes and why it has that size. Read defensively: a test's fake core has
    none of it."""
    runner = getattr(core, "runner", None)
    out: dict = {}
    if runner is not None:
        if getattr(runner, "device", None) is not None:
            out["device"] = str(runner.device)
        if getattr(runner, "dtype", None) is not None:
            out["dtype"] = str(runner.dtype).removeprefix("torch.")
        if isinstance(getattr(runner, "kv_dtype_name", None), str):  # --kv-cache-dtype resolved (auto: --dtype's)
            out["kv_cache_dtype"] = runner.kv_dtype_name
        model = getattr(runner, "model", None)
        if model is not None and hasattr(model, "parameters"):
            out["num_params"] = getattr(model, "num_params", None) or sum(p.numel() for p in model.parameters())
        if getattr(runner, "quant", None) is not None:
            out["quantization"] = runner.quant.describe()
    threads = getattr(core, "threads", None)
    if isinstance(threads, ThreadPlan):  # the count torch reported after applying it, and why
        out["num_threads"], out["threads_reason"] = threads.num_threads, threads.reason
    if isinstance(getattr(core, "block_size", None), int):
        out["block_size"] = core.block_size
    plan = getattr(runner, "kv_plan", None)
    if plan is not None:
        out["kv_cache_bytes"], out["kv_cache_reason"] = plan.kv_bytes, plan.reason
    return out
