"""Qwen3-VL's text model: the Qwen3 decoder (models/decoder.py) under model.language_model.*, with interleaved
M-RoPE (positions [3, T]: temporal, height, width) and DeepStack: the vision tower's early-block features added to
the hidden states of the image's tokens after each of the first text layers. Positions and features come from
the multimodal manager; a text-only step runs as plain Qwen3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.loader import ModelConfig, Target
from rawserve.engine.lora import LoraBatch
from rawserve.engine.models.decoder import DecoderModel, rms_norm
from rawserve.engine.models.mrope import interleaved_streams, rope_tables


class Qwen3VLTextModel(DecoderModel):
    set_aside = ("model.visual.",)  # the tower loads them (models/vision.py)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attention_backend: str = "torch") -> None:
        super().__init__(cfg, dtype, attention_backend)
        self.rope_stream_of = interleaved_streams(cfg.mrope_section, cfg.head_dim // 2)
        self.rope_streams: torch.Tensor | None = None

    def targets(self) -> dict[str, Target]:
        return {name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: target
                for name, target in super().targets().items()}

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        super().init_rope(max_positions, device)
        self.rope_streams = torch.tensor(self.rope_stream_of, dtype=torch.int64, device=device)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.rope_cos, self.rope_sin, self.rope_streams, positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None, *, embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                deepstack: list[torch.Tensor] | None = None) -> torch.Tensor:
        """DecoderModel.forward, plus embeds: (rows [R], vectors [R, hidden]) replacing those tokens' embeddings,
        and deepstack: per early layer, [R, hidden] added at the same rows after that layer."""
        x = F.embedding(input_ids, self.embed_tokens).to(self.norm.dtype)  # [T, hidden]
        if embeds is not None:
            x.index_copy_(0, embeds[0], embeds[1].to(x.dtype))
        cos, sin = self.rope_tables(positions)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, lora)
            if deepstack and i < len(deepstack):  # the layer's output is residual + x: add into x
                x = x.index_add(0, embeds[0], deepstack[i].to(x.dtype))
        return rms_norm(residual + x, self.norm, self.cfg.rms_norm_eps)

