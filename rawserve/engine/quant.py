"""Quantized linear weights on a CPU: per-output-channel int8 and group-wise int4, made as a checkpoint loads,
and their matmul through torch's own kernels (no extension). Knows matrices and kernels, not models.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

log = logging.getLogger("rawserve.engine")

# _convert_weight_to_int4pack_for_cpu refuses other shapes: "expect N to be dividable by 16", and a group
# never straddles two rows' worth of K.
INT4_N_MULTIPLE = 16
# Rows quantized at a time: the float temporaries stay in cache (1-3 MB at 0.6B's widths) whatever the matrix
# (a 152k-row LM head included), so each pass over them is cheap. A multiple of 64: the int4 packer lays out
# blocks of 64 rows, so packed chunks concatenate exactly.
CHUNK_ROWS = 256


class QuantError(ValueError):
    """--quantization cannot run here (a kernel torch lacks, or a device it has none for)."""


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """Which kernels a process uses, settled once at start by probe_plan (see there for why)."""
    scheme: str  # int8 | int4
    group_size: int  # int4 only
    int8_kernel: str  # w8a8 (torch.ops.quantized dynamic) | int8 (weight-only _weight_int8pack_mm): int8 and the int4 head
    reduce_range: bool  # w8a8: 7-bit activations, for CPUs whose int8 dot product saturates (no VNNI)

    def describe(self) -> str:
        int8 = (f"dynamic W8A8 (quantized::linear_dynamic{', reduce_range' if self.reduce_range else ''})"
                if self.int8_kernel == "w8a8" else "weight-only int8 (_weight_int8pack_mm, bf16 activations)")
        if self.scheme == "int8":
            return f"int8 per-channel, {int8}"
        return (f"int4 group {self.group_size} weight-only (_weight_int4pack_mm_for_cpu, bf16 activations); "
                f"LM head int8 {int8}")


class QuantizedLinear:
    """One quantized [out_features, in_features] matrix and the kernel that multiplies by it.

    Holds one packed form only: the kernels win at every batch size they were measured at (bench/quant.py),
    so a second form for another size would double the bytes for no gain.
    """
    __slots__ = ("kernel", "out_features", "in_features", "group_size", "weight", "scales", "reduce_range",
                 "num_bytes")

    def __init__(self, kernel: str, out_features: int, in_features: int, weight: object,
                 scales: torch.Tensor | None, num_bytes: int, group_size: int = 0, reduce_range: bool = False):
        self.kernel = kernel
        self.out_features, self.in_features = out_features, in_features
        self.weight, self.scales = weight, scales
        self.num_bytes, self.group_size, self.reduce_range = num_bytes, group_size, reduce_range

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[M, in] at any float dtype -> [M, out] at x's dtype."""
        # Each cast and copy only where needed: at one decode row a step makes over a hundred of these calls,
        # and every no-op call still costs its dispatch.
        if self.kernel == "w8a8":  # quantizes x per tensor on the fly; float32 in and out
            y = torch.ops.quantized.linear_dynamic(_as(x, torch.float32), self.weight, self.reduce_range)
        elif self.kernel == "int8":  # float32 activations take a slow path (cpu-kernels.md): bf16 in
            y = torch.ops.aten._weight_int8pack_mm(_as(x, torch.bfloat16), self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(_as(x, torch.bfloat16), self.weight, self.group_size,
                                                           self.scales)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x at `dtype`, contiguous: x itself when it is both already."""
    if x.dtype != dtype:
        x = x.to(dtype)
    return x if x.is_contiguous() else x.contiguous()


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return out_features % INT4_N_MULTIPLE == 0 and in_features % group_size == 0


def quantized_bytes(plan: QuantPlan, out_features: int, in_features: int, *, head: bool = False) -> int | None:
    """Bytes the quantized form of an [out, in] matrix holds, or None when this plan keeps it dense."""
    n, k = out_features, in_features
    if plan.scheme == "int4" and not head:
        if not int4_fits(n, k, plan.group_size):
            return None
        return n * k // 2 + (k // plan.group_size) * n * 2 * 2  # nibbles + bf16 (scale, zero) per group
    # int8 values + a float32 scale (w8a8 adds fbgemm's int32 column offsets) per row
    return n * k + n * (8 if plan.int8_kernel == "w8a8" else 2)


def _int8_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row: [N, K] float -> int8 [N, K] in -127..127, float32 scales [N]."""
    n, k = weight.shape
    q, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n)
    for start in range(0, n, CHUNK_ROWS):
        w = weight[start:start + CHUNK_ROWS].to(torch.float32, copy=True)  # worked on in place
        chunk_scales = w.abs().amax(dim=1).div_(127).clamp_(min=1e-10)
        # |w| <= 127 * scale row by row, so rounding stays in -127..127 (an all-zero row keeps a usable scale)
        q[start:start + CHUNK_ROWS] = w.div_(chunk_scales[:, None]).round_()
        scales[start:start + CHUNK_ROWS] = chunk_scales
    return q, scales


def quantize_int8(weight: torch.Tensor, plan: QuantPlan) -> QuantizedLinear:
    n, k = weight.shape
    q, scales = _int8_values(weight)
    if plan.int8_kernel == "w8a8":
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; probe_plan notices their removal
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros(n, dtype=torch.int64), 0)
            packed = torch.ops.quantized.linear_prepack(qweight, None)
        return QuantizedLinear("w8a8", n, k, packed, None, quantized_bytes(plan, n, k, head=True),
                               reduce_range=plan.reduce_range)
    return QuantizedLinear("int8", n, k, q, scales.to(torch.bfloat16), quantized_bytes(plan, n, k, head=True))


def quantize_int4(weight: torch.Tensor, plan: QuantPlan) -> QuantizedLinear:
    """Asymmetric per group of `group_size` inputs, in the layout torch's int4pack kernels read:
    w = (q - 8) * scale + zero with q in 0..15, and (scale, zero) as [K / group, N, 2] bf16."""
    n, k = weight.shape
    g = plan.group_size
    packed, scale_zeros = [], []
    for start in range(0, n, CHUNK_ROWS):
        w = weight[start:start + CHUNK_ROWS].to(torch.float32, copy=True)  # worked on in place
        rows = w.shape[0]
        w = w.view(rows, k // g, g)
        low, high = torch.aminmax(w, dim=-1)  # [rows, K/g]
        scales = ((high - low) / 15).clamp_(min=1e-10)
        q = w.sub_(low[..., None]).div_(scales[..., None]).round_().clamp_(0, 15).to(torch.int32).view(rows, k)
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # uint8 [rows, K/2]
        scale_zeros.append(torch.stack([scales, low + scales * 8], dim=-1).transpose(0, 1).to(torch.bfloat16))
    packed, scale_zeros = torch.cat(packed), torch.cat(scale_zeros, dim=1).contiguous()  # [K/g, N, 2]
    return QuantizedLinear("int4", n, k, packed, scale_zeros, quantized_bytes(plan, n, k), group_size=g)


def quantize(weight: torch.Tensor, plan: QuantPlan, *, head: bool = False) -> QuantizedLinear | None:
    """[out, in] float matrix -> its quantized form, or None when the plan keeps this shape dense.

    head: the LM head, held in int8 under both schemes (its rows are the logits: int4's error there costs
    more than it saves; measured in tests/engine/test_quant.py)."""
    n, k = weight.shape
    if plan.scheme == "int4" and not head:
        return quantize_int4(weight, plan) if int4_fits(n, k, plan.group_size) else None
    return quantize_int8(weight, plan)


def _probe_w8a8() -> bool | None:
    """Whether dynamic W8A8 runs and is right here, and with which reduce_range: None when it is missing or
    wrong, else the reduce_range it needs.

    The ops are private to torch's quantized engine (fbgemm on x86, qnnpack on Arm), so check them rather than
    trust them. Full-range activations against full-range weights overflow the 16-bit pair sums of an AVX2
    (non-VNNI) int8 dot product; that shows as a wrong answer here, and 7-bit activations fix it.
    """
    torch.manual_seed(0)
    weight = torch.full((16, 64), 1.0)
    weight[1::2] = -1.0
    x = torch.rand(4, 64) * 4  # activations quantize to 0..255: the worst case for the pair sums
    expected = x @ weight.T
    plan = QuantPlan("int8", 0, "w8a8", False)
    for reduce_range in (False, True):
        try:
            layer = quantize_int8(weight, plan)
            layer.reduce_range = reduce_range
            out = layer(x)
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            log.info("quantization: dynamic W8A8 is unavailable here (%s)", error)
            return None
        if torch.allclose(out, expected, rtol=0.02, atol=0.05 * float(expected.abs().max())):
            return reduce_range
    log.info("quantization: dynamic W8A8 gives wrong results here; not used")
    return None


def _probe_int4(group_size: int) -> None:
    weight = torch.randn(16, 2 * group_size)
    x = torch.randn(2, 2 * group_size)
    plan = QuantPlan("int4", group_size, "int8", False)
    try:
        out = quantize_int4(weight, plan)(x)
    except (AttributeError, RuntimeError, NotImplementedError) as error:
        raise QuantError(f"--quantization int4: torch {torch.__version__} lacks its CPU int4 kernels ({error})") \
            from None
    if not torch.allclose(out, x @ weight.T, atol=0.25 * float((x @ weight.T).abs().max())):
        raise QuantError("--quantization int4: torch's int4 CPU kernel gives wrong results here")


def probe_plan(scheme: str, group_size: int, device: torch.device) -> QuantPlan:
    """Settle the kernels for --quantization once at start, or raise QuantError saying why it cannot run.

    int8: dynamic W8A8 where it runs and is right (fastest at every batch size measured, bench/quant.py and
    ../shared/notes/cpu-kernels.md), else weight-only int8. int4: torch has one int4 CPU kernel.
    CUDA is refused: torch's CUDA int4/int8 kernels take other layouts, and no test here runs them.
    """
    if device.type != "cpu":
        raise QuantError(f"--quantization {scheme}: only CPU kernels are supported, and the device is "
                         f"{device.type}; use --device cpu or --quantization none")
    if scheme == "int4":
        _probe_int4(group_size)
    reduce_range = _probe_w8a8()
    if reduce_range is None:
        try:
            torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16),
                                               torch.ones(16, 32, dtype=torch.int8), torch.ones(16, dtype=torch.bfloat16))
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            raise QuantError(f"--quantization {scheme}: torch {torch.__version__} has no usable int8 CPU kernel "
                             f"({error})") from None
    return QuantPlan(scheme, group_size, "int8" if reduce_range is None else "w8a8", bool(reduce_range))
