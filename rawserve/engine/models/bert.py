"""BERT-family encoders (BertModel, XLMRobertaModel and their *ForSequenceClassification cross-encoders: bge, e5,
gte, bge-reranker) and EncoderRunner, which serves them to EngineCore as a model runner that only pools.

Bidirectional attention over a padded batch with a key-padding mask; no KV cache, so every request runs whole in
the step that admits it (Scheduler(whole_prompts=True)). Absolute positions (XLM-R's start after its padding id),
token type embeddings, post-LN layers, GELU.
"""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rawserve.config import EngineConfig
from rawserve.engine.loader import CheckpointError, safetensors_files
from rawserve.engine.pooling import ENCODER_ARCHITECTURES, PoolingSpec
from rawserve.engine.step_plan import ForwardBatch

log = logging.getLogger("rawserve.engine")

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EncoderConfig:
    family: str  # bert | xlm_roberta
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    hidden_act: str
    num_labels: int  # 0: no classification head
    dtype: torch.dtype

    @property
    def position_offset(self) -> int:
        """XLM-R numbers positions from padding_idx + 1 (its padding id is the position embedding it skips)."""
        return self.pad_token_id + 1 if self.family == "xlm_roberta" else 0

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings - self.position_offset


def read_encoder_config(model_dir: str | pathlib.Path) -> EncoderConfig:
    path = pathlib.Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read ({error})") from None
    arch = next((a for a in raw.get("architectures") or [] if a in ENCODER_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: not a BERT-family encoder ({', '.join(ENCODER_ARCHITECTURES)})")

    def need(name: str) -> int:
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
        return value

    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"{path}: position_embedding_type {raw['position_embedding_type']!r}; only absolute")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    if hidden % heads:
        raise CheckpointError(f"{path}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    labels = raw.get("id2label")
    num_labels = (len(labels) if isinstance(labels, dict) else int(raw.get("num_labels", 1) or 1)) \
        if arch.endswith("ForSequenceClassification") else 0
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return EncoderConfig(
        family=ENCODER_ARCHITECTURES[arch], architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
        num_layers=need("num_hidden_layers"), num_heads=heads, intermediate_size=need("intermediate_size"),
        max_position_embeddings=need("max_position_embeddings"), type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), pad_token_id=int(raw.get("pad_token_id") or 0),
        hidden_act=act, num_labels=num_labels, dtype=_DTYPE_NAMES.get(dtype_name, torch.float32))


def _linear(out_features: int, in_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.qkv = _linear(3 * h, h)  # query, key and value fused
        self.attn_out = _linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up = _linear(cfg.intermediate_size, h)
        self.down = _linear(h, cfg.intermediate_size)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, L, H]; mask: [B, 1, 1, L] bool, True for real tokens (keys a query may attend to)."""
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, L, head_dim]
        x = self.attn_norm(x + self.attn_out(attn.transpose(1, 2).reshape(b, n, h)))  # post-LN
        return self.out_norm(x + self.down(self.act(self.up(x))))


class EncoderModel(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        # Cross-encoders: XLM-R's head is dense + tanh + out_proj over <s>; BERT's is its pooler (dense + tanh)
        # then a classifier, over [CLS]. Either way: two matrices with a tanh between.
        self.head_dense = _linear(h, h) if cfg.num_labels else None
        self.head_out = _linear(cfg.num_labels, h) if cfg.num_labels else None
        self.num_params = sum(p.numel() for p in self.parameters())

    def targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """Checkpoint tensor name (without the bert./roberta. prefix) -> (parameter, first row, end row)."""
        h = self.cfg.hidden_size
        t = {"embeddings.word_embeddings.weight": (self.word_embeddings.weight, 0, self.cfg.vocab_size),
             "embeddings.position_embeddings.weight": (self.position_embeddings.weight, 0,
                                                       self.cfg.max_position_embeddings),
             "embeddings.token_type_embeddings.weight": (self.token_type_embeddings.weight, 0,
                                                         self.token_type_embeddings.weight.shape[0]),
             "embeddings.LayerNorm.weight": (self.embed_norm.weight, 0, h),
             "embeddings.LayerNorm.bias": (self.embed_norm.bias, 0, h)}
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}."
            for j, name in enumerate(("query", "key", "value")):
                t[f"{p}attention.self.{name}.weight"] = (layer.qkv.weight, j * h, (j + 1) * h)
                t[f"{p}attention.self.{name}.bias"] = (layer.qkv.bias, j * h, (j + 1) * h)
            for name, module in (("attention.output.dense", layer.attn_out), ("attention.output.LayerNorm",
                                 layer.attn_norm), ("intermediate.dense", layer.up), ("output.dense", layer.down),
                                 ("output.LayerNorm", layer.out_norm)):
                t[f"{p}{name}.weight"] = (module.weight, 0, module.weight.shape[0])
                t[f"{p}{name}.bias"] = (module.bias, 0, module.bias.shape[0])
        if self.head_dense is not None:
            dense, out = (("classifier.dense", "classifier.out_proj") if self.cfg.family == "xlm_roberta"
                          else ("pooler.dense", "classifier"))
            for name, module in ((dense, self.head_dense), (out, self.head_out)):
                t[f"{name}.weight"] = (module.weight, 0, module.weight.shape[0])
                t[f"{name}.bias"] = (module.bias, 0, module.bias.shape[0])
        return t

    def forward(self, input_ids: torch.Tensor, type_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids, type_ids: [B, L] (padded); lengths: [B] -> final hidden states [B, L, H]."""
        b, n = input_ids.shape
        arange = torch.arange(n, device=input_ids.device)
        valid = arange.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
        positions = (arange + self.cfg.position_offset).unsqueeze(0).expand(b, n)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) \
            + self.token_type_embeddings(type_ids)
        x = self.embed_norm(x)
        mask = valid[:, None, None, :]  # keys only: padded queries compute garbage nobody reads
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """[N, H] first-token hidden states -> [N, num_labels] logits."""
        return self.head_out(torch.tanh(self.head_dense(first)))


def load_encoder(model_dir: str | pathlib.Path, cfg: EncoderConfig, dtype: torch.dtype,
                 device: torch.device) -> EncoderModel:
    """Build the encoder and copy the checkpoint's tensors in (an encoder is small: no streaming tricks)."""
    from safetensors import safe_open

    with torch.device("meta"):
        model = EncoderModel(cfg)
    model = model.to_empty(device=device)
    targets = model.targets()
    missing = set(targets)
    with torch.no_grad():
        for file in safetensors_files(model_dir):
            with safe_open(str(file), framework="pt") as f:
                for full_name in f.keys():
                    name = full_name
                    for prefix in ("bert.", "roberta.", "model."):
                        if name.startswith(prefix) and name[len(prefix):] in targets:
                            name = name[len(prefix):]
                    target = targets.get(name)
                    if target is None:
                        if name.endswith(("position_ids", "token_type_ids")) or name.startswith(("pooler.", "lm_head.",
                                                                                                "cls.")):
                            continue  # buffers, and heads an embedding model does not use
                        raise CheckpointError(f"{file}: unexpected tensor {full_name!r}")
                    param, start, end = target
                    tensor = f.get_tensor(full_name)
                    if tuple(tensor.shape) != (end - start, *param.shape[1:]):
                        raise CheckpointError(f"{file}: tensor {full_name!r} has shape {tuple(tensor.shape)}, "
                                              f"expected {(end - start, *param.shape[1:])}")
                    param[start:end].copy_(tensor)
                    missing.discard(name)
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {', '.join(sorted(missing)[:5])} ({len(missing)} in all)")
    return model.to(dtype).eval()


class EncoderRunner:
    """EngineCore's model runner for an encoder: every step's requests are whole sequences to pool (the core refuses
    anything else), run as one padded batch. The KV "pool" is bookkeeping only (no tensors): blocks enough for
    --max-num-seqs sequences, so the scheduler's admission works unchanged."""

    def __init__(self, config: EngineConfig, spec: PoolingSpec) -> None:
        from rawserve.engine.model_runner import resolve_device

        if config.model_dir is None:
            raise ValueError("--model-dir: the model runner needs a checkpoint directory")
        self.config = config
        self.spec = spec
        self.model_config = cfg = read_encoder_config(config.model_dir)
        self.device = resolve_device(config)
        self.dtype = _DTYPE_NAMES[config.dtype] if config.dtype != "auto" else (
            cfg.dtype if self.device.type != "cpu" else torch.float32)
        self.max_model_len = min(config.max_model_len or cfg.max_tokens, cfg.max_tokens)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids: tuple[int, ...] = ()
        self.block_size = config.block_size
        self.num_blocks = config.max_num_seqs * -(-self.max_model_len // self.block_size)
        self.lora = None
        self.quant = None
        self.kv_plan = None
        self.releases_idle_kv = False
        self.idle_cached_blocks = 0
        torch.manual_seed(config.seed)
        self.model = load_encoder(config.model_dir, cfg, self.dtype, self.device)
        log.info("encoder %s: %s (%s), %s on %s, up to %d tokens a sequence", config.model_dir, cfg.architecture,
                 spec.describe(), self.dtype, self.device, self.max_model_len)

    @property
    def pooled_size(self) -> int:
        return self.model_config.num_labels or self.model_config.hidden_size

    def release_buffers(self) -> None:
        """Nothing is kept between steps."""

    def release_idle_kv(self, moves: list[tuple[int, int]], top: int) -> int:
        return 0

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """An encoder has no LM head: a step asks it for no logit rows (the core admits pooling requests only)."""
        if batch.logit_indices:
            raise ValueError("an encoder computes no logits")
        return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)

    @torch.inference_mode()
    def execute_pooling(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (no logits, float32 [len(pool_spans), pooled_size]): each span's summed final hidden states, or for a
        cross-encoder its classifier's logits over the span's (first) token."""
        seqs = batch.seqs
        longest = max(len(seq.token_ids) for seq in seqs)
        ids = torch.zeros((len(seqs), longest), dtype=torch.int64)
        types = torch.zeros((len(seqs), longest), dtype=torch.int64)
        for i, seq in enumerate(seqs):
            assert seq.num_computed_tokens == 0, "an encoder request runs whole (Scheduler.whole_prompts)"
            ids[i, :len(seq.token_ids)] = torch.tensor(seq.token_ids, dtype=torch.int64)
            if seq.type_split >= 0:
                types[i, seq.type_split:len(seq.token_ids)] = 1
        lengths = torch.tensor([len(seq.token_ids) for seq in seqs], dtype=torch.int64)
        dev = self.device
        hidden = self.model(ids.to(dev), types.to(dev), lengths.to(dev))  # [B, L, H]
        valid = torch.arange(longest, device=dev).unsqueeze(0) < lengths.to(dev).unsqueeze(1)
        flat = hidden[valid]  # [T, H], in the batch's flattened order
        pooled = torch.stack([flat[start:end].float().sum(0) for start, end in batch.pool_spans])
        if self.model.head_dense is not None:
            pooled = self.model.classify(pooled.to(self.dtype)).float()
        return torch.empty((0, self.vocab_size), dtype=torch.float32, device=dev), pooled
