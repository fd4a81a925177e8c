"""Paged attention backends: `torch` (portable) and `triton` (kernels; on CPU only under triton's interpreter)."""
from __future__ import annotations

import types


def get_backend(name: str) -> types.ModuleType:
    """The backend module by --attention-backend name: it exposes write_kv and paged_attention.

    Imported on demand, so the torch backend never loads triton.
    """
    if name == "triton":
        from rawserve.engine.attention import triton_backend

        return triton_backend
    from rawserve.engine.attention import torch_backend

    return torch_backend
