"""`--dtype auto` on a CPU: time the model's own matmul shape in float32 and bfloat16 and keep the faster.

CPU flags alone mislead: a CPU without AVX512-BF16/AMX emulates bf16 matmuls at a fraction of float32's speed,
and one with them may still lose when oneDNN's bf16 kernels are missing from the torch build.
"""
from __future__ import annotations

import dataclasses
import pathlib
import platform
import time

import torch
import torch.nn.functional as F

from rawserve.engine.models.packed import cpu_prepack_supported, pack, packed_linear

_PROBE_ROWS = (1, 32)  # a decode step at one stream and at a busy batch
_PROBE_BYTES = 24 << 20  # float32 weight bytes cycled through per timing: more than a small VM's L3 share
_MATRIX_BYTES = 12 << 20  # at most this per probed matrix (float32): a call long enough to time above its overhead
_MAX_COPIES = 16  # a small model's matrices: enough to leave the caches, few enough to stay well under a second
_REPS = 4


def cpu_has_native_bf16() -> bool:
    """True when this CPU does bf16 arithmetic in hardware (AVX512-BF16, AMX, or Arm's BF16 extension)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        # No /proc (macOS): Apple silicon since M2 has BF16; Intel Macs do not.
        return platform.machine() == "arm64"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@dataclasses.dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # for the startup log
    timings: dict[torch.dtype, dict[int, float]] | None = None  # the probe's best ms per call, by dtype and rows


def _matmul_ms(dtypes: tuple[torch.dtype, ...], out_features: int, in_features: int, rows: tuple[int, ...]
               ) -> dict[torch.dtype, dict[int, float]]:
    """Best ms per call of y = x W^T with W [out, in] at each dtype, pre-packed when oneDNN can, for each row
    count. The calls cycle through enough distinct weights that they are read from memory, as a model's are,
    and the dtypes take turns rep by rep, so a busy neighbour slows both alike rather than whichever ran then."""
    copies = min(_MAX_COPIES, max(2, _PROBE_BYTES // (out_features * in_features * 4)))
    runs = {}
    for dtype in dtypes:
        packs = cpu_prepack_supported(dtype)
        weights = []
        for _ in range(copies):  # one dense weight at a time, so the probe's peak stays near its weights' bytes
            w = torch.randn(out_features, in_features).to(dtype)
            weights.append(pack(w) if packs else w)
        runs[dtype] = (packs, weights)

    def one_pass(dtype: torch.dtype, x: torch.Tensor) -> float:
        packs, weights = runs[dtype]
        start = time.perf_counter()
        for w in weights:
            if packs:
                packed_linear(x, w)
            else:
                F.linear(x, w)
        return (time.perf_counter() - start) / len(weights) * 1e3

    best = {dtype: {m: float("inf") for m in rows} for dtype in dtypes}
    inputs = {(dtype, m): torch.randn(m, in_features).to(dtype) for dtype in dtypes for m in rows}
    for (dtype, m), x in inputs.items():  # first calls: oneDNN builds its primitives
        one_pass(dtype, x)
    for _ in range(_REPS):
        for (dtype, m), x in inputs.items():
            best[dtype][m] = min(best[dtype][m], one_pass(dtype, x))
    return best


def probe_shape(hidden_size: int, intermediate_size: int, vocab_size: int, num_layers: int) -> tuple[int, int]:
    """The [out, in] matrix to time: the kind that carries most of a decode step's weight bytes (the layers'
    fused gate/up matrices, or a small model's LM head: 2 layers under a 152k vocabulary read 97% of their bytes
    in the head, whose 256-wide rows a 1,536 x 256 gate/up matrix says nothing about), its rows cut to
    _MATRIX_BYTES: a matrix-vector product's speed per byte hardly depends on how many rows it has."""
    gate_up = (2 * intermediate_size, hidden_size)
    out_features, in_features = (vocab_size, hidden_size) if vocab_size > num_layers * gate_up[0] else gate_up
    return min(out_features, max(1, _MATRIX_BYTES // (4 * in_features))), in_features


@torch.inference_mode()
def probe_cpu_dtype(checkpoint_dtype: torch.dtype, hidden_size: int, intermediate_size: int, vocab_size: int = 0,
                    num_layers: int = 1) -> DtypeChoice:
    """float32, or bfloat16 for a bf16 checkpoint when bf16 measures faster at both row counts.

    A float32 or float16 checkpoint stays float32: bf16 would change its numbers, which auto must not do."""
    if checkpoint_dtype != torch.bfloat16:
        return DtypeChoice(torch.float32, f"the checkpoint is {str(checkpoint_dtype).removeprefix('torch.')}; "
                                          "float32 holds its values exactly")
    shape = probe_shape(hidden_size, intermediate_size, vocab_size, num_layers)
    timed = _matmul_ms((torch.float32, torch.bfloat16), *shape, _PROBE_ROWS)
    f32, bf16 = timed[torch.float32], timed[torch.bfloat16]
    native = "native bf16" if cpu_has_native_bf16() else "no native bf16 in the CPU flags"
    timings = ", ".join(f"{m} rows {bf16[m]:.2f} vs {f32[m]:.2f} ms" for m in _PROBE_ROWS)
    faster = all(bf16[m] < f32[m] for m in _PROBE_ROWS)
    dtype = torch.bfloat16 if faster else torch.float32
    verdict = "bfloat16 is faster" if faster else "bfloat16 is not faster at every size"
    return DtypeChoice(dtype, f"bf16 checkpoint, probe of a {shape[0]}x{shape[1]} matmul, bf16 vs float32: "
                              f"{timings} ({verdict}; {native})", timed)
