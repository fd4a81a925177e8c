"""ModelRunner: load the model, own the paged KV cache, and turn one step's batch into logits.

Core side only: it knows token ids, positions and block tables, never text or requests' sampling.
"""
from __future__ import annotations

import logging
import pathlib
import platform

import torch

from rawserve.config import EngineConfig
from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.loader import ModelConfig, load_weights, read_model_config
from rawserve.engine.lora import LoraWeights
from rawserve.engine.models.decoder import DecoderModel, cpu_prepack_supported
from rawserve.engine.step_plan import ForwardBatch

log = logging.getLogger("rawserve.engine")

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when this CPU does bf16 arithmetic in hardware (AVX512-BF16, AMX, or Arm's BF16 extension).

    Without it torch emulates bf16 matmuls at a small fraction of float32 speed (1-18 GFLOP/s vs
    ~110 on an AVX2-only box), so dtype=auto must not pick bf16 there.
    """
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        # No /proc (macOS): Apple silicon since M2 has BF16; Intel Macs do not.
        return platform.machine() == "arm64"
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda was asked for but torch sees no CUDA device")
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPE_NAMES[config.dtype]
    if device.type == "cuda":
        return checkpoint_dtype
    if checkpoint_dtype == torch.bfloat16 and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype, device: torch.device,
               cfg: ModelConfig | None = None, *, prepack: bool = True) -> DecoderModel:
    """Build the model without initialising it, then stream the checkpoint's tensors into it.

    prepack: on CPU, hold the matmul weights in oneDNN's packed layout (see DecoderLayer.prepack).
    """
    cfg = cfg or read_model_config(model_dir)
    with torch.device("meta"):
        model = DecoderModel(cfg, dtype)
    model.to_empty(device=device)
    load_weights(model_dir, model.targets())
    if prepack and device.type == "cpu" and cpu_prepack_supported(dtype):
        model.prepack()
    return model.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.model_dir is None:
            raise ValueError("--model-dir: the model runner needs a checkpoint directory")
        self.config = config
        self.model_config = cfg = read_model_config(config.model_dir)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, cfg.dtype, self.device)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"--max-model-len: {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = load_model(config.model_dir, self.dtype, self.device, cfg)
        self.model.init_rope(self.max_model_len, self.device)
        self.lora: LoraWeights | None = None
        if config.lora_enabled:
            self.lora = LoraWeights(cfg, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            self.model.enable_lora(self.lora)
        self.num_blocks = self._num_blocks()
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed, not left empty: masked-out slots are multiplied by 0 probability, and 0 * NaN is NaN.
        # Written with zero_() rather than torch.zeros: calloc'ed pages stay unmapped until written, and
        # gathers from them ran 10-40x slower on CPU. This commits the whole pool at start, as on a GPU.
        self.kv_caches = [(torch.empty(shape, dtype=self.dtype, device=self.device).zero_(),
                           torch.empty(shape, dtype=self.dtype, device=self.device).zero_())
                          for _ in range(cfg.num_layers)]
        log.info("model %s: %s on %s, %d KV blocks of %d tokens", config.model_dir, self.dtype, self.device,
                 self.num_blocks, self.block_size)

    def _num_blocks(self) -> int:
        cfg = self.model_config
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        bytes_per_block = (2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim
                           * torch.finfo(self.dtype).bits // 8)
        memory_bytes = self.config.kv_cache_memory_gb * (1 << 30)
        if self.config.gpu_memory_utilization is not None and self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)  # the weights are loaded: this is what is left
            memory_bytes = self.config.gpu_memory_utilization * free_bytes
        budget = int(memory_bytes) // bytes_per_block
        # More blocks than every sequence at full length could use is memory for nothing.
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(budget, useful))

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
        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        decode_ids = torch.tensor(decode_seq, dtype=torch.int64)
        decode_blocks = tables[decode_ids, :-(-max_decode_len // bs)].flatten()
        decode_mask = (torch.arange(max_decode_len).unsqueeze(0) < seq_lens_t[decode_ids].unsqueeze(1))[:, None, None]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=seq_lens_t.to(dev),
            block_tables=tables.to(dev),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            decode_token_ids=torch.tensor(decode_tok, dtype=torch.int64, device=dev),
            max_decode_len=max_decode_len, decode_blocks=decode_blocks.to(dev), decode_mask=decode_mask.to(dev),
            prefill_seq_ids=prefill_seq, block_size=bs)
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                torch.tensor(batch.logit_indices, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over the flattened batch -> float32 logits [len(batch.logit_indices), vocab_size].

        Row r is flattened token batch.logit_indices[r]'s, predicting the token after it; which rows a step
        needs is the StepPlan's to say.
        """
        input_ids, positions, meta, rows = self._metadata(batch)
        lora = None
        if self.lora is not None and any(inp.lora_slot >= 0 for inp in batch.seqs):  # a base-only step: no work
            token_slots = [s for inp in batch.seqs for s in [inp.lora_slot] * len(inp.token_ids)]
            lora = self.lora.batch(token_slots)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, lora)  # [T, hidden]
        if rows.numel() == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[rows])  # [num_rows, vocab]
