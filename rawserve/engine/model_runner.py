"""ModelRunner: load the model, own the paged KV cache, and turn one step's batch into logits.

Core side only: it knows token ids, positions and block tables, never text or requests' sampling.
"""
from __future__ import annotations

import logging
import pathlib
import sys

import torch

from rawserve.config import CPU_MEMORY_SHARE, EngineConfig
from rawserve.engine import memory
from rawserve.engine.attention.kv_dtype import name_of, resolve_kv_dtype
from rawserve.engine.attention.metadata import AttentionMetadata, decode_splits
from rawserve.engine.attention.torch_backend import read_dtype
from rawserve.engine.cuda_graphs import DecodeGraphs
from rawserve.engine.dtype_probe import DtypeChoice, probe_cpu_dtype
from rawserve.engine.loader import ModelConfig, embedding_name, mapped_embedding, read_model_config, \
    read_safetensors_header, safetensors_files
from rawserve.engine.lora import LoraWeights
from rawserve.engine.models.decoder import DecoderModel
from rawserve.engine.models.gated_delta import StateBatch
from rawserve.engine.models.moe import expert_weight_bytes
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.models.qwen3_moe import load_moe_model
from rawserve.engine.models.qwen3_vl import Qwen3VLTextModel
from rawserve.engine.models.qwen35 import LayerState, load_qwen35_model
from rawserve.engine.multimodal.budget import VISION_PREFIX, step_bytes_with_images, vision_weight_bytes
from rawserve.engine.multimodal.manager import MultiModalManager
from rawserve.engine.quant import QuantPlan, probe_plan, quantized_bytes
from rawserve.engine.step_plan import ForwardBatch, StepInput
from rawserve.engine.vocab_ops import ROW_CHUNK
from rawserve.process_stats import keep_freed_heap, release_free_heap, release_pages

log = logging.getLogger("rawserve.engine")

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What an idle CPU engine keeps of its prefix cache (release_idle_kv): the most recently used blocks, up to this share
# of the pool, this share of the process's resident memory once the pool exists, and this many bytes; the rest is
# evicted and its pages go back to the kernel. A trade: more keeps longer multi-turn histories warm, but an idle
# process should come back near where it started (issue 33's bar: within 1.2x).
IDLE_PREFIX_CACHE_SHARE = 1 / 16
IDLE_PREFIX_CACHE_RSS_SHARE = 0.1
IDLE_PREFIX_CACHE_MAX_BYTES = 128 << 20


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda was asked for but torch sees no CUDA device")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, cfg: ModelConfig, device: torch.device) -> DtypeChoice:
    """--dtype: as given; auto is the checkpoint's dtype on a GPU and, on a CPU, what a start-up probe of the
    model's matmul shape measures fastest (dtype_probe.probe_cpu_dtype)."""
    if config.dtype != "auto":
        return DtypeChoice(_DTYPE_NAMES[config.dtype], "--dtype")
    if device.type != "cpu":
        return DtypeChoice(cfg.dtype, f"--dtype auto: the checkpoint's dtype on {device.type}")
    choice = probe_cpu_dtype(cfg.dtype, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers)
    return DtypeChoice(choice.dtype, f"--dtype auto: {choice.reason}", choice.timings)


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype, device: torch.device,
               cfg: ModelConfig | None = None, *, prepack: bool = True, attention_backend: str = "torch",
               quant: QuantPlan | None = None) -> DecoderModel:
    """Build the model without initialising it, then stream the checkpoint's tensors into it.

    prepack: on CPU, hold the matmul weights in oneDNN's packed layout (see DecoderLayer.prepack).
    quant: quantize the linear weights as they load (DecoderModel.defer_quantized); the rest stays at dtype.
    """
    cfg = cfg or read_model_config(model_dir)
    if cfg.moe is not None:  # Qwen3-MoE, Qwen3.5-MoE, gpt-oss: routed experts (models/moe.py)
        return load_moe_model(model_dir, dtype, device, cfg, prepack=prepack, attention_backend=attention_backend,
                              quant=quant)
    if cfg.hybrid is not None:  # Qwen3.5: its own layer kinds, set-aside tensors and final norm
        return load_qwen35_model(model_dir, dtype, device, cfg, prepack=prepack, attention_backend=attention_backend,
                                 quant=quant)
    with torch.device("meta"):  # Qwen3-VL's text model: Qwen3's with M-RoPE and DeepStack
        model = (Qwen3VLTextModel if cfg.mrope_section else DecoderModel)(cfg, dtype, attention_backend)
    on_filled = model.defer_quantized(quant) if quant is not None else None
    model.materialize(device)
    prepack = prepack and device.type == "cpu" and cpu_prepack_supported(dtype)
    model.load_checkpoint(model_dir, device, prepack=prepack, quant=quant, on_filled=on_filled)
    return model.eval()


def weight_bytes(model_dir: str | pathlib.Path, dtype: torch.dtype, cfg: ModelConfig, device: torch.device,
                 quant: QuantPlan | None = None) -> int:
    """Bytes the loaded weights take at `dtype`, from the safetensors headers (nothing read but them): a CPU's
    pre-packed tied LM head counts once, an embedding served from the file (mapped_embedding) not at all (its
    pages are the page cache's, resident only as far as lookups touch them), and what `quant` quantizes at its
    quantized size (DecoderModel.defer_quantized)."""
    size = torch.finfo(dtype).bits // 8
    packed = device.type == "cpu" and cpu_prepack_supported(dtype)
    head_apart = packed or quant is not None  # the head is read from its own packed or quantized copy
    mapped = mapped_embedding(model_dir, cfg, device, head_apart)
    prefix = cfg.hybrid.tensor_prefix if cfg.hybrid is not None else "model."
    set_aside = cfg.hybrid.set_aside_prefixes if cfg.hybrid is not None else ()
    if cfg.vision is not None:  # the tower loads apart (multimodal/), at `dtype` whole
        set_aside = (*set_aside, VISION_PREFIX)
    total = vision_weight_bytes(model_dir, dtype) if cfg.vision is not None else 0
    for file in safetensors_files(model_dir):
        for entry in read_safetensors_header(file):
            if mapped is not None and entry.name == mapped.name and entry.file == mapped.file:
                continue
            if set_aside and entry.name.startswith(set_aside):
                continue  # a vision tower or MTP head the loader leaves unread
            if ".mlp.experts." in entry.name:
                continue  # counted below in the form they load to (moe.expert_weight_bytes)
            if quant is not None and (entry.name == "lm_head.weight" or _is_linear(entry.name, prefix)):
                continue  # counted below, fused and quantized
            if entry.dtype.is_floating_point:
                # DecoderModel.narrow_embedding: an embedding no matmul reads stays at the checkpoint's dtype
                narrow = entry.name == embedding_name(cfg) and (head_apart or not cfg.tie_word_embeddings)
                total += entry.num_bytes // entry.dtype.itemsize * (min(size, entry.dtype.itemsize) if narrow else size)
    if quant is not None:
        for n, k in _linear_shapes(cfg):
            total += quantized_bytes(quant, n, k) or n * k * size
        total += quantized_bytes(quant, cfg.vocab_size, cfg.hidden_size, head=True)
    elif cfg.tie_word_embeddings and packed:
        total += cfg.vocab_size * cfg.hidden_size * size
    if cfg.moe is not None:
        total += expert_weight_bytes(cfg, size, quant)
    return total


def _is_linear(name: str, prefix: str = "model.") -> bool:
    """A checkpoint tensor that fills one of a layer's fused matmul weights (LINEARS; Qwen3.5's linear_names)."""
    return name.startswith(f"{prefix}layers.") and name.endswith((
        ".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight", ".gate_proj.weight",
        ".up_proj.weight", ".down_proj.weight", ".in_proj_qkv.weight", ".in_proj_z.weight", ".in_proj_b.weight",
        ".in_proj_a.weight", ".out_proj.weight")) and ".mlp.experts." not in name and ".shared_expert." not in name


def _linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every fused matmul weight of every layer, as the layers hold them."""
    q, kv, inter, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, \
        cfg.hidden_size
    mlp = [(2 * inter, hidden), (hidden, inter)]
    sparse = cfg.moe.sparse_layers if cfg.moe is not None else (False,) * cfg.num_layers  # no dense MLP there
    if cfg.hybrid is None:
        return [shape for is_sparse in sparse for shape in [(q + 2 * kv, hidden), (hidden, q), *([] if is_sparse
                                                                                                  else mlp)]]
    hy = cfg.hybrid
    shapes = []
    for kind, is_sparse in zip(hy.layer_types, sparse):
        if kind == "linear_attention":  # in_proj (qkv, z, b, a), out_proj
            shapes += [(hy.conv_dim + hy.value_dim + 2 * hy.linear_num_value_heads, hidden), (hidden, hy.value_dim)]
        else:  # q_proj carries the output gate too
            shapes += [(2 * q + 2 * kv, hidden), (hidden, q)]
        if not is_sparse:
            shapes += mlp
    return shapes


def sampler_worst_case(logits: torch.Tensor) -> None:
    """The sampler's working memory over `logits` [rows, vocab] as the profile step models it: every row's logprobs
    (a raw copy and a log-softmax of each) held through a sort of 2 x ROW_CHUNK rows (values and int64 ids, beside
    their softmax). A model, not the Sampler: bench.step_memory sets it beside the real Sampler's request mixes (at
    32 x 152k rows: the model 98 MiB; penalties with logprobs 84-88, top-p with min-p and logprobs 69-98)."""
    raw, logprobs = logits.clone(), logits.log_softmax(-1)
    # The sorted path's other temporaries (its chunk's copy, tempered logits, softmax, running sums) are about as
    # large again as its sort's values and ids: modelled as a sort of twice ROW_CHUNK rows.
    torch.sort(logits[:2 * ROW_CHUNK].softmax(-1), dim=-1, descending=True)
    del raw, logprobs


def check_attention_backend(config: EngineConfig, cfg: ModelConfig, device: torch.device) -> None:
    """Refuse a triton backend that cannot run here, before any weight is read."""
    if config.attention_backend != "triton":
        return
    from rawserve.engine.attention import triton_kernels

    triton_kernels.check_shapes(cfg.head_dim, config.block_size)
    if device.type != "cuda":
        if not triton_kernels.interpreted():
            raise ValueError("--attention-backend: triton on a CPU runs only under TRITON_INTERPRET=1 (triton's "
                             "interpreter, for tests); use torch on a CPU")
        log.warning("attention: triton kernels on %s through triton's interpreter (correct, very slow)", device)


def resolve_cuda_graphs(config: EngineConfig, device: torch.device) -> bool:
    """--cuda-graphs: auto is on with a CUDA device and the triton backend; on elsewhere is an error."""
    if config.cuda_graphs == "off":
        return False
    usable = device.type == "cuda" and config.attention_backend == "triton"
    if config.cuda_graphs == "on" and not usable:
        raise ValueError(f"--cuda-graphs: on needs a CUDA device and --attention-backend triton "
                         f"(device {device.type}, backend {config.attention_backend})")
    return usable


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.model_dir is None:
            raise ValueError("--model-dir: the model runner needs a checkpoint directory")
        self.config = config
        self.model_config = cfg = read_model_config(config.model_dir)
        self.device = resolve_device(config)
        choice = resolve_dtype(config, cfg, self.device)
        self.dtype = choice.dtype
        log.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), choice.reason)
        # --kv-cache-dtype: what the pool stores; attention computes in self.dtype (the backends cast)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"--max-model-len: {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.block_size = config.block_size
        use_graphs = resolve_cuda_graphs(config, self.device)
        # Qwen3.5 (hybrid): a KV pair per full-attention layer only, and per-sequence states (self.states)
        self.is_hybrid = cfg.hybrid is not None
        if (self.is_hybrid or cfg.moe is not None) and use_graphs:
            if config.cuda_graphs == "on":
                raise ValueError("--cuda-graphs: on is not supported for Qwen3.5 (hybrid) and mixture-of-experts "
                                 "models; use auto or off")
            # a decode graph holds no state slots, and a MoE layer picks its experts on the host: both run eagerly
            use_graphs = False
        self.states: list[LayerState] = []  # per linear layer: (conv, recurrent, its scale) by slot
        self.graphs: DecodeGraphs | None = None  # captured last, once the KV pool exists; the profile step runs eager
        check_attention_backend(config, cfg, self.device)
        self.quant = (probe_plan(config.quantization, config.quantization_group_size, self.device)
                      if config.quantization != "none" else None)
        torch.manual_seed(config.seed)
        # Without --num-kv-blocks (and off a GPU), the pool is sized from what this process may still use,
        # so read it first: a limit the weights and one step do not fit is refused here, not OOM-killed later.
        sizes_by_memory = config.num_kv_blocks is None and self.device.type == "cpu"
        if sizes_by_memory:
            self._check_weights_fit(memory.headroom())
        self.model = load_model(config.model_dir, self.dtype, self.device, cfg,
                                attention_backend=config.attention_backend, quant=self.quant)
        if self.quant is not None:
            log.info("quantization: %s; %d matrices quantized, %s of weights", self.quant.describe(),
                     self.model.num_quantized,
                     memory.mib(weight_bytes(config.model_dir, self.dtype, cfg, self.device, self.quant)))
        self.model.init_rope(self.max_model_len, self.device)
        # A vision-language checkpoint's tower and encoder cache (engine/multimodal); None for text-only models
        self.multimodal = (MultiModalManager.load(config.model_dir, cfg, self.dtype, self.device,
                                                  cache_bytes=config.encoder_cache_mb << 20,
                                                  pixel_bounds=config.mm_pixel_bounds())
                           if cfg.vision is not None else None)
        self.lora: LoraWeights | None = None
        if config.lora_enabled:
            self.lora = LoraWeights(cfg, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            self.model.enable_lora(self.lora)
        self._num_zeroed = 0  # leading blocks of the pool written with zeros (see _zero_blocks)
        self._logits: torch.Tensor | None = None  # see _logits_out
        # Speculative MTP (spec/mtp.py): the last eager forward's final hidden states [T, hidden], kept for it
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None  # see _gather_out
        self._read: tuple[torch.Tensor, torch.Tensor] | None = None  # see _read_out
        if self.device.type == "cpu":  # from here on a step's large tensors reuse freed heap, not fresh pages
            keep_freed_heap()
        margin = self._profile_step() if sizes_by_memory and config.kv_cache_memory_gb == "auto" else 0
        self.kv_plan = self._plan(memory.headroom() if sizes_by_memory else None, margin)
        self.num_blocks = self.kv_plan.num_blocks
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Left empty: blocks are zeroed as the scheduler first hands them out (_zero_blocks), so a pool sized
        # for the worst case costs memory only as far as it is used.
        self.kv_caches = [(torch.empty(shape, dtype=self.kv_dtype, device=self.device),
                           torch.empty(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(self.num_kv_layers)]
        if self.is_hybrid:  # running slots, then the prefix cache's saved states (StateCacheManager's numbering)
            self.states = self._allocate_states(self.kv_plan.num_state_slots + self.kv_plan.num_saved_states)
        self._num_zeroed = 0
        self._rss_at_start = memory.rss_bytes()  # what idle_cached_blocks measures against
        log.info("model %s: %s on %s, KV cache %d tokens (%d blocks of %d, %s, %s): %s; %s attention",
                 config.model_dir, self.dtype, self.device, self.num_blocks * self.block_size, self.num_blocks,
                 self.block_size, memory.mib(self.kv_plan.kv_bytes), self.kv_dtype_name, self.kv_plan.reason,
                 config.attention_backend)
        if use_graphs:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, self.max_model_len,
                                       self.block_size, self.device)

    @property
    def kv_dtype_name(self) -> str:
        """The pool's storage dtype by --kv-cache-dtype's names (float32 for an auto cache of a float32 model)."""
        return name_of(self.kv_dtype)

    @property
    def pooled_size(self) -> int:
        """Values in a pooled vector: the final hidden state's."""
        return self.model_config.hidden_size

    @property
    def num_kv_layers(self) -> int:
        """Layers with a (K, V) pair in the paged cache: all of them, or a hybrid's full-attention layers."""
        return self.model.num_kv_layers if self.is_hybrid else self.model_config.num_layers

    def _allocate_states(self, num_slots: int) -> list[LayerState]:
        """A hybrid's state pool: per linear layer (conv [S, K-1, conv_dim] at the model's dtype, recurrent
        [S, Hv, dk, dv] float32, its scale [S, Hv, 1, 1]). Conv and recurrent left empty, as the KV pool is: a
        fresh sequence's slot is zeroed by the forward (StateBatch.fresh) and a restored one copied whole, so pages
        are touched only as slots are used. The scales start at 1 (a few bytes a slot): a fold or a decode step
        may read a free slot's."""
        conv, rec, scale = self.model.state_shapes(num_slots)
        return [(torch.empty(conv, dtype=self.dtype, device=self.device),
                 torch.empty(rec, dtype=torch.float32, device=self.device),
                 torch.ones(scale, dtype=torch.float32, device=self.device))
                for _ in range(self.model.num_state_layers)]

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole state slots, (from, to) in order (StateCacheManager.take_copies: prefix-cache restores
        before a forward, saves after it; speculative decoding's hold and rollback), every linear layer's conv and
        recurrent rows and the recurrent state's scale (a copy stands for the same true state)."""
        for src, dst in copies:
            for conv, recurrent, scale in self.states:
                conv[dst].copy_(conv[src])
                recurrent[dst].copy_(recurrent[src])
                scale[dst].copy_(scale[src])

    @property
    def block_bytes(self) -> int:
        cfg = self.model_config
        return memory.kv_block_bytes(num_layers=self.num_kv_layers, block_size=self.block_size,
                                     num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                     element_bytes=self.kv_dtype.itemsize)

    def _check_weights_fit(self, room: memory.Headroom) -> None:
        """Refuse (ValueError, with the numbers) a process that cannot hold the weights and one step: checked
        before loading, since a limit met while loading or profiling is an OOM kill, not a message."""
        need = weight_bytes(self.config.model_dir, self.dtype, self.model_config, self.device, self.quant)
        step = self._step_bytes_estimate()
        if need + step > room.available_bytes:
            raise ValueError(f"not enough memory for the weights: they need {memory.mib(need)} as "
                             f"{str(self.dtype).removeprefix('torch.')} and a step about {memory.mib(step)} more, "
                             f"and {memory.mib(room.available_bytes)} is left under the {room.source}")

    def _step_bytes_estimate(self) -> int:
        """A worst-case step's working memory from the shapes (what _profile_step then measures): float32 logits
        of --max-num-seqs rows, the sampler's worst case over them (every row asking for logprobs: a raw copy and
        a log-softmax of each; a sort of 2 x ROW_CHUNK rows, values and int64 ids, beside their softmax), and the
        activations of --max-num-batched-tokens tokens."""
        cfg = self.model_config
        num_tokens = self.config.max_num_batched_tokens
        rows = min(self.config.max_num_seqs, num_tokens)
        width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        return self._with_images(4 * (3 * rows * cfg.vocab_size + 8 * ROW_CHUNK * cfg.vocab_size + num_tokens * width))

    def _with_images(self, text_step: int) -> int:
        """A step's bytes with a vision tower's share (multimodal/budget.py): its worst image, never profiled (a
        forward over it takes minutes on a CPU), the encoder cache and image rows."""
        cfg = self.model_config
        if cfg.vision is None:
            return text_step
        return step_bytes_with_images(self.config.model_dir, cfg.vision, self.dtype, text_step,
                                      self.config.max_num_batched_tokens, self.config.encoder_cache_mb << 20,
                                      self.config.mm_pixel_bounds())

    def _profile_step(self) -> int:
        """Bytes one worst-case step needs beyond what is resident: a forward over --max-num-batched-tokens
        tokens with --max-num-seqs logit rows, and the sampler's worst case over them (see _step_bytes_estimate),
        measured as the rise of this process's peak RSS. Runs against a one-block KV pool every slot maps to (the
        values are garbage)."""
        cfg, bs = self.model_config, self.block_size
        num_tokens = self.config.max_num_batched_tokens
        seqs, left = [], num_tokens
        while left > 0:
            n = min(left, self.max_model_len)
            seqs.append(StepInput(token_ids=[0] * n, num_computed_tokens=0, block_table=[0] * -(-n // bs),
                                  state_slot=len(seqs) if self.is_hybrid else -1))
            left -= n
        rows = min(self.config.max_num_seqs, num_tokens)
        batch = ForwardBatch(seqs, [num_tokens - 1 - i * (num_tokens // rows) for i in range(rows)][::-1])
        one = (1, bs, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.empty(one, dtype=self.kv_dtype), torch.empty(one, dtype=self.kv_dtype))
                          for _ in range(self.num_kv_layers)]
        if self.is_hybrid:
            self.states = self._allocate_states(len(seqs))
        memory.reset_peak_rss()
        before = memory.rss_bytes()
        logits = self.execute(batch)
        sampler_worst_case(logits)
        margin = self._with_images(max(0, memory.rss_bytes("VmHWM") - before))
        del logits
        self.kv_caches = []
        self.states = []
        self.release_buffers()  # an idle engine holds no logits buffer
        release_free_heap()  # what the step freed, before the cgroup's usage is read for the cap
        return margin

    def _plan(self, room: memory.Headroom | None, margin: int) -> memory.KVPlan:
        config = self.config
        device_budget = None
        if self.device.type == "cuda" and config.num_kv_blocks is None and (
                config.gpu_memory_utilization is not None or config.kv_cache_memory_gb == "auto"):
            utilization = config.gpu_memory_utilization or 0.9
            free_bytes, _ = torch.cuda.mem_get_info(self.device)  # the weights are loaded: this is what is left
            free_bytes -= self._with_images(0)  # the tower's worst forward and the encoder cache stay outside the pool
            device_budget = (int(utilization * free_bytes), f"--gpu-memory-utilization {utilization:g} of "
                                                             f"{memory.mib(free_bytes)} free on {self.device}")
        return memory.plan_kv_cache(
            block_bytes=self.block_bytes + self._spec_block_bytes(), block_size=self.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, num_kv_blocks=config.num_kv_blocks,
            memory_gb=config.kv_cache_memory_gb, room=room, margin_bytes=margin, share=CPU_MEMORY_SHARE,
            device_budget=device_budget, state_bytes=self.model.state_bytes_per_slot() if self.is_hybrid else 0,
            save_states=config.enable_prefix_caching)

    def _spec_block_bytes(self) -> int:
        """A speculative proposer's KV bytes per block: its pool (spec/draft_model.py, spec/mtp.py) has a block for
        each of this pool's, addressed by the same ids, so the budget buys blocks of both: a draft model's layers,
        or the MTP layer's one."""
        spec = self.config.speculative()
        if spec is None or spec.method not in ("draft_model", "mtp"):
            return 0
        cfg = self.model_config if spec.method == "mtp" else read_model_config(spec.model)
        return memory.kv_block_bytes(num_layers=1 if spec.method == "mtp" else cfg.num_layers,
                                     block_size=self.block_size, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim, element_bytes=self.kv_dtype.itemsize)

    def _zero_blocks(self, top: int) -> None:
        """Zero blocks [_num_zeroed, top) before a step reads them. Never-written slots are read (and masked
        by a 0 probability), and 0 * NaN is NaN, so they must hold zeros, not whatever the allocator left.
        Zeroing on first use rather than at start keeps an unused pool unmapped; the KV manager hands out
        fresh blocks lowest first, so the zeroed prefix grows with peak use, and shrinks again when an idle engine
        gives the pages above what it keeps back (release_idle_kv)."""
        if top <= self._num_zeroed:
            return
        for k_cache, v_cache in self.kv_caches:
            k_cache[self._num_zeroed:top].zero_()
            v_cache[self._num_zeroed:top].zero_()
        self._num_zeroed = top

    @property
    def releases_idle_kv(self) -> bool:
        """Whether an idle engine gives KV pages back (release_idle_kv): on a CPU under Linux (process_stats.
        release_pages; elsewhere evicting the prefix cache would gain nothing). A GPU's pool is reserved whole at
        start, as vLLM's is, and stays."""
        return self.device.type == "cpu" and bool(self.kv_caches) and sys.platform.startswith("linux")

    @property
    def idle_cached_blocks(self) -> int:
        """How many prefix-cache blocks an idle engine keeps (IDLE_PREFIX_CACHE_SHARE, _RSS_SHARE, _MAX_BYTES)."""
        most_bytes = min(IDLE_PREFIX_CACHE_MAX_BYTES, int(IDLE_PREFIX_CACHE_RSS_SHARE * self._rss_at_start))
        return min(int(self.num_blocks * IDLE_PREFIX_CACHE_SHARE), most_bytes // self.block_bytes)

    def release_idle_kv(self, moves: list[tuple[int, int]], top: int) -> int:
        """Copy each (from, to) block of `moves` (KVCacheManager.compact's renumbering of the kept prefix cache),
        then give back the pages of blocks [top, the zeroed prefix's end): no block there is held or cached.
        Returns the bytes given back. Only while no step runs.

        Those blocks are zeroed again when next handed out (_zero_blocks' mark comes down to `top`): dropped pages
        read back as zeros, but the partial pages at each end of the range keep their old contents."""
        if moves:
            src = torch.tensor([m[0] for m in moves], dtype=torch.int64, device=self.device)
            dst = torch.tensor([m[1] for m in moves], dtype=torch.int64, device=self.device)
            assert int(dst.max()) < self._num_zeroed, "a prefix-cache block moves past the zeroed prefix"
            for k_cache, v_cache in self.kv_caches:  # [num_blocks, block_size, kv_heads, head_dim]
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
        zeroed, self._num_zeroed = self._num_zeroed, min(self._num_zeroed, top)
        if top >= zeroed:
            return 0
        released = 0
        for pair in self.kv_caches:
            for cache in pair:
                row_bytes = cache.stride(0) * cache.element_size()
                released += release_pages(cache.data_ptr() + top * row_bytes, (zeroed - top) * row_bytes)
        return released

    def _metadata(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                      torch.Tensor]:
        inputs = batch.seqs
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        decode_seq: list[int] = []
        decode_tok: list[int] = []
        prefill_seq: list[int] = []
        max_blocks = 1
        max_decode_len = 0
        for i, inp in enumerate(inputs):
            n, start = len(inp.token_ids), inp.num_computed_tokens
            table = inp.block_table
            ids.extend(inp.token_ids)
            if n == 1:  # decode: the common case, without a generator per sequence
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            offset = starts[-1]
            starts.append(offset + n)
            seq_len = start + n
            seq_lens.append(seq_len)
            max_blocks = max(max_blocks, len(table))
            if n == 1:
                decode_seq.append(i)
                decode_tok.append(offset)
                max_decode_len = max(max_decode_len, seq_len)
            else:
                prefill_seq.append(i)
        # One tensor build from padded lists: a tensor per row costs microseconds each at 256 rows.
        tables = torch.tensor([inp.block_table + [0] * (max_blocks - len(inp.block_table)) for inp in inputs],
                              dtype=torch.int64)
        self._zero_blocks(int(tables.max()) + 1)
        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=seq_lens_t.to(dev),
            block_tables=tables.to(dev),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            decode_token_ids=torch.tensor(decode_tok, dtype=torch.int64, device=dev),
            max_decode_len=max_decode_len, prefill_seq_ids=prefill_seq, block_size=bs)
        if self.config.attention_backend == "triton":
            meta.decode_seq_ids = torch.tensor(decode_seq, dtype=torch.int64, device=dev)
            meta.prefill_seqs = torch.tensor(prefill_seq, dtype=torch.int64, device=dev)
            meta.max_prefill_len = max((starts[i + 1] - starts[i] for i in prefill_seq), default=0)
            meta.decode_num_splits = decode_splits(len(decode_seq), self.model_config.num_kv_heads, max_decode_len)
        else:
            decode_ids = torch.tensor(decode_seq, dtype=torch.int64)
            decode_blocks = tables[decode_ids, :-(-max_decode_len // bs)].flatten()
            meta.decode_blocks = decode_blocks.to(dev)
            if len(decode_seq) == 1:  # one sequence sees its whole context: no mask
                used = inputs[decode_seq[0]].block_table[:decode_blocks.numel()]
                if used == list(range(used[0], used[0] + len(used))):  # consecutive blocks: a view, not a gather
                    meta.decode_block_run = used[0]
            else:
                meta.decode_mask = (torch.arange(max_decode_len).unsqueeze(0)
                                    < seq_lens_t[decode_ids].unsqueeze(1))[:, None, None].to(dev)
            if dev.type == "cpu":  # the largest gather of the step: the decodes' blocks (unless read in place),
                # or one prefill's
                decodes = 0 if meta.decode_block_run is not None else decode_blocks.numel()
                most = max([decodes] + [-(-seq_lens[i] // bs) for i in prefill_seq])
                meta.gather_out = self._gather_out(most) if most else None
                meta.read_out = self._read_out(max(most, decode_blocks.numel())) if most or len(decode_seq) else None
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                torch.tensor(batch.logit_indices, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over the flattened batch -> float32 logits [len(batch.logit_indices), vocab_size].

        Row r is flattened token batch.logit_indices[r]'s, predicting the token after it; which rows a step
        needs is the StepPlan's to say.
        """
        graphed = self._run_graph(batch)
        if graphed is not None:
            return graphed
        hidden, rows = self._hidden(batch)
        if self.keep_hidden:
            self.last_hidden = hidden
        return self._rows_logits(hidden, rows)

    def step_metadata(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                          torch.Tensor]:
        """(input ids, positions, attention metadata, logit rows) of `batch` on this runner's block layout: what
        a speculative head with a pool like the target's (spec/mtp.py) runs its own forward on."""
        return self._metadata(batch)

    @torch.inference_mode()
    def execute_pooling(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """execute() for a step with pooling spans -> (its logits, as execute's; float32 sums of the final hidden
        states over each of batch.pool_spans [len(pool_spans), hidden]). Always eager: a decode graph keeps no
        hidden states, and a one-token prompt would otherwise look like a decode to it."""
        hidden, rows = self._hidden(batch)
        pooled = torch.stack([hidden[start:end].float().sum(0) for start, end in batch.pool_spans])
        return self._rows_logits(hidden, rows), pooled

    def logits_of(self, hidden: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """The LM head's float32 logits of `token_ids` for final hidden states [N, hidden] -> [N, len(token_ids)]
        (a pooled row scored by a few tokens: Qwen3-Reranker's yes/no)."""
        logits = self.model.compute_logits(hidden.to(self.dtype))
        return logits[:, torch.tensor(token_ids, dtype=torch.int64, device=logits.device)]

    def _hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager forward -> (final hidden states [T, hidden], the logit rows' indices [R])."""
        input_ids, positions, meta, rows = self._metadata(batch)
        images = self.multimodal.step(batch.seqs) if self.multimodal is not None else None
        extra = {}
        if images is not None:  # M-RoPE positions for the whole batch, and the image rows' embeddings
            positions = images.positions
            if images.embeds is not None:  # some placeholders in this step (not only decodes after them)
                extra["embeds"] = (images.rows, images.embeds)
                if self.multimodal.has_deepstack:
                    extra["deepstack"] = images.deepstack
        lora = None
        if self.lora is not None and any(inp.lora_slot >= 0 for inp in batch.seqs):  # a base-only step: no work
            token_slots = [s for inp in batch.seqs for s in [inp.lora_slot] * len(inp.token_ids)]
            lora = self.lora.batch(token_slots)
        if self.is_hybrid:  # reads and writes the step's state slots in place
            return self.model(input_ids, positions, self.kv_caches, meta, lora, states=self.states,
                              state_batch=StateBatch.from_inputs(batch.seqs), **extra), rows
        return self.model(input_ids, positions, self.kv_caches, meta, lora, **extra), rows  # [T, hidden]

    def _rows_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if rows.numel() == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[rows], self._logits_out(rows.numel()))  # [num_rows, vocab]

    def _logits_out(self, num_rows: int) -> torch.Tensor | None:
        """Where a CPU bf16/fp16 model's float32 logits go: one buffer reused step after step (the caller uses
        a step's logits before it runs the next), grown to the most rows a step has had, up to --max-num-seqs
        (prompt-logprob steps with more rows get a fresh tensor). A fresh [256, 152k] float32 tensor is 155 MB
        that glibc maps, the kernel zero-fills and unmaps every step: 34 + 10 ms against a 7 ms copy into the
        reused one (2 cores). None where the head's own output is float32 already, or on a GPU (its caching
        allocator reuses memory). release_buffers() gives it back when the engine goes idle."""
        if self.device.type != "cpu" or self.dtype == torch.float32 or num_rows > self.config.max_num_seqs:
            return None
        if self._logits is None or self._logits.shape[0] < num_rows:
            grown = max(num_rows, 2 * self._logits.shape[0]) if self._logits is not None else num_rows
            self._logits = None  # the old buffer goes before the larger one comes
            self._logits = torch.empty((min(grown, self.config.max_num_seqs), self.vocab_size), dtype=torch.float32)
        return self._logits[:num_rows]

    def _gather_out(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat K and V buffers of at least num_blocks KV blocks each, for the torch backend's gathers on a CPU
        (see torch_backend.gather_blocks): grown to the most blocks a step has gathered, kept across steps,
        given back by release_buffers(). A step's gathers are as large whether fresh or reused, so the peak
        the profile step measures is the same."""
        cfg = self.model_config
        row = self.block_size * cfg.num_kv_heads * cfg.head_dim
        if self._gathered is None or self._gathered[0].numel() < num_blocks * row:
            self._gathered = None  # the old pair goes before the larger one comes
            self._gathered = tuple(torch.empty(num_blocks * row, dtype=self.kv_dtype) for _ in range(2))
        return self._gathered

    def _read_out(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Flat byte buffers for the torch backend's upcasts of num_blocks gathered KV blocks (torch_backend.
        _read_as), when the pool stores another dtype than decode attention reads (--kv-cache-dtype, or a bf16
        model without GQA, read in float32); None when no read is upcast. Kept and given back as _gather_out's."""
        cfg = self.model_config
        read = read_dtype(self.dtype, cfg.num_heads, cfg.num_kv_heads, self.device)
        if read == self.kv_dtype and self.dtype == self.kv_dtype:
            return None
        num_bytes = num_blocks * self.block_size * cfg.num_kv_heads * cfg.head_dim * max(read.itemsize,
                                                                                           self.dtype.itemsize)
        if self._read is None or self._read[0].numel() < num_bytes:
            self._read = None  # the old pair goes before the larger one comes
            self._read = tuple(torch.empty(num_bytes, dtype=torch.uint8) for _ in range(2))
        return self._read

    def release_buffers(self) -> None:
        """Drop the reused logits and gather buffers (the engine is idle); the next step makes new ones."""
        self._logits = None
        self._gathered = None
        self._read = None

    def _run_graph(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits from a captured decode graph, or None when the step must run eagerly (a prefill in it, a
        LoRA row, or more sequences than the largest graph)."""
        graphs, inputs = self.graphs, batch.seqs
        if graphs is None or not inputs or any(len(inp.token_ids) != 1 or inp.lora_slot >= 0
                                               or inp.features is not None for inp in inputs):  # M-RoPE: eager
            return None
        width = max(len(inp.block_table) for inp in inputs)
        if not graphs.fits(len(inputs), width):
            return None
        bs = self.block_size
        self._zero_blocks(max(max(inp.block_table) for inp in inputs) + 1)  # as _metadata does for eager steps
        positions = [inp.num_computed_tokens for inp in inputs]
        hidden = graphs.run(
            torch.tensor([inp.token_ids[0] for inp in inputs], dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor([inp.block_table[p // bs] * bs + p % bs for inp, p in zip(inputs, positions)],
                         dtype=torch.int64),
            torch.tensor([p + 1 for p in positions], dtype=torch.int64),
            torch.tensor([inp.block_table + [0] * (width - len(inp.block_table)) for inp in inputs],
                         dtype=torch.int64))
        rows = torch.tensor(batch.logit_indices, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden[rows])
