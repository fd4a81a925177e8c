"""Qwen3.5's hybrid text stack: Gated DeltaNet layers (state held outside the model, per sequence slot) and
gated full-attention layers (partial, interleaved M-RoPE) on the paged KV cache, as transformers' qwen3_5 computes
them. Built on DecoderModel's loading, pre-packing, quantization and LM head; the sequence ops are gated_delta's.
"""
from __future__ import annotations

import pathlib
import types

import torch
import torch.nn.functional as F

from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.loader import ModelConfig, Target, read_model_config
from rawserve.engine.lora import LoraBatch
from rawserve.engine.models.decoder import DecoderModel, LinearOwner, _param, rms_normalize
from rawserve.engine.models.delta_decode import decode_conv, decode_rule_at, scaled_l2_normalize
from rawserve.engine.models.gated_delta import CHUNK_SIZE, DeltaPlan, StateBatch, causal_conv, fold_scales, \
    gated_delta_rule, l2_normalize, plan_delta_step
from rawserve.engine.models.mrope import interleaved_streams, rope_tables
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.quant import QuantPlan

__all__ = ["LayerState", "Qwen35Model", "StateBatch", "load_qwen35_model"]

# One linear layer's state: (conv [num_slots, kernel - 1, conv_dim], recurrent [num_slots, Hv, dk, dv] float32,
# its scale [num_slots, Hv, 1, 1] float32: the true recurrent state is scale * recurrent, gated_delta's docstring).
LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x normalised and scaled by (1 + w) in float32, rounded once to x's dtype.
    `weight` is that (1 + w), float32, made once after loading (Qwen35Layer.fuse_qk_norm)."""
    normed = rms_normalize(x, eps, weight)
    return normed if x.dtype == torch.float32 else normed.to(x.dtype)


class Qwen35Layer(LinearOwner):
    """What both layer kinds share: the (1 + w) norms around the mixer, the SwiGLU MLP, the residual stream."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(index)
        self.cfg = cfg
        self.input_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.norm_scales: dict[str, torch.Tensor] = {}  # norm name -> (1 + w) in float32 (fuse_qk_norm)

    def common_targets(self, prefix: str) -> dict[str, Target]:
        hidden, inter = self.cfg.hidden_size, self.cfg.intermediate_size
        return {f"{prefix}.input_layernorm.weight": (self.input_layernorm, 0, hidden),
                f"{prefix}.post_attention_layernorm.weight": (self.post_attention_layernorm, 0, hidden),
                f"{prefix}.mlp.gate_proj.weight": (self.gate_up_proj, 0, inter),
                f"{prefix}.mlp.up_proj.weight": (self.gate_up_proj, inter, 2 * inter),
                f"{prefix}.mlp.down_proj.weight": (self.down_proj, 0, hidden)}

    def offset_norms(self) -> tuple[str, ...]:
        return "input_layernorm", "post_attention_layernorm"

    def fuse_qk_norm(self) -> None:
        """After loading (load_model's hook for every layer): the (1 + w) scales of the zero-centred norms."""
        self.norm_scales = {name: 1.0 + getattr(self, name).detach().float() for name in self.offset_norms()}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return offset_rms_norm(x, self.norm_scales[name], self.cfg.rms_norm_eps)

    def mlp_block(self, x: torch.Tensor, mixed: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """x + mixed, then the MLP's residual: the layer's output hidden states."""
        h = x + mixed
        gate, up = self.linear(self.norm(h, "post_attention_layernorm"), "gate_up_proj", lora=lora).chunk(2, dim=1)
        # silu(gate) * up into gate's half of the projection (read nowhere else): two fewer [T, intermediate]
        # tensors at a step's peak (the largest of a long prefill's layer: 235 MiB each at 8,192 tokens, float32)
        return h + self.linear(F.silu(gate, inplace=True).mul_(up), "down_proj", lora=lora)


class GatedDeltaNetLayer(Qwen35Layer):
    """A linear_attention layer: projections -> causal conv (state) -> delta rule (state) -> gated norm -> out."""

    linear_names = ("in_proj", "out_proj", "gate_up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, dtype, index)
        hy = cfg.hybrid
        self.num_k_heads, self.num_v_heads = hy.linear_num_key_heads, hy.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = hy.linear_key_head_dim, hy.linear_value_head_dim
        self.conv_dim, self.value_dim = hy.conv_dim, hy.value_dim
        # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one matrix: one matmul reads the hidden states
        self.in_proj = _param(self.conv_dim + self.value_dim + 2 * self.num_v_heads, cfg.hidden_size, dtype=dtype)
        self.conv1d = _param(self.conv_dim, 1, hy.linear_conv_kernel_dim, dtype=dtype)
        self.dt_bias = _param(self.num_v_heads, dtype=dtype)
        self.A_log = _param(self.num_v_heads, dtype=dtype)
        self.gated_norm = _param(self.head_v_dim, dtype=dtype)
        self.out_proj = _param(cfg.hidden_size, self.value_dim, dtype=dtype)
        self.conv_taps: torch.Tensor | None = None  # [K, conv_dim] float32 (fuse_qk_norm)
        self.neg_decay_rate: torch.Tensor | None = None  # [Hv] float32: -exp(A_log)
        self.dt_bias_f32: torch.Tensor | None = None  # [Hv] float32
        self.gated_norm_f32: torch.Tensor | None = None  # [dv] float32
        self.qk_scale: torch.Tensor | None = None  # [2 Hk, 1] float32: dk^-0.5 on q's heads, 1 on k's
        # the decode step's forms of the same (fuse_qk_norm): -exp(A_log) and dt_bias [Hv, 1, 1];
        # scaled_l2_normalize's eps and 1 / scale^2 per q and k head [2, Hk]
        self.neg_decay_rate_col: torch.Tensor | None = None
        self.dt_bias_col: torch.Tensor | None = None
        self.qk_eps: torch.Tensor | None = None
        self.qk_inv_scale_sq: torch.Tensor | None = None

    def targets(self, prefix: str) -> dict[str, Target]:
        conv, value, heads = self.conv_dim, self.value_dim, self.num_v_heads
        p = f"{prefix}.linear_attn"
        return {**self.common_targets(prefix),
                f"{p}.in_proj_qkv.weight": (self.in_proj, 0, conv),
                f"{p}.in_proj_z.weight": (self.in_proj, conv, conv + value),
                f"{p}.in_proj_b.weight": (self.in_proj, conv + value, conv + value + heads),
                f"{p}.in_proj_a.weight": (self.in_proj, conv + value + heads, conv + value + 2 * heads),
                f"{p}.conv1d.weight": (self.conv1d, 0, conv),
                f"{p}.dt_bias": (self.dt_bias, 0, heads),
                f"{p}.A_log": (self.A_log, 0, heads),
                f"{p}.norm.weight": (self.gated_norm, 0, self.head_v_dim),
                f"{p}.out_proj.weight": (self.out_proj, 0, self.cfg.hidden_size)}

    def fuse_qk_norm(self) -> None:
        super().fuse_qk_norm()
        self.conv_taps = self.conv1d.detach()[:, 0].t().float().contiguous()
        self.neg_decay_rate = -self.A_log.detach().float().exp()
        self.dt_bias_f32 = self.dt_bias.detach().float()
        self.gated_norm_f32 = self.gated_norm.detach().float()
        heads = self.num_k_heads
        self.qk_scale = torch.tensor([self.head_k_dim ** -0.5] * heads + [1.0] * heads,
                                     device=self.A_log.device).unsqueeze(1)
        self.neg_decay_rate_col = self.neg_decay_rate.view(-1, 1, 1)
        self.dt_bias_col = self.dt_bias_f32.view(-1, 1, 1)
        self.qk_inv_scale_sq = torch.tensor([float(self.head_k_dim), 1.0], device=self.A_log.device).view(2, 1) \
            .expand(2, heads).contiguous()
        self.qk_eps = torch.tensor(1e-6, device=self.A_log.device) * self.qk_inv_scale_sq

    def forward(self, x: torch.Tensor, state: LayerState, plan: DeltaPlan,
                lora: LoraBatch | None = None) -> torch.Tensor:
        conv_state, recurrent, scale = state
        if plan.fresh_slots is not None:  # sequences with no token computed yet start from zeros
            conv_state.index_fill_(0, plan.fresh_slots, 0)
        if plan.fresh_recurrent is not None:  # (fresh prefills' recurrent states: chunked_rule's zero_start)
            recurrent.index_fill_(0, plan.fresh_recurrent, 0)  # (zero under any scale: a slot's stays as it was)
        if plan.all_decode:
            return self.decode(x, conv_state, recurrent, scale, plan, lora)
        fold_scales(recurrent, scale, plan)  # the rule below reads and writes true states
        num_tokens = x.shape[0]
        proj = self.linear(self.norm(x, "input_layernorm"), "in_proj", lora=lora)  # [T, conv + value + 2 Hv]
        mixed = causal_conv(proj[:, :self.conv_dim], self.conv_taps, conv_state, plan)  # [T, conv_dim] float32
        # What the rest needs of proj, taken now so that proj (conv + value + 2 Hv wide) is freed before the rule:
        # the output gate silu(z) (value wide, float32 as it is applied), b and a (one cast side by side)
        z = proj[:, self.conv_dim:self.conv_dim + self.value_dim].float()
        gate = F.silu(z, inplace=proj.dtype != torch.float32)  # (a float32 z is a view of proj: not in place)
        ba = proj[:, -2 * self.num_v_heads:].float()
        beta = ba[:, :self.num_v_heads].sigmoid()  # [T, Hv]
        g = self.neg_decay_rate * F.softplus(ba[:, self.num_v_heads:] + self.dt_bias_f32)  # [T, Hv] log decay, <= 0
        del proj, z, ba
        key_dim = self.num_k_heads * self.head_k_dim
        qk, v = mixed.split((2 * key_dim, self.value_dim), dim=1)
        # q's and k's heads normalised as one [T, 2 Hk, dk] view, in place (the conv output is read nowhere else),
        # q's scale folded into the per-head factor
        qk = l2_normalize(qk.view(num_tokens, 2 * self.num_k_heads, self.head_k_dim), self.qk_scale, inplace=True)
        q, k = qk.split(self.num_k_heads, dim=1)
        group = self.num_v_heads // self.num_k_heads
        if group > 1:  # each key head serves `group` consecutive value heads
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)
        o = gated_delta_rule(q, k, v, g, beta, recurrent, plan)  # [T, Hv, dv] float32
        del mixed, qk, q, k, v
        # gated RMSNorm: plain weight (not 1 + w), then times silu(z), per value head; in place on the rule's output
        o = rms_normalize(o, self.cfg.rms_norm_eps, self.gated_norm_f32, inplace=True)
        o = o.mul_(gate.view(num_tokens, self.num_v_heads, self.head_v_dim)).to(x.dtype)
        del gate
        return self.mlp_block(x, self.linear(o.view(num_tokens, self.value_dim), "out_proj", lora=lora), lora)

    def decode(self, x: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor, scale: torch.Tensor,
               plan: DeltaPlan, lora: LoraBatch | None = None) -> torch.Tensor:
        """forward for a step of decodes only (plan.all_decode), the same arithmetic in fewer calls (at one row a
        call costs more than its arithmetic: the 0.8B's one-row step went from 2,005 top-level ops to 1,391). The
        conv and the rule take their one-token forms (decode_conv, decode_rule), z, b and a are one cast, the decay
        is made as the rule reads it (exp g), and q and k stay side by side from the conv to the rule."""
        num_seqs = x.shape[0]
        heads, dk, dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
        key_dim = self.num_k_heads * dk
        proj = self.linear(self.norm(x, "input_layernorm"), "in_proj", lora=lora)  # [B, conv + value + 2 Hv]
        mixed = decode_conv(proj[:, :self.conv_dim], self.conv_taps, conv_state, plan)  # [B, conv_dim] float32
        # z, b and a in float32 (a float32 proj: a view; its conv columns are read, the rest is read only here)
        z, ba = proj[:, self.conv_dim:].float().split((self.value_dim, 2 * heads), 1)
        gate = F.silu(z, inplace=True)  # [B, value]
        b, a = ba.view(num_seqs, 2, heads, 1, 1).unbind(1)  # [B, Hv, 1, 1] each
        decay = (self.neg_decay_rate_col * F.softplus(a + self.dt_bias_col)).exp_()
        qk, v = mixed.split((2 * key_dim, self.value_dim), 1)
        # [B, Hk, 2, dk], a new contiguous tensor: each head's q and k side by side, as the rule reads them
        qk = scaled_l2_normalize(qk.view(num_seqs, 2, self.num_k_heads, dk), self.qk_eps, self.qk_inv_scale_sq)
        if heads > self.num_k_heads:  # each key head serves `group` consecutive value heads
            qk = qk.repeat_interleave(heads // self.num_k_heads, dim=1)
        o = decode_rule_at(qk, v.view(num_seqs, heads, 1, dv), decay, b.sigmoid(), recurrent, scale,
                           plan)  # [B, Hv, 1, dv] float32, the rule's own tensor
        # gated RMSNorm: plain weight (not 1 + w), then times silu(z), per value head; in place on o (F.rms_norm is
        # a CPU composite of two dozen dispatched ops: with the gate 12.5 against 9.3 us at one row, 50 against 32
        # at 32 rows)
        o = rms_normalize(o, self.cfg.rms_norm_eps, self.gated_norm_f32, inplace=True) \
            .mul_(gate.view(num_seqs, heads, 1, dv))
        return self.mlp_block(x, self.linear(o.to(x.dtype).view(num_seqs, self.value_dim), "out_proj", lora=lora),
                              lora)


class GatedAttentionLayer(Qwen35Layer):
    """A full_attention layer: GQA with (1 + w) q/k norms, partial rotary, an output gate from q_proj."""

    linear_names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int, attention: types.ModuleType) -> None:
        super().__init__(cfg, dtype, index)
        self.attention = attention
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q_proj as saved: per head, head_dim query rows then head_dim gate rows; then k, then v
        self.qkv_proj = _param(2 * self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(2 * self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o_proj = _param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.q_norm = _param(cfg.head_dim, dtype=dtype)
        self.k_norm = _param(cfg.head_dim, dtype=dtype)
        self.scale = cfg.head_dim ** -0.5
        self.qk_norm_scale: torch.Tensor | None = None  # [heads + kv_heads, D] float32: q_norm's (1 + w) rows, k_norm's

    def fuse_qk_norm(self) -> None:
        super().fuse_qk_norm()
        cfg = self.cfg
        self.qk_norm_scale = torch.cat((self.norm_scales["q_norm"].expand(cfg.num_heads, cfg.head_dim),
                                        self.norm_scales["k_norm"].expand(cfg.num_kv_heads, cfg.head_dim)))

    def offset_norms(self) -> tuple[str, ...]:
        return "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"

    def targets(self, prefix: str) -> dict[str, Target]:
        q2, kv, hd = 2 * self.q_size, self.kv_size, self.cfg.head_dim
        p = f"{prefix}.self_attn"
        t = {**self.common_targets(prefix),
             f"{p}.q_proj.weight": (self.qkv_proj, 0, q2),
             f"{p}.k_proj.weight": (self.qkv_proj, q2, q2 + kv),
             f"{p}.v_proj.weight": (self.qkv_proj, q2 + kv, q2 + 2 * kv),
             f"{p}.o_proj.weight": (self.o_proj, 0, self.cfg.hidden_size),
             f"{p}.q_norm.weight": (self.q_norm, 0, hd),
             f"{p}.k_norm.weight": (self.k_norm, 0, hd)}
        if self.qkv_bias is not None:
            t[f"{p}.q_proj.bias"] = (self.qkv_bias, 0, q2)
            t[f"{p}.k_proj.bias"] = (self.qkv_bias, q2, q2 + kv)
            t[f"{p}.v_proj.bias"] = (self.qkv_bias, q2 + kv, q2 + 2 * kv)
        return t

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        cfg = self.cfg
        num_tokens, heads, kv_heads, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self.linear(self.norm(x, "input_layernorm"), "qkv_proj", self.qkv_bias, lora)
        qg, k, v = qkv.split((2 * self.q_size, self.kv_size, self.kv_size), dim=1)
        q, gate = qg.view(num_tokens, heads, 2, hd).unbind(2)  # [T, heads, D] each
        # q's and k's heads as one float32 [T, heads + kv_heads, D] tensor: one norm (their (1 + w) rows side by
        # side), one rotation, one rounding back (the norm's output is not rounded before the rotation reads it)
        qk = rms_normalize(torch.cat((q, k.view(num_tokens, kv_heads, hd)), 1), cfg.rms_norm_eps, self.qk_norm_scale)
        rot = cos.shape[-1]  # partial rotary: the first `rot` dims of each head turn, the rest pass through
        turn = qk[..., :rot]  # x cos + roll(x) sin in place (see decoder.apply_rope)
        rolled = turn.roll(rot // 2, -1)
        turn.mul_(cos).addcmul_(rolled, sin)
        q, k = qk.to(x.dtype).split((heads, kv_heads), 1)
        k_cache, v_cache = kv_cache
        self.attention.write_kv(k, v.view(num_tokens, kv_heads, hd), k_cache, v_cache, meta.slot_mapping)
        attn = self.attention.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, D]
        attn = torch.sigmoid(gate).mul_(attn).reshape(num_tokens, self.q_size)  # (gate and attn: [T, heads, D])
        return self.mlp_block(x, self.linear(attn, "o_proj", lora=lora), lora)


class Qwen35Model(DecoderModel):
    """The hybrid stack. Beside DecoderModel's forward arguments it takes the linear layers' states (one
    LayerState per linear layer, in layer order; allocate_states) and the step's StateBatch; kv_caches holds one
    pair per full-attention layer only, in layer order (num_kv_layers). positions: [T], or [3, T] M-RoPE streams
    (temporal, height, width; equal for text)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attention_backend: str = "torch",
                 chunk_size: int = CHUNK_SIZE) -> None:
        super().__init__(cfg, dtype, attention_backend)
        self.chunk_size = chunk_size
        self.final_norm_scale: torch.Tensor | None = None  # (1 + w) of the final norm, float32 (finish_load)
        self.set_aside = cfg.hybrid.set_aside_prefixes
        self.rope_stream_of = interleaved_streams(cfg.hybrid.mrope_section, cfg.rotary_dim // 2)
        self.rope_streams: torch.Tensor | None = None  # [rot] int64 on the model's device (init_rope)

    def make_layers(self, cfg: ModelConfig, dtype: torch.dtype, attention: types.ModuleType) -> list[LinearOwner]:
        return [GatedDeltaNetLayer(cfg, dtype, i) if kind == "linear_attention"
                else GatedAttentionLayer(cfg, dtype, i, attention)
                for i, kind in enumerate(cfg.hybrid.layer_types)]

    @property
    def num_kv_layers(self) -> int:
        """Full-attention layers: the paged KV cache holds one (K, V) pair for each of them only."""
        return sum(isinstance(layer, GatedAttentionLayer) for layer in self.layers)

    @property
    def num_state_layers(self) -> int:
        return len(self.layers) - self.num_kv_layers

    def state_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state, its scale) shapes of one linear layer for num_slots sequences. The conv
        state holds each sequence's last K - 1 inputs oldest first, each a contiguous row (gated_delta.decode_conv)."""
        hy = self.cfg.hybrid
        heads = hy.linear_num_value_heads
        return ((num_slots, hy.linear_conv_kernel_dim - 1, hy.conv_dim),
                (num_slots, heads, hy.linear_key_head_dim, hy.linear_value_head_dim), (num_slots, heads, 1, 1))

    def state_bytes_per_slot(self) -> int:
        conv, rec, scale = self.state_shapes(1)
        return self.num_state_layers * (conv[1] * conv[2] * self.norm.element_size()
                                        + (rec[1] * rec[2] * rec[3] + scale[1]) * 4)

    def allocate_states(self, num_slots: int, device: torch.device) -> list[LayerState]:
        """Zeroed states for num_slots sequences: conv at the model's dtype, recurrent in float32 (as transformers
        keeps it: the recurrence accumulates over the whole sequence), scales 1."""
        conv, rec, scale = self.state_shapes(num_slots)
        return [(torch.zeros(conv, dtype=self.norm.dtype, device=device),
                 torch.zeros(rec, dtype=torch.float32, device=device),
                 torch.ones(scale, dtype=torch.float32, device=device)) for _ in range(self.num_state_layers)]

    def targets(self) -> dict[str, Target]:
        prefix = self.cfg.hybrid.tensor_prefix
        t: dict[str, Target] = {f"{prefix}embed_tokens.weight": (self.embed_tokens, 0, self.cfg.vocab_size),
                                f"{prefix}norm.weight": (self.norm, 0, self.cfg.hidden_size)}
        for i, layer in enumerate(self.layers):
            t.update(layer.targets(f"{prefix}layers.{i}"))
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, 0, self.cfg.vocab_size)
        return t

    def finish_load(self) -> None:
        """After the weights are in: the layers' derived tables, and the final norm's (1 + w)."""
        super().finish_load()
        self.final_norm_scale = 1.0 + self.norm.detach().float()

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        rot = self.cfg.rotary_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).to(device)
        cos, sin = freqs.cos(), freqs.sin()
        self.rope_cos, self.rope_sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # see apply_rope
        self.rope_streams = torch.tensor(self.rope_stream_of, dtype=torch.int64, device=device)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot] for positions [T] (text) or [3, T] (M-RoPE)."""
        return rope_tables(self.rope_cos, self.rope_sin, self.rope_streams, positions)

    def plan_states(self, state: StateBatch, meta: AttentionMetadata) -> DeltaPlan:
        """The step's DeltaPlan (once per forward; every linear layer reads it)."""
        return plan_delta_step(state, meta.query_start_loc_cpu, self.cfg.hybrid.linear_conv_kernel_dim,
                               self.norm.device, self.chunk_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None, *, states: list[LayerState] | None = None,
                state_batch: StateBatch | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids: [T]; positions: [T] or [3, T] -> final hidden states [T, hidden]. Reads and writes the
        states of the step's slots (state_batch) in place, and the KV cache at meta.slot_mapping.
        embeds: (rows [R], vectors [R, hidden]) that replace those tokens' embeddings (an image's placeholders)."""
        assert states is not None and state_batch is not None, "a hybrid model's forward needs its states"
        plan = self.plan_states(state_batch, meta)
        x = F.embedding(input_ids, self.embed_tokens).to(self.norm.dtype)  # [T, hidden]
        if embeds is not None:
            x.index_copy_(0, embeds[0], embeds[1].to(x.dtype))
        cos, sin = self.rope_tables(positions)
        kv = iter(kv_caches)
        linear_states = iter(states)
        for layer in self.layers:
            if isinstance(layer, GatedDeltaNetLayer):
                x = layer(x, next(linear_states), plan, lora)
            else:
                x = layer(x, cos, sin, next(kv), meta, lora)
        return offset_rms_norm(x, self.final_norm_scale, self.cfg.rms_norm_eps)


def load_qwen35_model(model_dir: str | pathlib.Path, dtype: torch.dtype, device: torch.device,
                      cfg: ModelConfig | None = None, *, prepack: bool = True, attention_backend: str = "torch",
                      quant: QuantPlan | None = None, chunk_size: int = CHUNK_SIZE) -> Qwen35Model:
    """model_runner.load_model's steps for the hybrid: build on meta, stream the weights in (quantizing the
    linears as they arrive), set aside the vision tower and MTP tensors, then pack for the CPU.

    The embedding is served from the file (DecoderModel.map_embedding) under the same rule as load_model's."""
    cfg = cfg or read_model_config(model_dir)
    with torch.device("meta"):
        model = Qwen35Model(cfg, dtype, attention_backend, chunk_size)
    on_filled = model.defer_quantized(quant) if quant is not None else None
    model.materialize(device)
    prepack = prepack and device.type == "cpu" and cpu_prepack_supported(dtype)
    model.load_checkpoint(model_dir, device, prepack=prepack, quant=quant, on_filled=on_filled)
    return model.eval()
