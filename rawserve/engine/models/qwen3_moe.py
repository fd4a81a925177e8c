"""Qwen3-MoE (Qwen3's attention, a routed MoE MLP on the layers decoder_sparse_step / mlp_only_layers pick) and
Qwen3.5-MoE (the hybrid of qwen35.py with routed experts and a gated shared expert on every layer), and the load
of every MoE model (load_moe_model): DecoderModel's loading, packing and quantization, plus the experts'.
"""
from __future__ import annotations

import logging
import pathlib
import types

import torch
from torch import nn

from rawserve.engine.loader import ModelConfig, Target, read_model_config, safetensors_files
from rawserve.engine.lora import LoraBatch
from rawserve.engine.models.decoder import DecoderLayer, DecoderModel, LinearOwner
from rawserve.engine.models.moe import SparseMoe, checkpoint_names
from rawserve.engine.models.qwen35 import GatedAttentionLayer, GatedDeltaNetLayer, Qwen35Model
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.quant import QuantPlan

log = logging.getLogger("rawserve.engine")

_DENSE_MLP = (".mlp.gate_proj.weight", ".mlp.up_proj.weight", ".mlp.down_proj.weight")


def _without_dense_mlp(t: dict[str, Target]) -> dict[str, Target]:
    return {name: target for name, target in t.items() if not name.endswith(_DENSE_MLP)}


class MoeDecoderLayer(DecoderLayer):
    """A Qwen3-MoE sparse layer: DecoderLayer's attention, the routed experts for its MLP."""

    linear_names = ("qkv_proj", "o_proj")  # the experts hold their own weights (moe.Experts)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, attention: types.ModuleType) -> None:
        super().__init__(cfg, dtype, index, attention)
        self.gate_up_proj = self.down_proj = None  # no dense MLP: its targets are dropped below
        self.moe = SparseMoe(cfg, dtype)

    def targets(self, prefix: str) -> dict[str, Target]:
        return {**_without_dense_mlp(super().targets(prefix)), **self.moe.targets(f"{prefix}.mlp")}

    def mlp(self, h: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return self.moe(h)


class Qwen3MoeModel(DecoderModel):
    def make_layers(self, cfg: ModelConfig, dtype: torch.dtype, attention: types.ModuleType) -> list[LinearOwner]:
        return [MoeDecoderLayer(cfg, dtype, i, attention) if sparse else DecoderLayer(cfg, dtype, i, attention)
                for i, sparse in enumerate(cfg.moe.sparse_layers)]


class _MoeMlp:
    """Qwen3.5's MLP block with the routed experts and the gated shared expert in place of the dense SwiGLU."""

    def _init_moe(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.gate_up_proj = self.down_proj = None  # no dense MLP: its targets are dropped below
        self.moe = SparseMoe(cfg, dtype)

    def common_targets(self, prefix: str) -> dict[str, Target]:
        return {**_without_dense_mlp(super().common_targets(prefix)), **self.moe.targets(f"{prefix}.mlp")}

    def mlp_block(self, x: torch.Tensor, mixed: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        h = x + mixed
        return h + self.moe(self.norm(h, "post_attention_layernorm"))


class MoeGatedDeltaNetLayer(_MoeMlp, GatedDeltaNetLayer):
    linear_names = ("in_proj", "out_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, index)
        self._init_moe(cfg, dtype)


class MoeGatedAttentionLayer(_MoeMlp, GatedAttentionLayer):
    linear_names = ("qkv_proj", "o_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, attention: types.ModuleType) -> None:
        super().__init__(cfg, dtype, index, attention)
        self._init_moe(cfg, dtype)


class Qwen35MoeModel(Qwen35Model):
    def make_layers(self, cfg: ModelConfig, dtype: torch.dtype, attention: types.ModuleType) -> list[LinearOwner]:
        return [MoeGatedDeltaNetLayer(cfg, dtype, i) if kind == "linear_attention"
                else MoeGatedAttentionLayer(cfg, dtype, i, attention)
                for i, kind in enumerate(cfg.hybrid.layer_types)]


def moe_blocks(model: nn.Module) -> list[SparseMoe]:
    return [m for m in model.modules() if isinstance(m, SparseMoe)]


def model_class(cfg: ModelConfig) -> type[DecoderModel]:
    if cfg.family == "gpt_oss":
        from rawserve.engine.models.gpt_oss import GptOssModel

        return GptOssModel
    return Qwen35MoeModel if cfg.hybrid is not None else Qwen3MoeModel


def load_moe_model(model_dir: str | pathlib.Path, dtype: torch.dtype, device: torch.device,
                   cfg: ModelConfig | None = None, *, prepack: bool = True, attention_backend: str = "torch",
                   quant: QuantPlan | None = None) -> DecoderModel:
    """model_runner.load_model's steps for a MoE model: build on meta, pick the experts' checkpoint form, stream
    the weights in (quantizing the attention linears and each expert as they arrive), pack for the CPU."""
    cfg = cfg or read_model_config(model_dir)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, dtype, attention_backend)
    files = safetensors_files(model_dir)
    names = checkpoint_names(files)
    blocks = moe_blocks(model)
    for block in blocks:
        block.checkpoint_names = names
    on_filled = model.defer_quantized(quant) if quant is not None else None
    if quant is not None:
        for block in blocks:
            model.deferred |= block.experts.defer_quantized(quant)
    model.materialize(device)
    if any(name.endswith("_blocks") for name in names):
        log.info("MXFP4 expert weights: no CPU kernel computes on them here; dequantized to %s as they load%s",
                 str(dtype).removeprefix("torch."), f", then {quant.scheme}" if quant is not None else "")
    prepack = prepack and device.type == "cpu" and cpu_prepack_supported(dtype)
    model.load_checkpoint(model_dir, device, prepack=prepack, quant=quant, on_filled=on_filled)
    if prepack:
        for block in blocks:
            block.prepack()
    return model.eval()
