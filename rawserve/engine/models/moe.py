"""Mixture-of-experts MLPs: the routers (Qwen's softmax then top-k, gpt-oss's top-k then softmax, Qwen3.5-MoE's
shared expert behind a sigmoid gate) and the experts as matmuls over the tokens sorted by expert, reading only the
experts some token chose. Loads the per-expert, stacked and MXFP4 tensor forms; knows nothing of attention.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rawserve.engine.loader import CheckpointError, ModelConfig, Target, TensorEntry, read_safetensors_header, \
    read_tensor_into
from rawserve.engine.models.packed import PackedLinears, pack, packed_linear
from rawserve.engine.quant import QuantizedLinear, QuantPlan, quantize, quantized_bytes

log = logging.getLogger("rawserve.engine")

# MXFP4's e2m1 code points, low nibble first in each byte (OCP microscaling); a block of 32 shares a power of two.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def route(logits: torch.Tensor, top_k: int, kind: str, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] at the logits' dtype, expert ids [T, k] int64).

    softmax_topk (Qwen): softmax over all experts in float32, the k largest, renormalised to sum 1 when asked.
    topk_softmax (gpt-oss): the k largest logits, then a softmax over those k only."""
    if kind == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return values.softmax(dim=-1), ids
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    values, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), ids


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 [..., G, 16] uint8 (two e2m1 values a byte, low nibble first) with [..., G] uint8 exponents (bias 127)
    -> [..., G * 32] at `dtype`: each value times 2^(scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack((lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def _sub_entry(entry: TensorEntry, index: int) -> TensorEntry:
    """Row `index` of a stacked tensor's first dimension as an entry of its own (read without the rest)."""
    size = entry.num_bytes // entry.shape[0]
    return TensorEntry(f"{entry.name}[{index}]", entry.file, entry.dtype, entry.shape[1:], entry.offset + index * size,
                       size)


def _read(entry: TensorEntry, f, shape: tuple[int, ...]) -> torch.Tensor:
    if entry.shape != shape:
        raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {entry.shape}, expected {shape}")
    out = torch.empty(shape, dtype=entry.dtype)
    read_tensor_into(entry, f, out)
    return out


class Experts(nn.Module):
    """E experts' weights stacked, [E, 2I, H] (gate rows, then up rows) and [E, H, I], with optional biases, or
    after --quantization each expert's two matrices quantized (and the stacks empty).

    forward sorts the (token, choice) pairs by expert and runs each chosen expert once over its rows: the loop is
    over the experts in use, never over tokens or over all experts; at one token it is the k chosen ones."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.inter = moe.num_experts, moe.top_k, moe.expert_intermediate_size
        self.hidden = cfg.hidden_size
        self.activation_kind, self.alpha, self.limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        e, i, h = self.num_experts, self.inter, self.hidden
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False) \
            if moe.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False) if moe.expert_bias else None
        self.quant: list[tuple[QuantizedLinear, QuantizedLinear]] | None = None  # per expert (gate_up, down)
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per expert, oneDNN's layout (prepack)
        self.quant_plan: QuantPlan | None = None
        self._staged: dict[int, list] = {}  # expert -> [gate_up fp32, down fp32, parts still to come] (quantizing)
        self._mxfp4: dict[str, torch.Tensor] = {}  # a blocks/scales tensor waiting for its other half

    # ---- loading -------------------------------------------------------------------------------------------------

    def defer_quantized(self, plan: QuantPlan) -> set[int]:
        """Quantize each expert as its tensors arrive; the stacks are never allocated dense. Returns the ids of the
        parameters to leave on meta (DecoderModel.deferred)."""
        self.quant_plan = plan
        self.quant = [None] * self.num_experts
        return {id(self.gate_up), id(self.down)}

    def _put(self, expert: int, part: str, rows: slice | None, value: torch.Tensor) -> None:
        """One expert's gate_up (rows of it) or down arrives: into the stack, or staged and quantized when whole."""
        if self.quant_plan is None:
            target = self.gate_up[expert] if part == "gate_up" else self.down[expert]
            (target if rows is None else target[rows]).copy_(value)
            return
        i, h = self.inter, self.hidden
        staged = self._staged.get(expert)
        if staged is None:
            staged = self._staged[expert] = [torch.empty(2 * i, h), torch.empty(h, i), 2 * i + h]
        dense = staged[0] if part == "gate_up" else staged[1]
        (dense if rows is None else dense[rows]).copy_(value)
        staged[2] -= dense.shape[0] if rows is None else rows.stop - rows.start
        if staged[2] == 0:
            del self._staged[expert]
            self.quant[expert] = (self._quantize(staged[0]), self._quantize(staged[1]))

    def _quantize(self, dense: torch.Tensor) -> QuantizedLinear:
        quantized = quantize(dense, self.quant_plan)
        if quantized is None:  # int4 refuses this shape: int8 then, which takes every shape
            quantized = quantize(dense, QuantPlan("int8", 0, self.quant_plan.int8_kernel,
                                                  self.quant_plan.reduce_range), head=True)
        return quantized

    def targets(self, prefix: str, names: set[str]) -> dict[str, Target]:
        """Checkpoint tensor -> fill, for whichever form `names` (the checkpoint's tensor names) holds: per expert
        (experts.N.gate_proj/up_proj/down_proj.weight), stacked [E, 2I, H] / [E, H, I] (transformers' own), or
        gpt-oss's [E, H, 2I] interleaved gate/up and [E, I, H] down, in bf16 or as MXFP4 blocks and scales."""
        p = f"{prefix}.experts"
        e, i, h = self.num_experts, self.inter, self.hidden
        if self.activation_kind == "gpt_oss":
            return self._gpt_oss_targets(p, names)
        if f"{p}.gate_up_proj" in names:
            return {f"{p}.gate_up_proj": self._stacked("gate_up", (e, 2 * i, h)),
                    f"{p}.down_proj": self._stacked("down", (e, h, i))}
        t: dict[str, Target] = {}
        for x in range(e):
            t[f"{p}.{x}.gate_proj.weight"] = self._one(x, "gate_up", slice(0, i), (i, h))
            t[f"{p}.{x}.up_proj.weight"] = self._one(x, "gate_up", slice(i, 2 * i), (i, h))
            t[f"{p}.{x}.down_proj.weight"] = self._one(x, "down", None, (h, i))
        return t

    def _read_as_is(self, entry: TensorEntry, f, expert: int, part: str, rows: slice | None,
                    shape: tuple[int, ...]) -> None:
        """A tensor that needs no transform: straight into its rows of the stack (read_tensor_into converts the
        dtype), or staged for the quantizer."""
        if entry.shape != shape:
            raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {entry.shape}, expected {shape}")
        if self.quant_plan is not None:
            self._put(expert, part, rows, _read(entry, f, shape))
            return
        target = (self.gate_up if part == "gate_up" else self.down)[expert]
        read_tensor_into(entry, f, target if rows is None else target[rows])

    def _one(self, expert: int, part: str, rows: slice | None, shape: tuple[int, ...]) -> Target:
        return lambda entry, f: self._read_as_is(entry, f, expert, part, rows, shape)

    def _stacked(self, part: str, shape: tuple[int, ...]) -> Target:
        def fill(entry: TensorEntry, f) -> None:
            if entry.shape != shape:
                raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {entry.shape}, expected {shape}")
            for x in range(shape[0]):  # one expert at a time: no second copy of the whole stack
                self._read_as_is(_sub_entry(entry, x), f, x, part, None, shape[1:])
        return fill

    def _gpt_oss_targets(self, p: str, names: set[str]) -> dict[str, Target]:
        e, i, h = self.num_experts, self.inter, self.hidden

        def gate_up_rows(w: torch.Tensor) -> torch.Tensor:  # [2I, ...] interleaved (gate, up, gate, ...) -> split
            return torch.cat((w[0::2], w[1::2]))

        def bias(part: str, width: int, interleaved: bool) -> Target:
            def fill(entry: TensorEntry, f) -> None:
                value = _read(entry, f, (e, width))
                target = self.gate_up_bias if part == "gate_up" else self.down_bias
                target.copy_(torch.cat((value[:, 0::2], value[:, 1::2]), dim=1) if interleaved else value)
            return fill

        t: dict[str, Target] = {f"{p}.gate_up_proj_bias": bias("gate_up", 2 * i, True),
                                f"{p}.down_proj_bias": bias("down", h, False)}
        if f"{p}.gate_up_proj_blocks" in names:  # MXFP4: [E, out, in / 32, 16] blocks and [E, out, in / 32] scales
            for part, out, inp in (("gate_up", 2 * i, h), ("down", h, i)):
                for half in ("blocks", "scales"):
                    t[f"{p}.{part}_proj_{half}"] = self._mxfp4_half(part, half, out, inp, gate_up_rows)
            return t

        def dense(part: str, shape: tuple[int, ...]) -> Target:  # [E, in, out]: transposed to [out, in]
            def fill(entry: TensorEntry, f) -> None:
                if entry.shape != (e, *shape):
                    raise CheckpointError(f"{entry.file}: tensor {entry.name!r} has shape {entry.shape}, expected "
                                          f"{(e, *shape)}")
                for x in range(e):
                    w = _read(_sub_entry(entry, x), f, shape).t()
                    self._put(x, part, None, gate_up_rows(w) if part == "gate_up" else w)
            return fill

        t[f"{p}.gate_up_proj"] = dense("gate_up", (h, 2 * i))
        t[f"{p}.down_proj"] = dense("down", (i, h))
        return t

    def _mxfp4_half(self, part: str, half: str, out: int, inp: int,
                    gate_up_rows: Callable[[torch.Tensor], torch.Tensor]) -> Target:
        """One of an MXFP4 weight's two tensors: kept until the other arrives, then both dequantized an expert at a
        time (no CPU kernel computes on MXFP4 here; load_moe_model logs that they are dequantized)."""
        e, groups = self.num_experts, inp // MXFP4_BLOCK
        shape = (e, out, groups, 16) if half == "blocks" else (e, out, groups)

        def fill(entry: TensorEntry, f) -> None:
            self._mxfp4[f"{part}.{half}"] = _read(entry, f, shape)
            blocks, scales = self._mxfp4.get(f"{part}.blocks"), self._mxfp4.get(f"{part}.scales")
            if blocks is None or scales is None:
                return
            del self._mxfp4[f"{part}.blocks"], self._mxfp4[f"{part}.scales"]
            for x in range(e):
                w = dequantize_mxfp4(blocks[x], scales[x], torch.float32)  # [out, in]
                self._put(x, part, None, gate_up_rows(w) if part == "gate_up" else w)
        return fill

    def prepack(self) -> None:
        """CPU: each expert's two matrices in oneDNN's pre-packed layout, the dense stacks dropped (bench/moe.py
        micro, bf16, one MoE layer of Qwen3-30B-A3B's shape: 1.5x faster at 1 token, 3.4x at 32)."""
        if self.quant is not None:
            return
        self.packed = [(pack(self.gate_up[x].detach()), pack(self.down[x].detach()))
                       for x in range(self.num_experts)]
        self.gate_up.data = torch.empty(0, dtype=self.gate_up.dtype)
        self.down.data = torch.empty(0, dtype=self.down.dtype)

    @property
    def num_quantized(self) -> int:
        return 2 * sum(q is not None for q in self.quant) if self.quant is not None else 0

    def weight_bytes(self, expert: int, part: str) -> int:
        """Bytes of one expert's gate_up or down matrix as its matmul reads it (quantized, packed or dense)."""
        which = 0 if part == "gate_up" else 1
        if self.quant is not None:
            return self.quant[expert][which].num_bytes
        if self.packed is not None:
            w = self.packed[expert][which]
            return w.numel() * w.element_size()
        w = (self.gate_up if part == "gate_up" else self.down)[expert]
        return w.numel() * w.element_size()

    def expert_bytes(self, expert: int) -> int:
        """Bytes of one expert's weights as its matmuls read them (quantized or dense)."""
        return self.weight_bytes(expert, "gate_up") + self.weight_bytes(expert, "down")

    # ---- compute -------------------------------------------------------------------------------------------------
    # Every read of an expert's weights goes through gate_up_proj and down_proj (tests/engine/test_moe_model.py counts
    # them; bench/moe.py sums the bytes they are handed).

    def gate_up_proj(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """[n, H] -> [n, 2I] (gate columns, then up) through expert `index`'s first matrix, its bias added."""
        bias = None if self.gate_up_bias is None else self.gate_up_bias[index]
        if self.quant is not None:
            return self.quant[index][0](x, bias)
        if self.packed is not None:
            return packed_linear(x, self.packed[index][0], bias)
        return F.linear(x, self.gate_up[index], bias)

    def down_proj(self, h: torch.Tensor, index: int) -> torch.Tensor:
        """[n, I] -> [n, H] through expert `index`'s second matrix, its bias added."""
        bias = None if self.down_bias is None else self.down_bias[index]
        if self.quant is not None:
            return self.quant[index][1](h, bias)
        if self.packed is not None:
            return packed_linear(h, self.packed[index][1], bias)
        return F.linear(h, self.down[index], bias)

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """[n, 2I] gate_up outputs (of one expert or of several stacked) -> [n, I]."""
        gate, up = h.split(self.inter, dim=-1)  # [n, I] each
        if self.activation_kind == "gpt_oss":
            gate = gate.clamp(max=self.limit)
            return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.silu(gate) * up

    def expert(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """One expert over its rows: [n, H] -> [n, H]."""
        return self.down_proj(self.activation(self.gate_up_proj(x, index)), index)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> the weighted sum of each token's k experts [T, H]."""
        if ids.shape[0] == 1:
            return self.one_token(x, weights, ids)
        return self.sorted_by_expert(x, weights, ids)

    def one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A decode step of one stream: [1, H] through its k experts, no sort, no scatter. Only the matmuls run once
        per expert: the activation runs once over the k stacked gate_up rows, and the weighted sum is one [1, k] x
        [k, H] product in float32 (bf16's mm pays a oneDNN set-up of 15-50 us at this size, float32's 2-4), so a
        layer makes about 2k + 10 calls where running each expert whole made 8k. W8A8 experts compute in float32:
        fed float32, their chain makes no casts (3k fewer calls). The matmuls are most of it either way: bench.moe
        micro (one layer, one thread, loaded box) gave forward 2.7-3.9 ms against per_expert_loop 2.8-3.8 and the
        16 matmuls alone 2.6-3.6 in bf16, and 3.7 against 5.4 ms with W8A8 experts."""
        chosen = ids[0].tolist()  # the step's one host sync per layer
        if self.quant is not None and self.quant[chosen[0]][0].kernel == "w8a8":
            x_in = x.float()
        else:
            x_in = x
        h = torch.cat([self.gate_up_proj(x_in, e) for e in chosen])  # [k, 2I]
        rows = self.activation(h).split(1)  # k views [1, I]
        ys = torch.cat([self.down_proj(row, e) for row, e in zip(rows, chosen)])  # [k, H]
        return torch.mm(weights.float(), ys.float()).to(x.dtype)  # [1, H]

    def sorted_by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Any number of tokens: the (token, choice) pairs sorted by expert, each expert in use run once over its
        rows, the rows weighted and added back to their tokens."""
        k = ids.shape[1]
        flat = ids.flatten()  # [T k]: pair p is token p // k's choice p % k
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        token_of = order // k
        xs = x.index_select(0, token_of)  # [T k, H] rows in expert order
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                ys[start:start + n] = self.expert(xs[start:start + n], expert)
                start += n
        ys.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, token_of, ys)


class SparseMoe(PackedLinears):
    """The MoE MLP of one layer: router -> experts, plus Qwen3.5-MoE's shared expert behind its sigmoid gate."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        moe = cfg.moe
        self.cfg = moe
        self.router = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.router_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=dtype), requires_grad=False) \
            if moe.expert_bias else None
        self.experts = Experts(cfg, dtype)
        shared = moe.shared_expert_intermediate_size
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, cfg.hidden_size, dtype=dtype),
                                           requires_grad=False) if shared else None
        self.shared_down = nn.Parameter(torch.empty(cfg.hidden_size, shared, dtype=dtype), requires_grad=False) \
            if shared else None
        # one row: the sigmoid gate that scales the shared expert per token
        self.shared_gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False) \
            if shared else None
        self.checkpoint_names: set[str] = set()

    def targets(self, prefix: str) -> dict[str, Target]:
        """prefix: the layer's "…mlp". Qwen names the router mlp.gate, gpt-oss mlp.router (with a bias). The
        experts' form is read from checkpoint_names (set by load_moe_model before it asks for targets)."""
        names = self.checkpoint_names
        hidden = self.router.shape[1]
        if self.router_bias is not None:
            t: dict[str, Target] = {f"{prefix}.router.weight": (self.router, 0, self.cfg.num_experts),
                                    f"{prefix}.router.bias": (self.router_bias, 0, self.cfg.num_experts)}
        else:
            t = {f"{prefix}.gate.weight": (self.router, 0, self.cfg.num_experts)}
        t.update(self.experts.targets(prefix, names))
        if self.shared_gate_up is not None:
            s = self.cfg.shared_expert_intermediate_size
            t.update({f"{prefix}.shared_expert.gate_proj.weight": (self.shared_gate_up, 0, s),
                      f"{prefix}.shared_expert.up_proj.weight": (self.shared_gate_up, s, 2 * s),
                      f"{prefix}.shared_expert.down_proj.weight": (self.shared_down, 0, hidden),
                      f"{prefix}.shared_expert_gate.weight": (self.shared_gate, 0, 1)})
        return t

    def prepack(self) -> None:
        """CPU: the router and the shared expert's matrices in oneDNN's pre-packed layout, as DecoderLayer.prepack
        packs attention's, then the experts' (Experts.prepack). For the shared expert's MLP-sized matrices that is
        the 2-3x of cpu-kernels.md; for the small [E, H] router the measurements disagree (48 cold bf16 [128, 2048]
        routers, one row, one thread, loaded box: 52-59 against 82-167 us a call packed; bench.moe micro: 97-156
        against 66-113), and a one-stream step gives the same time either way (bench.moe step, router_f_linear)."""
        self.prepack_names(name for name in ("router", "shared_gate_up", "shared_down") if getattr(self, name) is not None)
        self.experts.prepack()

    def router_bytes(self) -> int:
        """Bytes of the router's weight as its matmul reads it (every token's step reads all of it)."""
        w = self.packed.get("router", self.router)
        return w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> the MLP's output [T, H]."""
        weights, ids = route(self.linear(x, "router", self.router_bias), self.cfg.top_k, self.cfg.router,
                             self.cfg.norm_topk_prob)
        out = self.experts(x, weights, ids)
        if self.shared_gate_up is not None:
            gate, up = self.linear(x, "shared_gate_up").chunk(2, dim=-1)
            shared = self.linear(F.silu(gate) * up, "shared_down")
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out


def checkpoint_names(files: list) -> set[str]:
    """Every tensor name in the checkpoint's files (headers only): which expert form it holds."""
    return {entry.name for file in files for entry in read_safetensors_header(file)}


def active_expert_bytes(moe_blocks: list[SparseMoe]) -> int:
    """Bytes of top_k experts' weights over every MoE layer (the average expert's size): what one token needs."""
    total = 0
    for block in moe_blocks:
        experts = block.experts
        total += experts.top_k * math.ceil(sum(experts.expert_bytes(e) for e in range(experts.num_experts))
                                           / experts.num_experts)
    return total


def expert_weight_bytes(cfg: ModelConfig, element_bytes: int, quant: QuantPlan | None) -> int:
    """Bytes every layer's experts hold once loaded: dense at element_bytes (MXFP4 dequantized), or quantized
    (int4 where its kernel takes the shape, else int8, as Experts._quantize does); biases at element_bytes."""
    moe = cfg.moe
    i, h = moe.expert_intermediate_size, cfg.hidden_size
    per_expert = (2 * i + h) * element_bytes if moe.expert_bias else 0
    for n, k in ((2 * i, h), (h, i)):
        if quant is None:
            per_expert += n * k * element_bytes
        else:
            per_expert += quantized_bytes(quant, n, k) or quantized_bytes(quant, n, k, head=True)
    return sum(moe.sparse_layers) * moe.num_experts * per_expert
