"""LoRA adapters: PEFT's on-disk format read and checked against the base model, and the per-slot weight
stacks the decoder adds each row's low-rank delta from.

Core side. An adapter's tensors are kept on the CPU once loaded (`LoraAdapter`); `LoraWeights` holds
`max_loras` device-resident slots per fused linear, and a step names each token's slot (`LoraBatch`).

One step's delta for a linear with k fused parts (qkv: 3, gate_up: 2, o and down: 1), over the rows that
have an adapter (rows without one are not touched). The rows are grouped by slot into an [n, G] grid (n
slots from the lowest to the highest one in use, G the largest group; short groups padded with a copy of
some row whose result is dropped):

    xg = x[grid]                [n, G, in]
    h  = xg @ A[slots].T        A: [L, k * R, in]    every part's A of a slot, one batched matmul (shrink)
    d_j = h_j @ Bt_j[slots]     Bt_j: [L, R, out_j]  one batched matmul per part (expand), the scale folded in
    y[rows] += d[row's cell]

L slots of rank R (max_lora_rank; a smaller adapter is zero-padded). Each slot's A and B are read once per
linear per step, like punica's SGMV, and each row only multiplies its own adapter's (a dense form that
multiplied every row by every slot's A and masked the rest did L times the arithmetic: 25% over the base
model's layer at 8 adapters and batch 32 against 18% here, one thread). No loop over adapters or rows,
no merged weight copies, and a batch with no adapter pays nothing.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rawserve.engine.loader import CheckpointError, ModelConfig, read_safetensors_header, read_tensor_into

# PEFT's module names -> (rawserve's fused linear, part index within it).
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(CheckpointError):
    """An adapter that cannot be loaded onto this base model; the message names the file, field or tensor."""


def part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) on this base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass(slots=True)
class LoraAdapter:
    """One adapter, checked and on the CPU: (layer, PEFT module) -> (A [r, in], B [out, r] * scale)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def read_adapter(name: str, path: str | pathlib.Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise LoraError(f"{root}: not a directory")
    config_file = root / "adapter_config.json"
    try:
        conf = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"{config_file}: file is missing") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LoraError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{config_file}: expected a JSON object")
    peft_type = conf.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{config_file}: peft_type {peft_type!r} is not supported (only LORA)")
    if conf.get("modules_to_save"):
        raise LoraError(f"{config_file}: modules_to_save {conf['modules_to_save']!r} is not supported "
                        "(it replaces whole base-model weights, which a shared batch cannot do per row)")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if conf.get(key):
            raise LoraError(f"{config_file}: {key} is not supported")
    if conf.get("bias", "none") != "none":
        raise LoraError(f"{config_file}: bias {conf['bias']!r} is not supported (only 'none')")
    rank, alpha = conf.get("r"), conf.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{config_file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{config_file}: r={rank} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoraError(f"{config_file}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank

    weight_file = root / "adapter_model.safetensors"
    if not weight_file.exists():
        raise LoraError(f"{weight_file}: file is missing (only safetensors adapters are read)")
    shapes = part_shapes(cfg)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:  # an unreadable file (a directory, no permission) must fail the load, not the engine
        with open(weight_file, "rb", buffering=0) as f:
            for entry in read_safetensors_header(weight_file):
                match = _NAME.match(entry.name)
                if match is None:
                    raise LoraError(f"{weight_file}: tensor {entry.name!r} is not a LoRA A/B weight of a decoder "
                                    "layer's attention or MLP projection")
                layer, module, which = int(match[1]), match[2], match[3]
                if module not in MODULES:
                    raise LoraError(f"{weight_file}: tensor {entry.name!r} targets {module!r}, which is not one of "
                                    f"{', '.join(MODULES)}")
                if layer >= cfg.num_layers:
                    raise LoraError(f"{weight_file}: tensor {entry.name!r} is for layer {layer}; the base model has "
                                    f"{cfg.num_layers} layers")
                in_f, out_f = shapes[module]
                expected = (rank, in_f) if which == "A" else (out_f, rank)
                if entry.shape != expected:
                    raise LoraError(f"{weight_file}: tensor {entry.name!r} has shape {entry.shape}, expected "
                                    f"{expected} (r={rank} on this base model)")
                tensor = torch.empty(entry.shape, dtype=entry.dtype)
                read_tensor_into(entry, f, tensor)
                found[(layer, module, which)] = tensor.float()
    except OSError as error:
        raise LoraError(f"{weight_file}: cannot read ({error})") from None
    if not found:
        raise LoraError(f"{weight_file}: no LoRA tensors")
    weights = {}
    for (layer, module, which), tensor in found.items():
        if which == "B":
            continue
        b = found.get((layer, module, "B"))
        if b is None:
            raise LoraError(f"{weight_file}: tensor base_model.model.model.layers.{layer}.*.{module}.lora_B.weight "
                            f"is missing (lora_A is there)")
        weights[(layer, module)] = (tensor, b * scale)
    for (layer, module, which) in found:
        if which == "B" and (layer, module) not in weights:
            raise LoraError(f"{weight_file}: tensor base_model.model.model.layers.{layer}.*.{module}.lora_A.weight "
                            f"is missing (lora_B is there)")
    return LoraAdapter(name, str(root), rank, weights)


@dataclass(slots=True)
class LoraBatch:
    """One step's adapter layout: the rows that have an adapter, grouped by slot into an [n, G] grid."""

    rows: torch.Tensor | None  # [S] int64 token indices with an adapter (ascending), None when every token has one
    grid: torch.Tensor  # [n * G] int64: the token row in each grid cell (padding repeats a row of the group)
    cells: torch.Tensor  # [S] int64: the grid cell of each adapter row, in `rows` order
    first_slot: int  # the grid's slots are first_slot .. first_slot + n - 1
    num_slots: int  # n
    group: int  # G


class LoraWeights:
    """max_loras slots of rank max_rank for every decoder layer's four fused linears, on the model's device."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        shapes = part_shapes(cfg)
        parts: dict[str, list[str]] = {name: [] for name in FUSED}
        for module, (fused, _) in MODULES.items():
            parts[fused].append(module)
        self.parts = parts
        L, R = max_loras, max_rank
        # layers[i][fused] = (A [L, k * R, in], [Bt_j [L, R, out_j] for each part j]). B is kept transposed:
        # x @ B.T with B [out, R] hit a slow oneDNN path on CPU (~20x slower at K = 128).
        self.layers: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = []
        for _ in range(cfg.num_layers):
            entry = {}
            for fused, modules in parts.items():
                in_f = shapes[modules[0]][0]
                a = torch.zeros(L, len(modules) * R, in_f, dtype=dtype, device=device)
                bs = [torch.zeros(L, R, shapes[m][1], dtype=dtype, device=device) for m in modules]
                entry[fused] = (a, bs)
            self.layers.append(entry)

    def load(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write an adapter's weights into a slot (zeros where it has no target), or clear it (None)."""
        R = self.max_rank
        for i, entry in enumerate(self.layers):
            for fused, (a, bs) in entry.items():
                a[slot].zero_()
                for j, module in enumerate(self.parts[fused]):
                    bs[j][slot].zero_()
                    pair = adapter.weights.get((i, module)) if adapter is not None else None
                    if pair is not None:
                        lora_a, lora_b = pair
                        r = lora_a.shape[0]
                        a[slot, j * R:j * R + r].copy_(lora_a)
                        bs[j][slot, :r].copy_(lora_b.t())

    def batch(self, token_slots: list[int]) -> LoraBatch | None:
        """Per flattened token, its slot (-1: none) -> the step's LoraBatch, or None when no token has one."""
        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(i)
        if not groups:
            return None
        first, last = min(groups), max(groups)
        group = max(len(rows) for rows in groups.values())
        grid: list[int] = []
        cell_of: dict[int, int] = {}
        some_row = next(iter(groups.values()))[0]
        for slot in range(first, last + 1):
            rows = groups.get(slot, ())
            for j, row in enumerate(rows):
                cell_of[row] = len(grid) + j
            grid.extend(rows)
            grid.extend([rows[0] if rows else some_row] * (group - len(rows)))
        rows = sorted(cell_of)

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device)

        return LoraBatch(None if len(rows) == len(token_slots) else index(rows), index(grid),
                         index([cell_of[row] for row in rows]), first, last - first + 1, group)

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """y (the base linear's output for x) plus each adapter row's delta."""
        a, bs = self.layers[layer][fused]
        n, first, R = lora.num_slots, lora.first_slot, self.max_rank
        xg = x.index_select(0, lora.grid).view(n, lora.group, x.shape[1])  # [n, G, in]
        h = torch.bmm(xg, a[first:first + n].transpose(1, 2))  # [n, G, k * R]
        parts = [torch.bmm(h[:, :, j * R:(j + 1) * R], bt[first:first + n]).view(n * lora.group, -1)
                 for j, bt in enumerate(bs)]  # [n * G, out_j] each
        delta = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).index_select(0, lora.cells)  # [S, out]
        if lora.rows is None:
            return y.add_(delta)
        return y.index_add_(0, lora.rows, delta)
