"""One decoder for Qwen3, Qwen2/2.5 and Llama 3: RMSNorm, RoPE, GQA attention over a paged KV cache, SwiGLU.

Per-family switches come from ModelConfig (q/k norm, qkv bias, llama3 rope scaling, tied embeddings).
q/k/v and gate/up are fused into one matrix each (fewer, larger matmuls); the loader fills the slices.
"""
from __future__ import annotations

import logging
import math
import mmap
import pathlib
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rawserve.engine.attention import get_backend
from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.loader import ModelConfig, Target, TensorEntry, load_weights, map_tensor, mapped_embedding
from rawserve.engine.lora import LoraBatch, LoraWeights
from rawserve.engine.models.packed import PackedLinears, pack, packed_linear
from rawserve.engine.quant import QuantizedLinear, QuantPlan, quantize, quantized_bytes

log = logging.getLogger("rawserve.engine")
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the fused matmul weights of a layer


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Built under torch.device("meta") and materialised with to_empty(): no init cost, no second copy.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


_EPS: dict[float, torch.Tensor] = {}  # rms_normalize's eps as a float32 scalar tensor (CPU)


def rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                  inplace: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, times `weight` (float32, broadcast against x) when given, all
    in float32 -> a float32 tensor: a new one, or a float32 x itself when `inplace` (its caller reads x's old values
    nowhere after).

    On a CPU, F.rms_norm's arithmetic in fewer dispatched ops: there it is a composite of 24 (a Python scalar in an
    in-place op alone costs four), where this is 6 with a weight on a float32 x and 9 on a bf16 one, its upcast
    included. At one decode row an op costs more than its arithmetic, and a Qwen3.5-0.8B step runs 55 of these
    norms (one bf16 row, one thread, inference mode: 10 against 14 us, bests), and 18 gated ones
    (qwen35.GatedDeltaNetLayer.decode). The sum of squares comes as the L2 norm (one reduction) squared in the
    addcmul that adds eps: a rounding or two away from mean(x^2), as another reduction order is. On a GPU
    F.rms_norm is one fused kernel, and stays."""
    x32 = x if x.dtype == torch.float32 else x.float()  # (float() on a float32 x returns it, through a call)
    if x32.device.type != "cpu":
        if weight is None or weight.dim() == 1:
            return F.rms_norm(x32, x32.shape[-1:], weight, eps)
        return F.rms_norm(x32, x32.shape[-1:], None, eps).mul_(weight)
    eps_t = _EPS.get(eps)
    if eps_t is None:  # (made under inference mode it is still readable outside it: only read, never written)
        eps_t = _EPS[eps] = torch.tensor(eps, dtype=torch.float32)
    norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)  # [..., 1]
    inv_rms = torch.addcmul(eps_t, norm, norm, value=1.0 / x32.shape[-1]).rsqrt_()
    # x's upcast is this call's own tensor, scaled in place; a float32 x is the caller's, and is scaled in place
    # only when it says so
    normed = x32.mul_(inv_rms) if x32 is not x or inplace else x32 * inv_rms
    return normed if weight is None else normed.mul_(weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF semantics: normalise in float32, cast back, then scale by the weight (None: the caller scales).

    A float32 weight on a float32 x scales before any rounding (there is none); a narrow x is rounded once after
    normalising and then multiplied by its weight at its dtype, as HF multiplies after the rounding."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return rms_normalize(x, eps, weight)
    # (a GPU's fused F.rms_norm takes the narrow x as it is, normalising in float32 and rounding once)
    normed = rms_normalize(x, eps).to(x.dtype) if x.device.type == "cpu" else F.rms_norm(x, x.shape[-1:], None, eps)
    return normed if weight is None else weight * normed


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with Llama 3's long-context rescaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (neox) rotation as HF does, in float32. x: [T, H, D]; cos: [T, 1, D] (the half table twice);
    sin: [T, 1, D] (-sin, then sin), so that x * cos + roll(x) * sin is (x1 cos - x2 sin, x2 cos + x1 sin)
    exactly, in four ops."""
    if x.dtype == torch.float32:  # no cast calls at all (at one decode row each is a dispatch)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


class LinearOwner(PackedLinears):
    """A layer whose matmul weights (`linear_names`) run one way: quantized (--quantization), oneDNN pre-packed
    (CPU), or dense, plus LoRA deltas. Shared by every layer kind, so prepack, quantization and LoRA reach each
    one through the same hooks (DecoderModel.prepack, defer_quantized, enable_lora)."""

    linear_names: tuple[str, ...] = ()

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.lora: LoraWeights | None = None  # set by DecoderModel.enable_lora
        self.quant: dict[str, QuantizedLinear] = {}  # name -> quantized weight (--quantization)

    def prepack(self) -> None:
        """CPU: the matmul weights that are not quantized, pre-packed (batch-1 decode included: 2-4x)."""
        self.prepack_names(name for name in self.linear_names if name not in self.quant)

    def linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None,
               lora: LoraBatch | None = None) -> torch.Tensor:
        quantized = self.quant.get(name)
        y = quantized(x, bias) if quantized is not None else super().linear(x, name, bias)
        if lora is not None:  # the base matmul ran once for every row; adapter rows add their delta
            y = self.lora.apply(self.index, name, x, y, lora)
        return y

    def fuse_qk_norm(self) -> None:
        """Once the weights are in: fold what can be folded (see DecoderLayer.fuse_qk_norm); nothing by default."""


class DecoderLayer(LinearOwner):
    linear_names = LINEARS

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0,
                 attention: types.ModuleType | None = None) -> None:
        super().__init__(index)
        self.cfg = cfg
        self.attention = attention or get_backend("torch")  # the backend module: write_kv, paged_attention
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.post_attention_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.qkv_proj = _param(q_size + 2 * kv_size, cfg.hidden_size, dtype=dtype)
        self.qkv_bias = _param(q_size + 2 * kv_size, dtype=dtype) if cfg.qkv_bias else None
        self.o_proj = _param(cfg.hidden_size, q_size, dtype=dtype)
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.gate_up_proj = _param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.scale = cfg.head_dim ** -0.5
        self.qk_norm: torch.Tensor | None = None  # [heads + kv_heads, D]: q_norm's rows, then k_norm's (fuse_qk_norm)

    def fuse_qk_norm(self) -> None:
        """Once the weights are in: q_norm and k_norm as one [heads + kv_heads, D] table, so the q/k view is
        scaled by one multiply rather than two slices and two."""
        if self.q_norm is not None:
            cfg = self.cfg
            self.qk_norm = torch.cat((self.q_norm.expand(cfg.num_heads, -1), self.k_norm.expand(cfg.num_kv_heads, -1)))

    def targets(self, prefix: str) -> dict[str, Target]:
        q, kv, inter = self.q_size, self.kv_size, self.cfg.intermediate_size
        t: dict[str, Target] = {
            f"{prefix}.input_layernorm.weight": (self.input_layernorm, 0, self.cfg.hidden_size),
            f"{prefix}.post_attention_layernorm.weight": (self.post_attention_layernorm, 0, self.cfg.hidden_size),
            f"{prefix}.self_attn.q_proj.weight": (self.qkv_proj, 0, q),
            f"{prefix}.self_attn.k_proj.weight": (self.qkv_proj, q, q + kv),
            f"{prefix}.self_attn.v_proj.weight": (self.qkv_proj, q + kv, q + 2 * kv),
            f"{prefix}.self_attn.o_proj.weight": (self.o_proj, 0, self.cfg.hidden_size),
            f"{prefix}.mlp.gate_proj.weight": (self.gate_up_proj, 0, inter),
            f"{prefix}.mlp.up_proj.weight": (self.gate_up_proj, inter, 2 * inter),
            f"{prefix}.mlp.down_proj.weight": (self.down_proj, 0, self.cfg.hidden_size),
        }
        if self.qkv_bias is not None:
            t[f"{prefix}.self_attn.q_proj.bias"] = (self.qkv_bias, 0, q)
            t[f"{prefix}.self_attn.k_proj.bias"] = (self.qkv_bias, q, q + kv)
            t[f"{prefix}.self_attn.v_proj.bias"] = (self.qkv_bias, q + kv, q + 2 * kv)
        if self.q_norm is not None:
            t[f"{prefix}.self_attn.q_norm.weight"] = (self.q_norm, 0, self.cfg.head_dim)
            t[f"{prefix}.self_attn.k_norm.weight"] = (self.k_norm, 0, self.cfg.head_dim)
        return t

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        residual = x if residual is None else residual + x  # [T, hidden]
        h = rms_norm(residual, self.input_layernorm, eps)
        qkv = self.linear(h, "qkv_proj", self.qkv_bias, lora)  # [T, q + 2 kv]
        num_tokens = qkv.shape[0]
        # q and k side by side as one [T, heads + kv_heads, D] view: their norm and rotation run once, not twice
        # (at one row a decode step is a few hundred such small ops, each costing more than its arithmetic).
        heads = cfg.num_heads
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=1)  # one call, not two slices
        qk = qk.view(num_tokens, heads + cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            qk = rms_norm(qk, None, eps).mul_(self.qk_norm)
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split((heads, cfg.num_kv_heads), dim=1)
        k_cache, v_cache = kv_cache
        self.attention.write_kv(k, v.contiguous(), k_cache, v_cache, meta.slot_mapping)
        attn = self.attention.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, heads, D]
        h = self.linear(attn.reshape(num_tokens, self.q_size), "o_proj", lora=lora)
        residual = residual + h
        h = self.mlp(rms_norm(residual, self.post_attention_layernorm, eps), lora)
        return h, residual

    def mlp(self, h: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """The normed hidden states [T, hidden] -> the MLP's output (a MoE layer routes them instead: moe.py)."""
        gate_up = self.linear(h, "gate_up_proj", lora=lora)  # [T, 2 I]
        gate, up = gate_up.chunk(2, dim=1)
        return self.linear(F.silu(gate) * up, "down_proj", lora=lora)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, attention_backend: str = "torch") -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(self.make_layers(cfg, dtype, get_backend(attention_backend)))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.packed_head: torch.Tensor | None = None  # CPU: the LM head pre-packed by prepack()
        self.embedding_file: mmap.mmap | None = None  # the checkpoint file under embed_tokens (map_embedding)
        self.quant_head: QuantizedLinear | None = None  # --quantization: the LM head, quantized as it loads
        self.deferred: set[int] = set()  # ids of parameters left on meta for the quantizer (defer_quantized)
        # Counted now, while every weight is a parameter: pre-packing and quantizing empty them later.
        self.num_params = sum(p.numel() for p in self.parameters())
        self.rope_cos: torch.Tensor | None = None  # [max_pos, D] float32, built by init_rope() (see apply_rope)
        self.rope_sin: torch.Tensor | None = None

    # Checkpoint tensors that may be present and are not this model's (load_weights' set_aside).
    set_aside: tuple[str, ...] = ()

    def make_layers(self, cfg: ModelConfig, dtype: torch.dtype, attention: types.ModuleType) -> list[LinearOwner]:
        """The layer stack; a model of another layout (models/qwen35.py) builds its own kinds here."""
        return [DecoderLayer(cfg, dtype, i, attention) for i in range(cfg.num_layers)]

    def targets(self) -> dict[str, Target]:
        """Checkpoint tensor name -> where it goes."""
        t: dict[str, Target] = {"model.embed_tokens.weight": (self.embed_tokens, 0, self.cfg.vocab_size),
                                "model.norm.weight": (self.norm, 0, self.cfg.hidden_size)}
        for i, layer in enumerate(self.layers):
            t.update(layer.targets(f"model.layers.{i}"))
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, 0, self.cfg.vocab_size)
        return t

    def materialize(self, device: torch.device) -> None:
        """torch's to_empty(), but parameters deferred to the quantizer stay on meta (never allocated dense)."""
        for module in self.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) not in self.deferred:
                    setattr(module, name, nn.Parameter(torch.empty_like(param, device=device), requires_grad=False))

    def finish_load(self) -> None:
        """After the weights are in, before packing: each layer folds what it can (fuse_qk_norm)."""
        for layer in self.layers:
            layer.fuse_qk_norm()

    def load_checkpoint(self, model_dir: str | pathlib.Path, device: torch.device, *, prepack: bool,
                        quant: QuantPlan | None, on_filled: Callable | None) -> None:
        """Every loader's steps after materialize(): the embedding served from the file where it may be
        (map_embedding) or held narrow, the weights streamed in (on_filled quantizes each as it lands), the
        quantizer's and the layers' last folds, then the CPU packing when `prepack`."""
        targets = self.targets()
        head_apart = prepack or quant is not None  # the head reads its own packed or quantized copy
        embedding = mapped_embedding(model_dir, self.cfg, device, head_apart)
        if embedding is not None:
            self.map_embedding(embedding)
            del targets[embedding.name]
        else:
            self.narrow_embedding(head_packed=head_apart)
        load_weights(model_dir, targets, frozenset([embedding.name]) if embedding is not None else frozenset(),
                     on_filled, set_aside=self.set_aside)
        if quant is not None:
            self.finish_quantized(quant)
        self.finish_load()
        if prepack:
            self.prepack()

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        inv_freq = rope_inv_freq(self.cfg).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        self.rope_cos, self.rope_sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # see apply_rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (flattened, unpadded batch) -> final hidden states [T, hidden].

        lora: which tokens have an adapter and in which slot (None: none has, and LoRA costs nothing)."""
        x = F.embedding(input_ids, self.embed_tokens).to(self.norm.dtype)  # [T, hidden]; see narrow_embedding
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)  # [T, 1, D]
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta, lora)
        return rms_norm(residual + x, self.norm, self.cfg.rms_norm_eps)

    def enable_lora(self, weights: LoraWeights) -> None:
        """Give every layer the adapter slots it adds deltas from (the base weights stay as they are)."""
        for layer in self.layers:
            # lora.layer_modules and the layer kinds must name the same fused linears, or a delta would miss its matmul
            assert set(weights.layers[layer.index]) <= set(layer.linear_names), (layer.index, layer.linear_names)
            layer.lora = weights

    def prepack(self) -> None:
        """CPU: pre-pack every matmul weight (see DecoderLayer.prepack), the LM head included.

        A tied head is packed from the embedding (the lookups then read the checkpoint file, map_embedding): the
        vocabulary matmul is the largest single weight read of a decode step, and packed it runs faster (152k x
        256 float32, 2 cores: 40 vs 48 ms at 1 row, 81 vs 257 ms at 32, 613 vs 1006 ms at 256).
        """
        for layer in self.layers:
            layer.prepack()
        if self.quant_head is not None:
            return
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_head = pack(self._dense_head(weight.detach()))
        if self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        if self.embedding_file is not None:  # packing read every row: drop them from this process's pages
            self.embedding_file.madvise(mmap.MADV_DONTNEED)

    def _dense_head(self, weight: torch.Tensor) -> torch.Tensor:
        """The head's weight at the model's dtype, for packing. Converted from the mapped embedding a slice at a
        time, dropping the file's pages after each, so the load's peak holds the converted copy and the packed
        one, not the file's rows as well (74 MiB for the tiny model's bf16 rows, 311 for Qwen3-0.6B's)."""
        dtype = self.norm.dtype
        if self.embedding_file is None or weight.dtype == dtype:
            return weight.to(dtype)
        dense = torch.empty(weight.shape, dtype=dtype)
        step = max(1, (16 << 20) // (weight.shape[1] * weight.element_size()))
        for start in range(0, weight.shape[0], step):
            dense[start:start + step].copy_(weight[start:start + step])
            self.embedding_file.madvise(mmap.MADV_DONTNEED)
        return dense

    def map_embedding(self, entry: TensorEntry) -> None:
        """Before loading, for an embedding no matmul reads (the head untied, or packed): serve lookups from the
        checkpoint file itself, at its dtype (loader.map_tensor). A step reads one row per token, so only the
        rows in use are resident, as clean page cache shared with the file's, never a copy; the lookup casts
        its rows to the model's dtype, which is exact (the same cast a load would make)."""
        tensor, self.embedding_file = map_tensor(entry)
        self.embed_tokens.data = tensor

    def narrow_embedding(self, head_packed: bool) -> None:
        """Before loading, where map_embedding cannot serve it (a tensor misaligned in its file): hold the
        embedding at the checkpoint's dtype when that is narrower and no matmul reads it (the head is untied, or
        will be packed). Its values come from that dtype, so the lookup's cast back is exact; a bf16 checkpoint
        served in float32 keeps half the bytes of its largest tensor, and loads it with no conversion buffer."""
        narrow = self.cfg.dtype
        is_head = self.lm_head is None and not head_packed
        if is_head or not narrow.is_floating_point or narrow.itemsize >= self.embed_tokens.dtype.itemsize:
            return
        self.embed_tokens.data = torch.empty(self.embed_tokens.shape, dtype=narrow, device=self.embed_tokens.device)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; into `out` ([N, vocab] float32) when given and the head's
        own output is narrower (a copy into a reused buffer rather than a fresh float32 tensor)."""
        if self.quant_head is not None:
            logits = self.quant_head(hidden)
        elif self.packed_head is not None:
            logits = packed_linear(hidden, self.packed_head)
        else:
            logits = F.linear(hidden, self.embed_tokens if self.lm_head is None else self.lm_head)
        if logits.dtype == torch.float32:
            return logits
        return logits.float() if out is None else out.copy_(logits)

    def defer_quantized(self, plan: QuantPlan) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """Before loading, with the model still on the meta device: name the matrices `plan` quantizes, and
        return the loader's on_filled hook, which quantizes each one as its last slice arrives (a fused matrix
        once q, k and v, or gate and up, are all in) and keeps only the quantized form. The dense matrix lives
        only while its slices load, so peak memory is the quantized model plus a fused matrix or two.

        Shapes torch's int4 kernel cannot take stay dense at the model's dtype (logged); an untied LM head is
        quantized as it loads, a tied one from the embedding afterwards (finish_quantized)."""
        owners: dict[int, tuple[nn.Module, str, bool]] = {}  # id(meta parameter) -> (module, attribute, is_head)
        kept = []
        for layer in self.layers:
            for name in layer.linear_names:
                param = getattr(layer, name)
                if quantized_bytes(plan, *param.shape) is None:
                    kept.append(f"{name} {tuple(param.shape)}")
                    continue
                owners[id(param)] = (layer, name, False)
        if self.lm_head is not None:
            owners[id(self.lm_head)] = (self, "lm_head", True)
        if kept:
            log.info("quantization: %s kept at %s in every layer (int4 needs out %% 16 == 0 and in %% %d == 0)",
                     ", ".join(sorted(set(kept))), self.norm.dtype, plan.group_size)
        dtype = self.norm.dtype

        def on_filled(param: torch.Tensor, dense: torch.Tensor) -> None:
            module, name, is_head = owners[id(param)]
            quantized = quantize(dense, plan, head=is_head)
            if is_head:
                self.quant_head = quantized
            else:
                module.quant[name] = quantized
            setattr(module, name, nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))

        self.deferred = set(owners)
        return on_filled

    def finish_quantized(self, plan: QuantPlan) -> None:
        """After loading: a tied LM head gets its quantized copy (the embedding stays dense for the lookup)."""
        if self.lm_head is None:
            self.quant_head = quantize(self.embed_tokens.detach(), plan, head=True)
            if self.embedding_file is not None:  # quantizing read every row: drop them from this process's pages
                self.embedding_file.madvise(mmap.MADV_DONTNEED)

    @property
    def num_quantized(self) -> int:
        """Quantized matrices, the LM head and a MoE layer's experts (two each: models/moe.py) included."""
        experts = sum(layer.moe.experts.num_quantized for layer in self.layers if hasattr(layer, "moe"))
        return sum(len(layer.quant) for layer in self.layers) + (self.quant_head is not None) + experts
