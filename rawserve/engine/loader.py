"""Hugging Face checkpoint directory -> ModelConfig and weights (safetensors, single or sharded).

Owns every check on what a checkpoint holds; each failure names the file, tensor or field.
Weights stream one tensor at a time into preallocated parameters, so a load never holds a second full copy
of the model; a tensor read only a few rows at a time (the embedding) can stay in its file, mapped (map_tensor).
"""
from __future__ import annotations

import json
import logging
import math
import mmap
import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
import torch

from rawserve.logs import Progress
from rawserve.process_stats import release_free_heap

log = logging.getLogger("rawserve.engine")

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # text stack under text_config, model.language_model.*
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3VLForConditionalGeneration": "qwen3",  # Qwen3 text (model.language_model.*) with M-RoPE, a vision tower
    # mixture-of-experts (ModelConfig.moe; models/moe.py)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",  # the hybrid with routed experts and a shared expert
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "GptOssForCausalLM": "gpt_oss",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file, tensor or field."""


@dataclass(slots=True)
class HybridConfig:
    """Qwen3.5's hybrid text stack: which layers are Gated DeltaNet ("linear_attention") and which gated full
    attention, the DeltaNet shapes, the partial M-RoPE of the attention layers, and where its tensors live."""

    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention", one per layer
    linear_num_key_heads: int
    linear_num_value_heads: int  # a multiple of the key heads: each key head serves a group of value heads
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    partial_rotary_factor: float  # the share of head_dim that is rotated
    mrope_section: tuple[int, ...]  # frequencies per position stream (temporal, height, width), interleaved
    tensor_prefix: str  # "model.language_model." (conditional-generation form) or "model." (text only)
    set_aside_prefixes: tuple[str, ...]  # tensors recognised but not ours (vision tower, MTP head)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv (q, k and v side by side), and of each row of its state."""
        return 2 * self.key_dim + self.value_dim


@dataclass(slots=True)
class VisionConfig:
    """The vision tower of a Qwen3.5 / Qwen3-VL checkpoint (config.json's vision_config, the image token id):
    what models/vision.py builds and the core's multimodal manager sizes images by."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    deepstack_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose output feeds the first text layers


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts MLP: how tokens are routed and what each expert computes (models/moe.py)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    router: str  # "softmax_topk" (Qwen: softmax, top-k, renormalised if norm_topk_prob) | "topk_softmax" (gpt-oss)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: one always-on expert behind a sigmoid gate
    activation: str = "silu"  # "silu" (SwiGLU) | "gpt_oss" (clamped, alpha-scaled, (up + 1) * glu)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # gpt-oss: biases on the router and on both expert matmuls


@dataclass(slots=True)
class ModelConfig:
    family: str  # qwen3 | qwen2 | llama | qwen3_5 (Qwen3.5-MoE too) | qwen3_moe | gpt_oss
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    dtype: torch.dtype = torch.float32  # the checkpoint's own dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict)
    hybrid: HybridConfig | None = None  # qwen3_5 only
    vision: VisionConfig | None = None  # a conditional-generation checkpoint's vision tower
    mrope_section: tuple[int, ...] = ()  # Qwen3-VL's text model: interleaved M-RoPE (Qwen3.5's is in hybrid)
    moe: MoEConfig | None = None  # mixture-of-experts families
    sliding_window: int = 0  # gpt-oss: tokens a sliding_attention layer sees (0: none)
    attention_layer_types: tuple[str, ...] = ()  # gpt-oss: "sliding_attention" | "full_attention" per layer

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (all but for a partial rotary factor)."""
        factor = self.hybrid.partial_rotary_factor if self.hybrid is not None else 1.0
        return int(self.head_dim * factor)


def _read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def read_model_config(model_dir: str | pathlib.Path) -> ModelConfig:
    """Parse config.json (and generation_config.json's eos ids) into a ModelConfig."""
    root = pathlib.Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: model directory does not exist")
    path = root / "config.json"
    raw = _read_json(path)
    architectures = raw.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        found = ", ".join(map(str, architectures)) or f"model_type={raw.get('model_type')!r}"
        raise CheckpointError(f"{path}: unsupported architecture {found}; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    top = raw
    if family in ("qwen3_5", "qwen3") and "text_config" in raw:  # the conditional-generation form nests the text
        raw = raw["text_config"]
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: field 'text_config' must be an object")

    def need(name: str, kind: type = int) -> object:
        if name not in raw or raw[name] is None:
            raise CheckpointError(f"{path}: missing field {name!r}")
        value = raw[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"{path}: field {name!r} must be a positive integer, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{path}: field {name!r} must be a number, got {value!r}")
        return value

    hidden = need("hidden_size")
    num_heads = need("num_attention_heads")
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    head_dim = raw.get("head_dim") or hidden // num_heads
    if num_heads % num_kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads ({num_heads}) is not a multiple of "
                              f"num_key_value_heads ({num_kv_heads})")
    # transformers >= 5 writes rope_parameters; published checkpoints write rope_theta/rope_scaling.
    rope_params = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default")
                                          else None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "default") and not (kind == "yarn" and family == "gpt_oss"):
            raise CheckpointError(f"{path}: rope_scaling type {kind!r} is not supported (supported: llama3; yarn "
                                  "for gpt-oss)")
        if kind == "default":
            scaling = None
    dtype_name = top.get("torch_dtype") or top.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") \
        or "float32"
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{path}: unsupported torch_dtype {dtype_name!r}")
    eos = _ids(raw.get("eos_token_id")) or _ids(top.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.exists():
        gen_eos = _ids(_read_json(gen_path).get("eos_token_id"))
        eos = gen_eos or eos
    moe = _moe_config(path, raw, family, need) if "Moe" in arch or family == "gpt_oss" else None
    layer_kinds: tuple[str, ...] = ()
    if family == "gpt_oss":
        layer_kinds = tuple(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                        for i in range(need("num_hidden_layers"))])
        if len(layer_kinds) != need("num_hidden_layers") or \
                any(t not in ("sliding_attention", "full_attention") for t in layer_kinds):
            raise CheckpointError(f"{path}: field 'layer_types' must list 'sliding_attention' or 'full_attention' "
                                  f"for each layer, got {list(layer_kinds)!r}")
    return ModelConfig(
        family=family, architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
        intermediate_size=(raw.get("intermediate_size") or moe.expert_intermediate_size) if moe is not None
        else need("intermediate_size"), num_layers=need("num_hidden_layers"),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_5", "qwen3_moe"), rope_scaling=scaling, dtype=_DTYPES[dtype_name],
        eos_token_ids=eos, bos_token_id=raw.get("bos_token_id"),
        hybrid=(_hybrid_config(path, raw, arch.endswith("ForConditionalGeneration"), need) if family == "qwen3_5"
                else None),
        vision=_vision_config(path, top) if arch.endswith("ForConditionalGeneration") else None,
        mrope_section=tuple(rope_params.get("mrope_section") or ()) if arch == "Qwen3VLForConditionalGeneration"
        else (),
        moe=moe, sliding_window=int(raw.get("sliding_window") or 0) if family == "gpt_oss" else 0,
        attention_layer_types=layer_kinds)


def _vision_config(path: pathlib.Path, top: dict) -> VisionConfig:
    raw = top.get("vision_config")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: field 'vision_config' must be an object")
    values = {}
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                 "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{path}: field 'vision_config.{name}' must be a positive integer, got {value!r}")
        values[name] = value
    if values["hidden_size"] % values["num_heads"] or math.isqrt(values["num_position_embeddings"]) ** 2 \
            != values["num_position_embeddings"]:
        raise CheckpointError(f"{path}: vision_config: hidden_size must split into num_heads and "
                              "num_position_embeddings be a square")
    image_token_id = top.get("image_token_id")
    if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
        raise CheckpointError(f"{path}: field 'image_token_id' must be an integer, got {image_token_id!r}")
    deepstack = raw.get("deepstack_visual_indexes") or ()
    if not all(isinstance(i, int) and 0 <= i < values["depth"] for i in deepstack):
        raise CheckpointError(f"{path}: vision_config.deepstack_visual_indexes must name blocks, got {deepstack!r}")
    return VisionConfig(**values, hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
                        rope_theta=float((raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                        image_token_id=image_token_id, deepstack_indexes=tuple(deepstack))


def _moe_config(path: pathlib.Path, raw: dict, family: str, need: Callable[..., object]) -> MoEConfig:
    """The experts' fields: Qwen3-MoE's (num_experts, decoder_sparse_step, mlp_only_layers), Qwen3.5-MoE's (every
    layer routed, a shared expert) and gpt-oss's (num_local_experts, top-k then softmax, clamped SwiGLU)."""
    num_layers = need("num_hidden_layers")
    num_experts = raw.get("num_experts") or raw.get("num_local_experts")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise CheckpointError(f"{path}: field 'num_experts' (or 'num_local_experts') must be a positive integer, "
                              f"got {num_experts!r}")
    top_k = need("num_experts_per_tok")
    if top_k > num_experts:
        raise CheckpointError(f"{path}: num_experts_per_tok ({top_k}) exceeds the {num_experts} experts")
    if family == "gpt_oss":
        return MoEConfig(num_experts, top_k, need("intermediate_size"), "topk_softmax", False, (True,) * num_layers,
                         activation="gpt_oss", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                         swiglu_limit=float(raw.get("swiglu_limit", 7.0)), expert_bias=True)
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = raw.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1 or not isinstance(dense, list) \
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise CheckpointError(f"{path}: fields 'decoder_sparse_step' (a positive integer, got {step!r}) and "
                              f"'mlp_only_layers' (a list of layer indices, got {dense!r}) are malformed")
    dense = set(dense)
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = (raw.get("shared_expert_intermediate_size") or 0) if family == "qwen3_5" else 0
    return MoEConfig(num_experts, top_k, need("moe_intermediate_size"), "softmax_topk",
                     # Qwen3.5-MoE renormalises always (its router has no switch)
                     bool(raw.get("norm_topk_prob", True)) or family == "qwen3_5", sparse,
                     shared_expert_intermediate_size=shared)


def _hybrid_config(path: pathlib.Path, raw: dict, nested: bool, need: Callable[..., object]) -> HybridConfig:
    """Qwen3.5's text fields (raw: the text config). layer_types as written, else transformers' default: every
    full_attention_interval-th layer full attention, the rest linear."""
    num_layers = need("num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        interval = raw.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if (not isinstance(types, list) or len(types) != num_layers
            or any(t not in ("linear_attention", "full_attention") for t in types)):
        raise CheckpointError(f"{path}: field 'layer_types' must list 'linear_attention' or 'full_attention' for "
                              f"each of the {num_layers} layers, got {types!r}")
    rope = raw.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section", raw.get("mrope_section", [11, 11, 10]))
    head_dim = raw.get("head_dim") or need("hidden_size") // need("num_attention_heads")
    if (not isinstance(section, list) or len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section)
            or sum(section) != int(head_dim * factor) // 2):
        raise CheckpointError(f"{path}: rope_parameters.mrope_section {section!r} must be three counts adding up to "
                              f"the rotated half-dimension {int(head_dim * factor) // 2}")
    key_heads, value_heads = need("linear_num_key_heads"), need("linear_num_value_heads")
    if value_heads % key_heads:
        raise CheckpointError(f"{path}: linear_num_value_heads ({value_heads}) is not a multiple of "
                              f"linear_num_key_heads ({key_heads})")
    return HybridConfig(
        layer_types=tuple(types), linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=need("linear_key_head_dim"), linear_value_head_dim=need("linear_value_head_dim"),
        linear_conv_kernel_dim=need("linear_conv_kernel_dim"), partial_rotary_factor=float(factor),
        mrope_section=tuple(section), tensor_prefix="model.language_model." if nested else "model.",
        set_aside_prefixes=("model.visual.", "mtp.", "model.mtp."))


def safetensors_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """The weight files: the index's shards when model.safetensors.index.json exists, else *.safetensors."""
    root = pathlib.Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        files = [root / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root}: no *.safetensors weight files")
    for file in files:
        if not file.exists():
            raise CheckpointError(f"{file}: weight file listed in the index is missing")
    return files


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


@dataclass(slots=True)
class TensorEntry:
    name: str
    file: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    num_bytes: int


def read_safetensors_header(file: pathlib.Path) -> list[TensorEntry]:
    """Parse a safetensors header and check every tensor lies inside the file (catches truncation)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if header_len < 2 or 8 + header_len > size:
                raise CheckpointError(f"{file}: cannot read safetensors file (header of {header_len} bytes in a "
                                      f"{size}-byte file); it may be truncated or corrupt")
            header = json.loads(f.read(header_len))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: cannot read safetensors file ({error}); it may be truncated or "
                              "corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: cannot read safetensors file (header is not an object); it may be "
                              "truncated or corrupt")
    return tensor_entries(header, file, size, 8 + header_len, _ST_DTYPES, CheckpointError)


def tensor_entries(header: dict, file: pathlib.Path, size: int, base: int, dtypes: Mapping[str, torch.dtype],
                   error: Callable[[str], Exception], show: Callable[[object], str] = repr) -> list[TensorEntry]:
    """The tensors of a parsed safetensors header whose data starts at byte `base` of a `size`-byte file, each
    checked for a dtype in `dtypes`, a byte count that matches its shape, and an end inside the file (a truncated
    file). `error(message)` is what a bad entry raises; `show` quotes a name or shape from the file."""
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtypes[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise error(f"{file}: tensor {show(name)} has an unreadable header entry or a dtype other than "
                        f"{', '.join(dtypes)}") from None
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise error(f"{file}: tensor {show(name)} has a negative shape or offset")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise error(f"{file}: tensor {show(name)} has {end - begin} bytes for shape {show(shape)}")
        if base + end > size:
            raise error(f"{file}: cannot read safetensors file (tensor {show(name)} ends at byte {base + end} of a "
                        f"{size}-byte file); it may be truncated or corrupt")
        entries.append(TensorEntry(name, file, dtype, shape, base + begin, end - begin))
    return entries


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's memory, for readinto() straight into it."""
    import ctypes

    buffer = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


# A dtype conversion reads through a buffer of at most this many bytes (whole rows), not one of the tensor's size:
# an untied bf16 LM head of 152k x 1024 served in float32 would otherwise stage 311 MB beside its target.
STAGING_BYTES = 16 << 20


def read_tensor_into(entry: TensorEntry, f, out: torch.Tensor) -> None:
    """Read one tensor from the open file into `out`, converting dtype/device as needed.

    Reads straight into `out` when it is a contiguous CPU tensor of the same dtype; otherwise through a
    staging buffer of whole rows (STAGING_BYTES at most). Never maps the file, so peak memory is the model
    plus that buffer.
    """
    f.seek(entry.offset)
    direct = out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous()
    if direct:
        _read_exact(entry, f, out)
        return
    num_rows = entry.shape[0] if entry.shape else 1
    row_bytes = entry.num_bytes // max(num_rows, 1)
    step = max(1, STAGING_BYTES // max(row_bytes, 1))
    staging = torch.empty((min(step, num_rows), *entry.shape[1:]), dtype=entry.dtype)
    dest = out if entry.shape else out.view(1)  # a 0-d tensor: one row
    for start in range(0, num_rows, step):
        chunk = staging[:min(step, num_rows - start)]
        _read_exact(entry, f, chunk)
        dest[start:start + chunk.shape[0]].copy_(chunk)


def _read_exact(entry: TensorEntry, f, out: torch.Tensor) -> None:
    if out.numel() and f.readinto(_writable_bytes(out)) != out.numel() * out.element_size():
        raise CheckpointError(f"{entry.file}: tensor {entry.name!r} is cut short; the file may be truncated")


def can_map(entry: TensorEntry) -> bool:
    """Whether map_tensor can serve this tensor: its bytes aligned for its dtype in the file."""
    return entry.offset % entry.dtype.itemsize == 0


def map_tensor(entry: TensorEntry) -> tuple[torch.Tensor, mmap.mmap]:
    """The tensor as a view of its file mapped private and read-only in use: a page is read from the page cache
    when first touched and counts in this process's RSS only while resident, clean, so the kernel may drop it
    under pressure. Returns the mapping too, for madvise. The file must not be rewritten in place meanwhile
    (a truncated mapping faults with SIGBUS); replacing it by a rename is safe."""
    with open(entry.file, "rb") as f:
        # ACCESS_COPY (MAP_PRIVATE): torch wants a writable buffer; nothing writes it, so no page is copied
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    numel = entry.num_bytes // entry.dtype.itemsize
    tensor = torch.frombuffer(mapped, dtype=entry.dtype, count=numel, offset=entry.offset).view(entry.shape)
    return tensor, mapped


# A target for one checkpoint tensor: the parameter and the row range of it the tensor fills
# (several checkpoint tensors fill one fused parameter, e.g. q/k/v -> qkv_proj), or a callable that reads the
# entry from the open file itself (fill(entry, f)): a stacked expert tensor that is transposed, split or
# dequantized on its way in (models/moe.py).
Target = tuple[torch.Tensor, int, int] | Callable[["TensorEntry", object], None]

# Checkpoint tensors that carry no weights we need (precomputed rotary tables of old exports).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def embedding_name(cfg: ModelConfig) -> str:
    return f"{cfg.hybrid.tensor_prefix}embed_tokens.weight" if cfg.hybrid is not None else "model.embed_tokens.weight"


def mapped_embedding(model_dir: str | pathlib.Path, cfg: ModelConfig, device: torch.device, packed: bool
                     ) -> TensorEntry | None:
    """The embedding's checkpoint entry when the model serves it from the file (DecoderModel.map_embedding): on
    a CPU, when no matmul reads it (the head untied, or packed) and the file allows it; else None."""
    if device.type != "cpu" or (cfg.tie_word_embeddings and not packed):
        return None
    for file in safetensors_files(model_dir):
        for entry in read_safetensors_header(file):
            if entry.name == embedding_name(cfg):
                usable = can_map(entry) and entry.shape == (cfg.vocab_size, cfg.hidden_size)
                return entry if usable and entry.dtype.is_floating_point else None
    return None


# What a set-aside prefix holds, for load_weights' log line: a user reading "set aside" should not think the
# vision tower of a checkpoint serving images was dropped.
_MTP_HEAD = "the MTP head, read by --speculative-config method mtp"
SET_ASIDE_PARTS = {"model.visual.": "the vision tower, loaded apart when images are served",
                   "mtp.": _MTP_HEAD, "model.mtp.": _MTP_HEAD}


def load_weights(model_dir: str | pathlib.Path, targets: dict[str, Target], mapped: frozenset[str] = frozenset(),
                 on_filled: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                 set_aside: tuple[str, ...] = (), log_set_aside: bool = True) -> None:
    """Copy every checkpoint tensor into its target slice, converting dtype, one tensor at a time.

    `targets` maps checkpoint names to (parameter, row_start, row_end). Every target must be filled.
    `mapped`: names the model serves from the file itself (map_tensor), skipped here.
    A parameter left on the meta device is never allocated: its slices go into a float32 matrix that lives
    until its last slice arrives, then on_filled(parameter, matrix) takes it (--quantization).
    `set_aside`: name prefixes of tensors the checkpoint may carry for parts not served (Qwen3.5's vision tower
    and MTP head, HybridConfig.set_aside_prefixes): skipped unread, never an error, and counted in the log by the
    part they belong to (SET_ASIDE_PARTS) unless `log_set_aside` is False (a part's own load: the vision tower
    and the MTP head set aside everything else).
    """
    missing = set(targets)
    set_aside_counts: dict[str, int] = {}  # prefix -> tensors skipped under it
    pending: dict[int, tuple[torch.Tensor, int]] = {}  # id(meta parameter) -> (dense matrix, rows still to come)
    files = safetensors_files(model_dir)
    progress = Progress(f"loading weights from {len(files)} file(s)", sum(f.stat().st_size for f in files), log)
    for file in files:
        entries = read_safetensors_header(file)
        with open(file, "rb", buffering=0) as f, torch.no_grad():
            for entry in entries:
                name = entry.name
                if name not in targets and "model." + name in targets:
                    # a checkpoint saved from the bare model (Qwen3-Embedding: embed_tokens.weight, layers.N...)
                    name = "model." + name
                target = targets.get(name)
                if target is None:
                    if set_aside and entry.name.startswith(set_aside):
                        prefix = next(p for p in set_aside if entry.name.startswith(p))
                        set_aside_counts[prefix] = set_aside_counts.get(prefix, 0) + 1
                        progress.update(entry.num_bytes)
                        continue
                    if not entry.name.endswith(_IGNORED_SUFFIXES) and entry.name != "lm_head.weight" \
                            and entry.name not in mapped:
                        raise CheckpointError(f"{file}: unexpected tensor {entry.name!r}")
                    continue
                if callable(target):  # checks the entry's shape itself
                    target(entry, f)
                    missing.discard(name)
                    progress.update(entry.num_bytes)
                    continue
                param, start, end = target
                expected = (end - start, *param.shape[1:])
                if entry.shape != tuple(expected):
                    raise CheckpointError(f"{file}: tensor {entry.name!r} has shape {entry.shape}, expected "
                                          f"{tuple(expected)}")
                if param.is_meta:
                    dense, rows_left = pending.get(id(param)) or (torch.empty(param.shape, dtype=torch.float32),
                                                                  param.shape[0])
                    read_tensor_into(entry, f, dense[start:end])
                    if rows_left - (end - start):
                        pending[id(param)] = (dense, rows_left - (end - start))
                    else:
                        pending.pop(id(param), None)
                        on_filled(param, dense)
                        del dense
                        # glibc keeps freed blocks this size resident once its mmap threshold has grown past
                        # them: without this a quantized load's RSS ends near the dense model's
                        release_free_heap()
                else:
                    read_tensor_into(entry, f, param[start:end])
                missing.discard(name)
                progress.update(entry.num_bytes)
    progress.close()
    if set_aside_counts and log_set_aside:
        log.info("checkpoint tensors left to other parts: %s", ", ".join(
            f"{count} {prefix}* ({SET_ASIDE_PARTS.get(prefix, 'not served by this model')})"
            for prefix, count in set_aside_counts.items()))
    if missing:
        names = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: missing tensors {names} ({len(missing)} in all)")
