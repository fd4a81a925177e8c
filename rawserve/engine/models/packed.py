"""oneDNN pre-packed CPU matmuls: a weight re-laid once in oneDNN's blocked format (pack), then run through the
private linear op torch.compile uses for CPU linears (packed_linear). Every model's matmul owners go through
these, so the private ops are named in one place and probed in one place (cpu_prepack_supported)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the same matrix in oneDNN's pre-packed layout (a copy; the caller drops the dense one)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ packed.T (+ bias), as F.linear would give on the dense weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def cpu_prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold this dtype's weights pre-packed for CPU matmuls (float32 and bfloat16).

    A private op, so probe it rather than trust it. bf16 pre-packed is the fast bf16 path (2-3x F.linear's bf16
    at one row on an AVX512-BF16 CPU), and needs the same probe: a build without oneDNN's bf16 kernels raises,
    or returns wrong values.
    """
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        out = packed_linear(torch.ones(2, 8, dtype=dtype), pack(torch.ones(8, 8, dtype=dtype)))
        return out.dtype == dtype and bool(torch.equal(out.float(), torch.full((2, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


class PackedLinears(nn.Module):
    """Matmuls by weight name (a parameter of this module): pre-packed once on a CPU (prepack_names), else
    F.linear on the dense weight."""

    def __init__(self) -> None:
        super().__init__()
        self.packed: dict[str, torch.Tensor] = {}  # name -> pre-packed weight (CPU only)

    def prepack_names(self, names: Iterable[str]) -> None:
        """Pack each named weight and free its dense copy (packed, a CPU linear runs 2-4x faster at 1-512 rows:
        the weight is no longer re-laid on every call)."""
        for name in names:
            param = getattr(self, name)
            self.packed[name] = pack(param.detach())
            param.data = torch.empty(0, dtype=param.dtype)

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed = self.packed.get(name)
        if packed is not None:
            return packed_linear(x, packed, bias)
        return F.linear(x, getattr(self, name), bias)
