"""gpt-oss: GQA attention with biases and a learned sink logit per head, sliding-window layers alternating with
full ones on the paged KV cache (a window layer gathers only the blocks its window reaches), YaRN RoPE, and the
routed experts of moe.py (top-k then softmax, clamped SwiGLU with biases). As transformers' gpt_oss computes it.
"""
from __future__ import annotations

import math
import types

import torch

from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.attention.torch_backend import gather_blocks
from rawserve.engine.loader import ModelConfig, Target
from rawserve.engine.lora import LoraBatch
from rawserve.engine.models.decoder import DecoderLayer, DecoderModel, LinearOwner, _param, apply_rope, rms_norm
from rawserve.engine.models.moe import SparseMoe


def yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN: per frequency, a blend of the original (fast, extrapolated) and the factor-scaled (slow, interpolated)
    rates, ramped between the dimensions that turn beta_fast and beta_slow times over the original context; and the
    attention factor cos and sin are scaled by. Returns ([head_dim / 2] inverse frequencies, attention factor)."""
    s, dim, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or cfg.max_position_embeddings / original
    attention = s.get("attention_factor")
    if attention is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention = mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(fast), dim_turning(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original rate (high frequencies), 0: interpolated
    rates = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1 / (factor * rates)) * (1 - keep) + (1 / rates) * keep, float(attention)


def sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, sinks: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cache, with a per-head sink logit in the softmax's
    denominator (it takes probability mass and gives no value) and, when window > 0, keys older than `window`
    positions masked; the blocks wholly before the earliest position a chunk's window reaches are not gathered.
    Prefill chunks one sequence at a time, the decodes in one batch.

    q: [T, heads, D] -> [T, heads, D]. Computed in float32 (sinks: [heads] float32)."""
    out = torch.empty_like(q)
    starts, bs = meta.query_start_loc_cpu, meta.block_size
    decodes = []  # (sequence, token) of the one-token sequences
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        if starts[i + 1] - starts[i] == 1:
            decodes.append((i, starts[i]))
            continue
        start, end = starts[i], starts[i + 1]
        first_block = _first_position(seq_len, end - start, window) // bs
        blocks = meta.block_tables[i, first_block:-(-seq_len // bs)]
        k = gather_blocks(k_cache, blocks).flatten(0, 1)[:seq_len - first_block * bs]  # [L, kv_heads, D]
        v = gather_blocks(v_cache, blocks).flatten(0, 1)[:seq_len - first_block * bs]
        key_pos = torch.arange(first_block * bs, seq_len, device=q.device)
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device).unsqueeze(1)
        out[start:end] = _attend(q[start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                 _visible(key_pos, q_pos, window).unsqueeze(0), scale, sinks)[0]
    if decodes:
        # each decode's blocks from its window's first, padded to the longest run with block 0 (masked)
        runs = []
        for i, _ in decodes:
            seq_len = meta.seq_lens_cpu[i]
            first_block = _first_position(seq_len, 1, window) // bs
            runs.append((first_block, -(-seq_len // bs)))
        width = max(last - first for first, last in runs)
        tables = meta.block_tables.index_select(0, torch.tensor([i for i, _ in decodes], device=q.device))
        columns = torch.tensor([[min(first + j, last - 1) for j in range(width)] for first, last in runs],
                               device=q.device)
        blocks = tables.gather(1, columns).flatten()  # [B * width]
        num = len(decodes)
        k = gather_blocks(k_cache, blocks).view(num, width * bs, *k_cache.shape[2:])  # [B, L, kv_heads, D]
        v = gather_blocks(v_cache, blocks).view(num, width * bs, *v_cache.shape[2:])
        base = torch.tensor([first * bs for first, _ in runs], device=q.device).unsqueeze(1)
        # [B, L]: a padding block's positions lie past the sequence's end, so the causal mask hides them
        key_pos = base + torch.arange(width * bs, device=q.device)
        q_pos = torch.tensor([meta.seq_lens_cpu[i] - 1 for i, _ in decodes], device=q.device).unsqueeze(1)
        visible = _visible(key_pos, q_pos, window)
        tokens = torch.tensor([t for _, t in decodes], device=q.device)
        out[tokens] = _attend(q[tokens].unsqueeze(1), k, v, visible.unsqueeze(1), scale, sinks)[:, 0]
    return out


def _first_position(seq_len: int, q_len: int, window: int) -> int:
    """The earliest key position any of a chunk's queries (the last q_len of seq_len positions) may see."""
    return max(0, seq_len - q_len - window + 1) if window else 0


def _visible(key_pos: torch.Tensor, q_pos: torch.Tensor, window: int) -> torch.Tensor:
    visible = key_pos <= q_pos  # causal
    if window:
        visible &= key_pos > q_pos - window
    return visible


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
            sinks: torch.Tensor) -> torch.Tensor:
    """q [B, Q, heads, D], k and v [B, L, kv_heads, D], visible [B, Q, L] -> [B, Q, heads, D] at q's dtype."""
    num, q_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qh = q.float().view(num, q_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, kv, g, Q, D]
    scores = torch.matmul(qh, k.float().permute(0, 2, 3, 1).unsqueeze(2)) * scale  # [B, kv, g, Q, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    sink = sinks.view(1, kv_heads, group, 1, 1).expand(num, kv_heads, group, q_len, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    o = torch.matmul(probs, v.float().permute(0, 2, 1, 3).unsqueeze(2))  # [B, kv, g, Q, D]
    return o.permute(0, 3, 1, 2, 4).reshape(num, q_len, heads, dim).to(q.dtype)


class GptOssLayer(DecoderLayer):
    linear_names = ("qkv_proj", "o_proj")  # the experts hold their own weights

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, attention: types.ModuleType) -> None:
        super().__init__(cfg, dtype, index, attention)
        self.gate_up_proj = self.down_proj = None  # no dense MLP
        self.o_bias = _param(cfg.hidden_size, dtype=dtype)
        self.sinks = _param(cfg.num_heads, dtype=dtype)
        sliding = cfg.attention_layer_types[index] == "sliding_attention"
        self.window = cfg.sliding_window if sliding else 0
        self.moe = SparseMoe(cfg, dtype)
        self.sinks_f32: torch.Tensor | None = None  # (fuse_qk_norm)

    def targets(self, prefix: str) -> dict[str, Target]:
        t = {name: target for name, target in super().targets(prefix).items() if ".mlp." not in name}
        t[f"{prefix}.self_attn.o_proj.bias"] = (self.o_bias, 0, self.cfg.hidden_size)
        t[f"{prefix}.self_attn.sinks"] = (self.sinks, 0, self.cfg.num_heads)
        t.update(self.moe.targets(f"{prefix}.mlp"))
        return t

    def fuse_qk_norm(self) -> None:
        self.sinks_f32 = self.sinks.detach().float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        residual = x if residual is None else residual + x  # [T, hidden]
        qkv = self.linear(rms_norm(residual, self.input_layernorm, cfg.rms_norm_eps), "qkv_proj", self.qkv_bias,
                          lora)
        num_tokens = qkv.shape[0]
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=1)
        qk = apply_rope(qk.reshape(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin)
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
        k_cache, v_cache = kv_cache
        self.attention.write_kv(k, v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim), k_cache, v_cache,
                                meta.slot_mapping)
        attn = sink_attention(q, k_cache, v_cache, meta, self.scale, self.sinks_f32, self.window)
        residual = residual + self.linear(attn.reshape(num_tokens, self.q_size), "o_proj", self.o_bias, lora)
        return self.moe(rms_norm(residual, self.post_attention_layernorm, cfg.rms_norm_eps)), residual


class GptOssModel(DecoderModel):
    def make_layers(self, cfg: ModelConfig, dtype: torch.dtype, attention: types.ModuleType) -> list[LinearOwner]:
        return [GptOssLayer(cfg, dtype, i, attention) for i in range(cfg.num_layers)]

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        inv_freq, attention = yarn_inv_freq(self.cfg) if self.cfg.rope_scaling else (
            1.0 / (self.cfg.rope_theta ** (torch.arange(0, self.cfg.head_dim, 2).float() / self.cfg.head_dim)), 1.0)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(device)
        cos, sin = freqs.cos() * attention, freqs.sin() * attention
        self.rope_cos, self.rope_sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # see apply_rope
