"""Interleaved M-RoPE (Qwen3.5, Qwen3-VL): each rotary frequency turns with one of three position streams
(temporal, height, width), so an image's tokens carry their place in the grid. One table row per position, as
plain RoPE; the streams pick each frequency's row."""
from __future__ import annotations

import torch


def interleaved_streams(section: tuple[int, ...], half: int) -> list[int]:
    """Per dim of the doubled cos/sin tables (see decoder.apply_rope): frequency j turns with the height stream when
    j % 3 == 1 (for the first section[1] of those), the width stream when j % 3 == 2 (first section[2]), else the
    temporal stream."""
    stream = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
              for j in range(half)]
    return stream + stream


def rope_tables(cos_table: torch.Tensor, sin_table: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D] for positions [T] (text: every stream equal) or [3, T] (each frequency from its stream)."""
    if positions.dim() == 1:
        return cos_table.index_select(0, positions).unsqueeze(1), sin_table.index_select(0, positions).unsqueeze(1)
    index = streams.view(1, 1, -1).expand(1, positions.shape[1], -1)
    cos = cos_table[positions].gather(0, index)[0]  # [3, T, D] -> [T, D]
    sin = sin_table[positions].gather(0, index)[0]
    return cos.unsqueeze(1), sin.unsqueeze(1)
