"""The vision towers of Qwen3.5 and Qwen3-VL (model.visual.*): patch embedding, learned position embeddings
resampled to each image's grid, 2D rotary attention over each image's own patches, and the merger of 2 x 2
neighbours into the text hidden size; Qwen3-VL's DeepStack mergers besides. Pixels in, embeddings out: where
they go in the prompt is the multimodal manager's business.
"""
from __future__ import annotations

import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from rawserve.engine.loader import ModelConfig, Target, VisionConfig, load_weights
from rawserve.engine.models.packed import PackedLinears, cpu_prepack_supported

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu}


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linears(PackedLinears):
    """Matmuls by weight name, run as the text layers' are: on a CPU, every 2-D `*_weight` but the norms'
    pre-packed (prepack), else F.linear."""

    def prepack(self) -> None:
        self.prepack_names(name for name, param in self.named_parameters(recurse=False)
                           if name.endswith("_weight") and param.dim() == 2 and not name.startswith("norm"))


class Merger(Linears):
    """LayerNorm, then each 2 x 2 block's four patch vectors side by side through a GELU MLP -> out_hidden_size.
    DeepStack's mergers normalise after the shuffle (over the four vectors together), the main one before."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device, post_shuffle_norm: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.post_shuffle_norm = post_shuffle_norm
        norm = self.width if post_shuffle_norm else cfg.hidden_size
        self.norm_weight, self.norm_bias = _param(norm, dtype=dtype, device=device), _param(norm, dtype=dtype,
                                                                                             device=device)
        self.fc1_weight = _param(self.width, self.width, dtype=dtype, device=device)
        self.fc1_bias = _param(self.width, dtype=dtype, device=device)
        self.fc2_weight = _param(cfg.out_hidden_size, self.width, dtype=dtype, device=device)
        self.fc2_bias = _param(cfg.out_hidden_size, dtype=dtype, device=device)

    def targets(self, prefix: str) -> dict[str, Target]:
        return {f"{prefix}.{name}": (param, 0, param.shape[0]) for name, param in (
            ("norm.weight", self.norm_weight), ("norm.bias", self.norm_bias),
            ("linear_fc1.weight", self.fc1_weight), ("linear_fc1.bias", self.fc1_bias),
            ("linear_fc2.weight", self.fc2_weight), ("linear_fc2.bias", self.fc2_bias))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [patches, hidden] in merge-block order -> [patches / 4, out_hidden]."""
        if self.post_shuffle_norm:
            x = F.layer_norm(x.reshape(-1, self.width), (self.width,), self.norm_weight, self.norm_bias, 1e-6)
        else:
            x = F.layer_norm(x, x.shape[-1:], self.norm_weight, self.norm_bias, 1e-6).reshape(-1, self.width)
        return self.linear(F.gelu(self.linear(x, "fc1_weight", self.fc1_bias)), "fc2_weight", self.fc2_bias)


class VisionBlock(Linears):
    """Pre-norm transformer block: full (non-causal) attention within one image, then the MLP."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.num_heads = cfg.num_heads
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        p = lambda *shape: _param(*shape, dtype=dtype, device=device)  # noqa: E731 - four lines of shapes
        self.norm1_weight, self.norm1_bias, self.norm2_weight, self.norm2_bias = p(hidden), p(hidden), p(hidden), \
            p(hidden)
        self.qkv_weight, self.qkv_bias = p(3 * hidden, hidden), p(3 * hidden)
        self.proj_weight, self.proj_bias = p(hidden, hidden), p(hidden)
        self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias = p(inter, hidden), p(inter), p(hidden, inter), \
            p(hidden)

    def targets(self, prefix: str) -> dict[str, Target]:
        names = {"norm1.weight": self.norm1_weight, "norm1.bias": self.norm1_bias, "norm2.weight": self.norm2_weight,
                 "norm2.bias": self.norm2_bias, "attn.qkv.weight": self.qkv_weight, "attn.qkv.bias": self.qkv_bias,
                 "attn.proj.weight": self.proj_weight, "attn.proj.bias": self.proj_bias,
                 "mlp.linear_fc1.weight": self.fc1_weight, "mlp.linear_fc1.bias": self.fc1_bias,
                 "mlp.linear_fc2.weight": self.fc2_weight, "mlp.linear_fc2.bias": self.fc2_bias}
        return {f"{prefix}.{name}": (param, 0, param.shape[0]) for name, param in names.items()}

    # The block in two parts, so that a resumable encode (multimodal/encode_job.py) can run it a slice of rows at a
    # time: everything but attention is row-wise, and attention needs every row's K and V before any row's output.

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows x [n, hidden] (cos, sin [n, 1, D]) -> their q, k, v, each [n, heads, D], q and k rotated."""
        n, hidden = x.shape
        h = F.layer_norm(x, (hidden,), self.norm1_weight, self.norm1_bias, 1e-6)
        q, k, v = self.linear(h, "qkv_weight", self.qkv_bias).view(n, 3, self.num_heads, -1).unbind(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The block's output for some rows of one image: x [n, hidden] their input, q [n, heads, D] theirs, k and
        v [patches, heads, D] the whole image's."""
        n, hidden = x.shape
        # [1, heads, n, D] views of the row-major [n, heads, D]: torch's fused (flash) CPU attention wants 4-D inputs;
        # 3-D ones take the math path, which holds a [heads, n, patches] score matrix (3.2 GB and 10x the time at
        # 1920x1080)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(n, hidden)
        x = x + self.linear(attn, "proj_weight", self.proj_bias)
        h = F.layer_norm(x, (hidden,), self.norm2_weight, self.norm2_bias, 1e-6)
        return x + self.linear(self.act(self.linear(h, "fc1_weight", self.fc1_bias)), "fc2_weight", self.fc2_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x: [patches, hidden] (images one after another, `lengths` patches each); cos, sin: [patches, 1, D]."""
        q, k, v = self.qkv(x, cos, sin)
        out = []
        start = 0
        for length in lengths:  # each image attends to its own patches only
            sl = slice(start, start + length)
            out.append(self.attend(x[sl], q[sl], k[sl], v[sl]))
            start += length
        return torch.cat(out) if len(out) > 1 else out[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation in float32, back to x's dtype; sin is (-sin, sin) (see decoder.apply_rope)."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


class VisionTower(nn.Module):
    """One forward encodes a list of images: float32 patches [sum of patches, patch_dim] (preprocess.pixel_patches,
    concatenated) and each image's (grid_h, grid_w) -> (embeddings [sum of patches / 4, out_hidden], DeepStack
    features: one such tensor per deepstack index, empty for Qwen3.5)."""

    prefix = "model.visual."

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        hidden = cfg.hidden_size
        patch_dim = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
        # the Conv3d's kernel equals its stride and covers a whole patch: one matmul over flattened patches
        self.patch_weight = _param(hidden, patch_dim, dtype=dtype, device=device)
        self.patch_bias = _param(hidden, dtype=dtype, device=device)
        self.pos_embed = _param(cfg.num_position_embeddings, hidden, dtype=dtype, device=device)
        self.side = int(cfg.num_position_embeddings ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype, device) for _ in range(cfg.depth))
        self.merger = Merger(cfg, dtype, device, post_shuffle_norm=False)
        self.deepstack = nn.ModuleList(Merger(cfg, dtype, device, post_shuffle_norm=True)
                                       for _ in cfg.deepstack_indexes)
        head_dim = hidden // cfg.num_heads
        quarter = head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device)
                                                  / quarter))  # [head_dim / 4]

    def targets(self) -> dict[str, Target]:
        p = self.prefix
        t: dict[str, Target] = {f"{p}pos_embed.weight": (self.pos_embed, 0, self.pos_embed.shape[0]),
                                f"{p}patch_embed.proj.bias": (self.patch_bias, 0, self.patch_bias.shape[0])}
        for i, block in enumerate(self.blocks):
            t.update(block.targets(f"{p}blocks.{i}"))
        t.update(self.merger.targets(f"{p}merger"))
        for i, merger in enumerate(self.deepstack):
            t.update(merger.targets(f"{p}deepstack_merger_list.{i}"))
        return t

    def load(self, model_dir: str | pathlib.Path, set_aside: tuple[str, ...]) -> None:
        """Read model.visual.* (the conv's 5-D weight into the flat patch matmul); `set_aside`: every other prefix."""
        conv = torch.empty((self.cfg.hidden_size, 3, self.cfg.temporal_patch_size, self.cfg.patch_size,
                            self.cfg.patch_size), dtype=self.dtype, device=self.patch_weight.device)
        targets = {**self.targets(), f"{self.prefix}patch_embed.proj.weight": (conv, 0, conv.shape[0])}
        load_weights(model_dir, targets, set_aside=set_aside, log_set_aside=False)
        self.patch_weight.data.copy_(conv.reshape(self.cfg.hidden_size, -1))

    def prepack(self) -> None:
        """CPU: the blocks' and mergers' matmul weights in oneDNN's packed layout (2-4x faster, as the text's)."""
        for module in (*self.blocks, self.merger, *self.deepstack):
            module.prepack()

    def _grid_tables(self, grid_h: int, grid_w: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One image's (position embeddings [patches, hidden], cos, sin [patches, 1, head_dim]), patches in
        merge-block order. The learned side x side grid is resampled bilinearly with aligned corners."""
        m = self.cfg.spatial_merge_size

        def axis(size: int) -> torch.Tensor:  # [size, side]: each target row's weights over the source rows
            src = torch.arange(size, dtype=torch.float32, device=device) * (self.side - 1) / max(size - 1, 1)
            lo = src.floor().long().clamp(max=self.side - 1)
            hi = (lo + 1).clamp(max=self.side - 1)
            frac = src - lo
            weights = torch.zeros(size, self.side, dtype=torch.float32, device=device)
            weights.scatter_add_(1, lo[:, None], (1 - frac)[:, None])
            weights.scatter_add_(1, hi[:, None], frac[:, None])
            return weights

        table = self.pos_embed.float().view(self.side, self.side, -1)  # [side rows, side columns, hidden]
        # The shorter axis first: its [short, side, hidden] intermediate is at most sqrt(patches) rows of the table
        # (a 200:1 image resampled rows first would hold 2.6x the position table it makes)
        if grid_h <= grid_w:
            rows_first = (axis(grid_h) @ table.view(self.side, -1)).view(grid_h, self.side, -1)  # [gh, side, hidden]
            pos = torch.matmul(axis(grid_w), rows_first)  # [gh, gw, hidden]
        else:
            cols_first = (axis(grid_w) @ table.transpose(0, 1).reshape(self.side, -1)).view(grid_w, self.side, -1)
            pos = torch.matmul(axis(grid_h), cols_first).transpose(0, 1)  # [gh, gw, hidden]
        rows = torch.arange(grid_h, device=device).view(grid_h // m, m, 1, 1).expand(-1, -1, grid_w // m, m)
        cols = torch.arange(grid_w, device=device).view(1, 1, grid_w // m, m).expand(grid_h // m, m, -1, -1)
        rows, cols = rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)  # merge-block order
        pos = pos[rows, cols]
        freqs = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1)  # [N, D / 2]
        cos, sin = freqs.cos(), freqs.sin()
        return pos.to(self.dtype), torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def embed(self, patches: torch.Tensor, grids: list[tuple[int, int]]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 patches [N, patch_dim] -> the first block's input [N, hidden] and the rotary cos, sin [N, 1, D]."""
        device = self.patch_weight.device
        patches = patches.to(device=device, dtype=self.dtype)
        x = F.linear(patches, self.patch_weight, self.patch_bias)  # [N, hidden]
        tables = [self._grid_tables(gh, gw, device) for gh, gw in grids]
        pos, cos, sin = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*tables))
        return x + pos, cos, sin

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """In one go; multimodal/encode_job.py runs the same blocks and mergers a slice of rows at a time."""
        x, cos, sin = self.embed(patches, grids)
        lengths = [gh * gw for gh, gw in grids]
        deepstack = []
        indexes = self.cfg.deepstack_indexes
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths)
            if i in indexes:
                deepstack.append(self.deepstack[indexes.index(i)](x))
        return self.merger(x), deepstack


def load_vision_tower(model_dir: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> VisionTower:
    """The checkpoint's tower at `dtype` on `device`; the text stack's tensors are left to the text model."""
    tower = VisionTower(cfg.vision, dtype, device)
    tower.load(model_dir, set_aside=("model.language_model.", "lm_head.", "mtp.", "model.mtp."))
    if device.type == "cpu" and cpu_prepack_supported(dtype):
        tower.prepack()
    return tower.eval()
