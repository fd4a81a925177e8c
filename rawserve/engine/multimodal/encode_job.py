"""EncodeJob: one image's vision-tower forward run a slice of patch rows at a time, its activations kept between
slices, so a large image's encoding spreads over engine steps. The math is the tower's own (VisionBlock.qkv and
attend, the mergers); this module keeps the state between slices and counts the work in FLOPs."""
from __future__ import annotations

import torch

from rawserve.engine.loader import VisionConfig
from rawserve.engine.models.vision import VisionTower
from rawserve.engine.multimodal.encoder_cache import EncodedImage


# A slice's rows at most, whatever the step's budget: a pass's transients (a block's allocations for its rows) are
# bounded by this, not by the image, so the memory plan counts the image's held activations plus one slice of
# transients (budget.tower_step_bytes). 4,096 rows keep the slice's products large enough to run at full speed.
SLICE_ROWS = 4096


def _row_flops(cfg: VisionConfig, num_rows: int) -> tuple[float, float, float, float]:
    """FLOPs one patch row costs: (the patch embedding; a block's pass A: qkv; its pass B: attention against all
    `num_rows` rows, projection and MLP; one merger, per patch row of its merge group)."""
    hidden, group = cfg.hidden_size, cfg.spatial_merge_size ** 2
    width = hidden * group
    patch_dim = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
    attend = 4 * num_rows * hidden + 2 * hidden * hidden + 4 * hidden * cfg.intermediate_size
    merger = 2 * (width * width + width * cfg.out_hidden_size) / group
    return 2 * patch_dim * hidden, 6 * hidden * hidden, attend, merger


def encode_flops(cfg: VisionConfig, num_rows: int) -> float:
    """The whole forward's FLOPs for an image of `num_rows` patches (the embedding, every block, every merger)."""
    embed, qkv, attend, merger = _row_flops(cfg, num_rows)
    return num_rows * (embed + cfg.depth * (qkv + attend) + (1 + len(cfg.deepstack_indexes)) * merger)


class EncodeJob:
    """Block by block, each in two passes over the image's rows (merge-block order): (A) norm1, qkv and the rotary
    of a row slice into the job's q, k, v; once every row's K and V are in, (B) a slice's attention against them,
    the projection and the MLP, its output written over its input (pass A has read every row by then). Pass B of
    a DeepStack block feeds its merger, and of the last block the main merger, slice by slice: a slice is whole
    merge groups (spatial_merge_size ** 2 rows), which a merger reads as one.

    It holds x [N, hidden], q, k, v [N, heads, D], the rotary tables and the outputs, and a slice's transients
    (SLICE_ROWS rows at most): what the memory plan counts (budget.tower_step_bytes). Built and advanced in
    inference mode, as the tower runs."""

    @torch.inference_mode()
    def __init__(self, tower: VisionTower, patches: torch.Tensor, grid: tuple[int, int]) -> None:
        """patches: float32 [N, patch_dim] (preprocess.pixel_patches); grid: (grid_h, grid_w) in patches."""
        cfg = tower.cfg
        self.tower = tower
        self.num_rows = grid[0] * grid[1]
        self.group = cfg.spatial_merge_size ** 2
        self.slice_rows = max(self.group, SLICE_ROWS // self.group * self.group)  # whole merge groups
        embed, self._qkv_flops, self._attend_flops, self._merger_flops = _row_flops(cfg, self.num_rows)
        self.x, self.cos, self.sin = tower.embed(patches, [grid])  # [N, hidden], [N, 1, D] x 2
        self.flops_spent = self.num_rows * embed
        self.total_flops = encode_flops(cfg, self.num_rows)
        self._qkv_shape = (self.num_rows, cfg.num_heads, cfg.hidden_size // cfg.num_heads)
        self.q = self.k = self.v = None  # [N, heads, D] each, made by the first pass A
        merged = self.num_rows // self.group
        self.embeds = torch.empty(merged, cfg.out_hidden_size, dtype=self.x.dtype, device=self.x.device)
        self.deepstack = [torch.empty_like(self.embeds) for _ in cfg.deepstack_indexes]
        self.block = 0  # the block under way; len(blocks) once done
        self.is_attending = False  # in its pass B
        self.row = 0  # the pass's next row

    @property
    def is_done(self) -> bool:
        return self.block == len(self.tower.blocks)

    @property
    def remaining_flops(self) -> float:
        return max(self.total_flops - self.flops_spent, 0.0)

    def _pass_row_flops(self) -> float:
        if not self.is_attending:
            return self._qkv_flops
        indexes = self.tower.cfg.deepstack_indexes
        mergers = (self.block in indexes) + (self.block == len(self.tower.blocks) - 1)
        return self._attend_flops + mergers * self._merger_flops

    @torch.inference_mode()
    def advance(self, flops: float) -> bool:
        """Run slices worth about `flops` (at least one merge group's rows, so every call makes progress) ->
        whether the encoding is complete."""
        to_end = flops >= self.remaining_flops  # not left to float rounding: a last group short would be a step late
        budget_end = self.flops_spent + flops
        first = True
        while not self.is_done:
            per_row = self._pass_row_flops()
            if to_end:
                rows = self.num_rows - self.row
            else:
                rows = int((budget_end - self.flops_spent) // (per_row * self.group)) * self.group
            if rows <= 0:
                if not first:
                    break
                rows = self.group
            rows = min(rows, self.num_rows - self.row, self.slice_rows)
            self._run(self.row, self.row + rows)
            self.flops_spent += rows * per_row
            self.row += rows
            first = False
            if self.row == self.num_rows:
                self.row = 0
                self.block += self.is_attending
                self.is_attending = not self.is_attending
        if self.is_done:
            self.x = self.q = self.k = self.v = self.cos = self.sin = None  # the activations go now, not with the job
        return self.is_done

    def _run(self, lo: int, hi: int) -> None:
        block = self.tower.blocks[self.block]
        whole = lo == 0 and hi == self.num_rows  # one slice for the pass: its tensors kept as made, no copies
        if not self.is_attending:  # pass A
            q, k, v = block.qkv(self.x[lo:hi], self.cos[lo:hi], self.sin[lo:hi])
            if whole:
                self.q, self.k, self.v = q, k, v
                return
            if lo == 0:  # the previous block's are read no more
                self.q = self.k = self.v = None
                self.q, self.k, self.v = (torch.empty(self._qkv_shape, dtype=q.dtype, device=q.device)
                                          for _ in range(3))
            self.q[lo:hi], self.k[lo:hi], self.v[lo:hi] = q, k, v
            return
        x = block.attend(self.x[lo:hi], self.q[lo:hi], self.k, self.v)
        if whole:
            self.x = x
        else:
            self.x[lo:hi] = x
        merged = slice(lo // self.group, hi // self.group)
        indexes = self.tower.cfg.deepstack_indexes
        if self.block in indexes:
            i = indexes.index(self.block)
            self.deepstack[i][merged] = self.tower.deepstack[i](x)
        if self.block == len(self.tower.blocks) - 1:
            self.embeds[merged] = self.tower.merger(x)

    def result(self) -> EncodedImage:
        assert self.is_done, "an encode job's result before its last slice"
        return EncodedImage(self.embeds, self.deepstack)
