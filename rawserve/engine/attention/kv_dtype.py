"""The KV cache's storage dtype (--kv-cache-dtype): which torch dtype a name stores, and the cast on write.

Both backends store K/V in it and compute attention in the activation dtype; nothing here knows a model.
"""
from __future__ import annotations

import torch

_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_dtype(name: str, activation_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's torch dtype: auto is the activation dtype (config.py validated the name)."""
    return activation_dtype if name == "auto" else _BY_NAME[name]


def name_of(dtype: torch.dtype) -> str:
    """The flag's name for a storage dtype (float32 for an auto cache of a float32 model)."""
    return {v: k for k, v in _BY_NAME.items()}.get(dtype, str(dtype).removeprefix("torch."))


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype.is_floating_point


def saturation(dtype: torch.dtype) -> float:
    """The largest finite value an fp8 cache stores; 0.0 (no clamp) for the 16- and 32-bit dtypes."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype. fp8 is unscaled (scale 1.0, vLLM's default without calibration) and saturating:
    values past the format's largest are clamped to it, as vLLM's conversion does, rather than becoming NaN
    (e4m3fn has no infinity) or inf (e5m2)."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        top = saturation(dtype)
        return x.clamp(-top, top).to(dtype)
    return x.to(dtype)
