"""LoRA adapters: PEFT's on-disk format read and checked against the base model, and the per-slot weight
stacks the decoder adds each row's low-rank delta from.

Core side. An adapter's tensors are kept on the CPU once loaded (`LoraAdapter`); `LoraWeights` holds
`max_loras` device-resident slots per fused linear, and a step names each token's slot (`LoraBatch`).

One step's delta for a linear with k fused parts (qkv: 3, gate_up: 2, o and down: 1; Qwen3.5's in_proj: 4), over
the rows that have an adapter (rows without one are not touched). The rows are grouped by slot into an [n, G] grid (n
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
import os
import pathlib
import re
import stat
import time
from dataclasses import dataclass
from typing import BinaryIO

import torch

from rawserve.engine.loader import CheckpointError, ModelConfig, TensorEntry, read_tensor_into, tensor_entries

# PEFT's module names (transformers' nn.Linear names) -> (rawserve's fused linear, part index within it), by the
# block that holds them in a decoder layer. The part order is the row order of the fused matrix the model loads.
ATTENTION = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0)}
DELTANET = {"in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
            "in_proj_a": ("in_proj", 3), "out_proj": ("out_proj", 0)}  # Qwen3.5's linear_attention layers
MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
MODULES = {**ATTENTION, **MLP}  # a dense decoder layer's (Qwen3, Qwen2, Llama), and Qwen3.5's full_attention ones
_BLOCK = {**dict.fromkeys(ATTENTION, "self_attn"), **dict.fromkeys(DELTANET, "linear_attn"),
          **dict.fromkeys(MLP, "mlp")}
# A Qwen3.5 adapter may come from the text-only form (model.layers) or the conditional-generation one
# (model.language_model.layers): the same text stack either way.
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.(language_model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])"
                   r"\.weight$")

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes; a bigger one is not PEFT's
# The dtypes PEFT saves LoRA weights in; float32 is the widest, so it bounds the bytes a weight file may hold.
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MAX_ELEMENT_BYTES = 4
# A header entry is ~150 bytes (name, dtype, shape, offsets); this leaves room for long prefixes and metadata.
_HEADER_BYTES_PER_TENSOR = 512
_HEADER_SLACK_BYTES = 4096


class LoraError(CheckpointError):
    """An adapter that cannot be loaded onto this base model; the message names the file, field or tensor.

    It may name paths and values from the file: it is for the operator's log, never for an untrusted client."""


def layer_modules(cfg: ModelConfig) -> list[dict[str, tuple[str, int]]]:
    """Per decoder layer, the PEFT modules an adapter may target there -> (fused linear, part): every layer of a
    dense model has MODULES; a Qwen3.5 layer has its mixer's (gated attention or Gated DeltaNet) and the MLP's."""
    # a MoE layer's experts take no adapter: its attention (or DeltaNet) projections do (models/moe.py)
    sparse = cfg.moe.sparse_layers if cfg.moe is not None else (False,) * cfg.num_layers
    if cfg.hybrid is None:
        return [ATTENTION if is_sparse else MODULES for is_sparse in sparse]
    return [{**(DELTANET if kind == "linear_attention" else ATTENTION), **({} if is_sparse else MLP)}
            for kind, is_sparse in zip(cfg.hybrid.layer_types, sparse)]


def part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) on this base model, for every module some layer has."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    hy = cfg.hybrid
    if hy is not None:
        heads = hy.linear_num_value_heads
        # q_proj emits the output gate too: per head, head_dim query rows then head_dim gate rows, as saved
        shapes["q_proj"] = (h, 2 * q)
        shapes.update(in_proj_qkv=(h, hy.conv_dim), in_proj_z=(h, hy.value_dim), in_proj_b=(h, heads),
                      in_proj_a=(h, heads), out_proj=(hy.value_dim, h))
    return shapes


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


def _show(value: object, limit: int = 80) -> str:
    """A value from the file for a message: its repr, cut short (a 1 MiB string must not become a log line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_under_root(path: str, root: str) -> str:
    """The real directory `path` names, taken relative to `root` unless absolute, with every symlink resolved;
    LoraError unless it lies under root's own real path."""
    try:
        real_root = os.path.realpath(root)
        real = os.path.realpath(os.path.join(real_root, path))
    except (OSError, ValueError) as error:  # a NUL byte, a name too long
        raise LoraError(f"{path!r}: not a usable path ({error})") from None
    if not _is_under(real, real_root):
        raise LoraError(f"{path!r}: resolves to {real}, outside --lora-root {real_root}")
    return real


def _open_regular(path: str, max_bytes: int, root: str | None) -> tuple[BinaryIO, int]:
    """Open a regular file of at most max_bytes for reading: (file, size). A FIFO, a device, a directory or a socket
    is refused before anything is read from it, so a load can neither block on it nor read without end.

    With `root` (a client's path), the file must resolve under it: a symlink out of the root is refused, one inside it
    (a Hugging Face cache snapshot's) is followed."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO swapped in after the stat opens at once
    if root is not None:
        real = os.path.realpath(path)
        if not _is_under(real, root):
            raise LoraError(f"{path}: a symlink to {real}, outside --lora-root {root}")
        path, flags = real, flags | os.O_NOFOLLOW  # resolved already: a symlink swapped in since is refused
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise LoraError(f"{path}: not a regular file")
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise LoraError(f"{path}: file is missing") from None
    except OSError as error:
        raise LoraError(f"{path}: cannot open ({error})") from None
    try:
        info = os.fstat(fd)  # what was opened, which a rename since the stat may have changed
        if not stat.S_ISREG(info.st_mode):
            raise LoraError(f"{path}: not a regular file")
        if info.st_size > max_bytes:
            raise LoraError(f"{path}: {info.st_size} bytes; at most {max_bytes} are read for this file")
        return os.fdopen(fd, "rb", buffering=0), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _read_config(file: str, root: str | None) -> dict:
    f, _ = _open_regular(file, MAX_CONFIG_BYTES, root)
    try:
        with f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # the file may have grown since the fstat
        if len(data) > MAX_CONFIG_BYTES:
            raise LoraError(f"{file}: more than {MAX_CONFIG_BYTES} bytes")
        conf = json.loads(data.decode("utf-8"))
    except OSError as error:
        raise LoraError(f"{file}: cannot read ({error})") from None
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise LoraError(f"{file}: not valid JSON ({_show(str(error))})") from None
    if not isinstance(conf, dict):
        raise LoraError(f"{file}: expected a JSON object")
    return conf


def _read_header(f: BinaryIO, size: int, file: pathlib.Path, max_header: int, max_tensors: int) -> list[TensorEntry]:
    """The safetensors header of an open weight file, its length checked against `max_header` before it is read
    and every tensor checked to lie inside the file."""
    prefix = f.read(8)
    header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if header_len < 2 or 8 + header_len > size:
        raise LoraError(f"{file}: not a safetensors file (header of {header_len} bytes in a {size}-byte file)")
    if header_len > max_header:
        raise LoraError(f"{file}: a safetensors header of {header_len} bytes; an adapter for this model needs at "
                        f"most {max_header}")
    raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise LoraError(f"{file}: unreadable safetensors header ({_show(str(error))})") from None
    if not isinstance(header, dict) or len(header) > max_tensors + 1:  # + __metadata__
        raise LoraError(f"{file}: a safetensors header that is not an object of at most {max_tensors} tensors")
    return tensor_entries(header, file, size, 8 + header_len, _DTYPES, LoraError, _show)


def weight_limits(cfg: ModelConfig, rank: int) -> tuple[int, int, int]:
    """(tensors, header bytes, file bytes) at most in a rank-`rank` adapter's safetensors file for this model: A and
    B of every module of every layer (each layer's own kind), in float32. A file past these is refused before its
    tensors are read."""
    layers, shapes = layer_modules(cfg), part_shapes(cfg)
    max_tensors = 2 * sum(len(modules) for modules in layers)
    max_header = _HEADER_SLACK_BYTES + max_tensors * _HEADER_BYTES_PER_TENSOR
    max_data = sum(rank * sum(shapes[module]) for modules in layers for module in modules)
    return max_tensors, max_header, 8 + max_header + max_data * _MAX_ELEMENT_BYTES


def read_adapter(name: str, path: str | pathlib.Path, cfg: ModelConfig, max_rank: int, *, root: str | None = None,
                 deadline: float | None = None) -> LoraAdapter:
    """Read and check a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

    Only regular files are read, and only as many bytes as an adapter of its rank can need on this model.
    `root` (a client's load): `path` is taken relative to it and must resolve under it. `deadline` (monotonic
    seconds): the read stops with a LoraError once it has passed."""
    if root is not None:
        root = os.path.realpath(root)
        path = resolve_under_root(str(path), root)
    directory = pathlib.Path(path)
    try:
        is_dir = stat.S_ISDIR(os.stat(directory).st_mode)
    except (OSError, ValueError):
        is_dir = False
    if not is_dir:
        raise LoraError(f"{directory}: not a directory")
    config_file = directory / "adapter_config.json"
    conf = _read_config(str(config_file), root)
    peft_type = conf.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{config_file}: peft_type {_show(peft_type)} is not supported (only LORA)")
    if conf.get("modules_to_save"):
        raise LoraError(f"{config_file}: modules_to_save {_show(conf['modules_to_save'])} is not supported "
                        "(it replaces whole base-model weights, which a shared batch cannot do per row)")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if conf.get(key):
            raise LoraError(f"{config_file}: {key} is not supported")
    if conf.get("bias", "none") != "none":
        raise LoraError(f"{config_file}: bias {_show(conf['bias'])} is not supported (only 'none')")
    rank, alpha = conf.get("r"), conf.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"{config_file}: r must be a positive integer, got {_show(rank)}")
    if rank > max_rank:
        raise LoraError(f"{config_file}: r={rank} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"{config_file}: lora_alpha must be a number, got {_show(alpha)}")
    scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    shapes, modules_of = part_shapes(cfg), layer_modules(cfg)
    targets = conf.get("target_modules")
    if isinstance(targets, list):  # PEFT matches a name by its last dotted part; a regex string is checked per tensor
        unknown = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in shapes]
        if unknown:
            raise LoraError(f"{config_file}: target_modules names {_show(unknown)}, which this {cfg.architecture} "
                            f"has no adapter-capable linear of (it has {', '.join(shapes)})")

    weight_file = directory / "adapter_model.safetensors"
    max_tensors, max_header, max_file = weight_limits(cfg, rank)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:  # an unreadable file (no permission, an I/O error) must fail the load, not the engine
        f, size = _open_regular(str(weight_file), max_file, root)
        with f:
            for entry in _read_header(f, size, weight_file, max_header, max_tensors):
                if deadline is not None and time.monotonic() > deadline:
                    raise LoraError(f"{weight_file}: the read ran past its deadline")
                match = _NAME.match(entry.name)
                if match is None or (match[1] and cfg.hybrid is None):
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} is not a LoRA A/B weight of a decoder "
                                    "layer's linear projection")
                layer, block, module, which = int(match[2]), match[3], match[4], match[5]
                if module not in shapes:
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} targets {module!r}, which is not one "
                                    f"of {', '.join(shapes)}")
                if block != _BLOCK[module]:
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} puts {module} under {block!r}; it "
                                    f"belongs under {_BLOCK[module]!r}")
                if layer >= cfg.num_layers:
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} is for layer {layer}; the base model "
                                    f"has {cfg.num_layers} layers")
                if module not in modules_of[layer]:
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} targets {module!r} on layer {layer}, "
                                    f"a {cfg.hybrid.layer_types[layer] if cfg.hybrid else 'mixture-of-experts'} "
                                    "layer, which has "
                                    f"{', '.join(modules_of[layer])}")
                in_f, out_f = shapes[module]
                expected = (rank, in_f) if which == "A" else (out_f, rank)
                if entry.shape != expected:
                    raise LoraError(f"{weight_file}: tensor {_show(entry.name)} has shape {entry.shape}, expected "
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
    return LoraAdapter(name, str(directory), rank, weights)


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
    """max_loras slots of rank max_rank for every fused linear of every decoder layer (the ones its kind has:
    layer_modules), on the model's device."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.cfg = cfg
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        shapes = part_shapes(cfg)
        # fused linear -> its PEFT modules in row order (each table lists them so), for the fused linears this model
        # has; a name is the same matrix in every layer that has it
        self.parts: dict[str, list[str]] = {}
        for module, (fused, _) in {**ATTENTION, **DELTANET, **MLP}.items():
            if module in shapes:
                self.parts.setdefault(fused, []).append(module)
        L, R = max_loras, max_rank
        # layers[i][fused] = (A [L, k * R, in], [Bt_j [L, R, out_j] for each part j]). B is kept transposed:
        # x @ B.T with B [out, R] hit a slow oneDNN path on CPU (~20x slower at K = 128).
        self.layers: list[dict[str, tuple[torch.Tensor, list[torch.Tensor]]]] = []
        for layer_parts in layer_modules(cfg):
            entry = {}
            for fused in dict.fromkeys(fused for fused, _ in layer_parts.values()):
                modules = self.parts[fused]
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
