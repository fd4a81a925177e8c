"""EngineConfig and ServerConfig: the only lists of knobs. One field is one CLI flag.

Standard library only. `build_parser` makes argparse from the fields' metadata, so `--help` and
the dataclasses cannot drift apart; `__post_init__` checks ranges and names the flag. A field may carry
vLLM's name for the same knob as an alias (metadata "aliases"), so a `vllm serve` line mostly carries over.

Every flag may also come from the environment as RAWSERVE_<FLAG> (containers); the command line wins.
That is read here, in `build_parser`, and nowhere else: configs built in code see no environment.
"""
from __future__ import annotations

import argparse
import json
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
# --kv-cache-dtype: vLLM's names; "fp8" is e4m3, as in vLLM
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
GENERATION_CONFIGS = ("auto", "vllm")  # or a directory
ENV_PREFIX = "RAWSERVE_"
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch", "triton")
CUDA_GRAPHS = ("auto", "on", "off")
ENGINE_MODES = ("thread", "process")
METRICS_COMPAT = ("none", "vllm")
QUANTIZATIONS = ("none", "int8", "int4")
QUANT_GROUP_SIZES = (32, 128)
# --kv-cache-memory-gb auto on a CPU: the share of the memory left after the weights and a step's working
# memory that the KV cache may take; the rest covers what grows with requests (their state, Python objects).
CPU_MEMORY_SHARE = 0.8


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{flag(name)}: {message}")


@dataclass(slots=True)
class EngineConfig:
    model_dir: str | None = field(default=None, metadata={
        "help": "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer); also "
                "`rawserve serve DIR` and vLLM's --model. Without it the built-in tiny demo model is used.",
        "aliases": ("--model",)})
    dtype: str = field(default="auto", metadata={
        "help": "Weight and activation dtype: auto|float32|bfloat16|float16 (vLLM's half, float, also "
                "accepted). auto is the checkpoint's dtype on a GPU, and float32 on a CPU without native "
                "bf16 arithmetic.",
        "choices": (*DTYPES, *DTYPE_ALIASES)})
    device: str = field(default="auto", metadata={
        "help": "auto|cpu|cuda. auto picks cuda when available.", "choices": DEVICES})
    max_model_len: int | None = field(default=None, metadata={
        "help": "Longest prompt + output, in tokens. Default: the checkpoint's max_position_embeddings."})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV cache block."})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "The KV cache's storage dtype: auto (the activation dtype), bfloat16, float16, fp8_e4m3 (also fp8) "
                "or fp8_e5m2. Attention still computes in the activation dtype: K/V are cast as they are written "
                "and upcast as they are read. fp8 is unscaled (scale 1.0, values saturate at the format's "
                "largest), as vLLM's default without calibrated scales.",
        "choices": (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV cache size in blocks. Overrides --kv-cache-memory-gb."})
    kv_cache_memory_gb: float | str = field(default="auto", metadata={
        "help": "KV cache budget in GiB, or auto: what --max-num-seqs x --max-model-len can use, capped on a CPU "
                f"at {CPU_MEMORY_SHARE:g} of the memory left (the cgroup limit when there is one, else the host's "
                "available memory) after the weights and a measured step's working memory, and on a GPU by "
                "--gpu-memory-utilization. The server refuses to start when that cannot hold one --max-model-len "
                "sequence, or when a budget given here is more than the host can back.",
        "type": lambda text: text if text == "auto" else float(text)})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "vLLM's flag: on a GPU, size the KV cache as this fraction (0..1] of the device memory "
                "free once the weights are loaded (auto: 0.9). Overrides --kv-cache-memory-gb there; ignored "
                "on a CPU."})
    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences in one step's batch."})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "Token budget of one step (prefill chunks + decodes)."})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Share KV blocks of identical prompt prefixes across requests."})
    attention_backend: str = field(default="torch", metadata={
        "help": "Attention implementation: torch (portable, CPU and CUDA) or triton (paged kernels for a GPU; "
                "on a CPU they run only under TRITON_INTERPRET=1, slowly, for tests). triton needs "
                "--block-size >= 16.",
        "choices": ATTENTION_BACKENDS})
    cuda_graphs: str = field(default="auto", metadata={
        "help": "Replay decode steps from CUDA graphs captured at start for a ladder of batch sizes: "
                "auto (on with a CUDA device and --attention-backend triton, else off), on, off.",
        "choices": CUDA_GRAPHS})
    seed: int = field(default=0, metadata={"help": "Seed for unseeded sampling."})
    num_threads: int | str = field(default="auto", metadata={
        "help": "The engine's intra-op (OpenMP) threads, or auto: OMP_NUM_THREADS when set, else the CPUs this "
                "process may use (its affinity mask, capped by a cgroup CPU quota rounded down), less one left to "
                "the front process above 4. A spawned engine also gets GOMP_SPINCOUNT=30000 and KMP_BLOCKTIME=0 "
                "unless the environment sets its own (OMP_WAIT_POLICY, GOMP_SPINCOUNT, KMP_BLOCKTIME).",
        "type": lambda text: text if text == "auto" else int(text)})
    enable_lora: bool = field(default=False, metadata={
        "help": "Serve LoRA adapters (implied by --lora-modules): reserves --max-loras slots of rank "
                "--max-lora-rank on every decoder linear."})
    lora_modules: list[str] = field(default_factory=list, metadata={
        "help": "LoRA adapters to serve, as name=path (a PEFT directory) or vLLM's JSON "
                '{"name": ..., "path": ...}; several after one flag, or the flag repeated. Requests select one '
                "with model: name or a lora field.", "nargs": "+"})
    max_loras: int = field(default=1, metadata={
        "help": "Adapters resident at once, and so most distinct adapters in one step (vLLM's flag)."})
    max_lora_rank: int = field(default=16, metadata={"help": "Largest adapter rank accepted."})
    allow_runtime_lora_updating: bool = field(default=False, metadata={
        "help": "Open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING); without it they answer 404. Loads read only under --lora-root, "
                "which it needs. Implies --enable-lora."})
    lora_root: str | None = field(default=None, metadata={
        "help": "The directory runtime loads may read adapters from: a load's lora_path is taken relative to it and "
                "must resolve (symlinks followed) under it; anything else is one generic 400. --lora-modules are "
                "not limited to it."})
    lora_load_timeout_s: float = field(default=60.0, metadata={
        "help": "A runtime adapter load that has not finished reading after this long fails (its client gets a "
                "400); later loads do not wait for it."})
    quantization: str = field(default="none", metadata={
        "help": "Quantize the decoder's linear weights as they load (CPU only): none, int8 (per-output-channel "
                "symmetric, run as dynamic W8A8 through torch's quantized engine, or weight-only int8 where that "
                "is missing) or int4 (group-wise asymmetric, weight-only; the LM head is held in int8). Norms, "
                "embeddings and attention stay at --dtype.",
        "choices": QUANTIZATIONS})
    quantization_group_size: int = field(default=128, metadata={
        "help": "Input columns sharing one scale and zero point under --quantization int4: 32 or 128.",
        "choices": QUANT_GROUP_SIZES})
    speculative_config: str | None = field(default=None, metadata={
        "help": "Speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
                "\"prompt_lookup_min\": a, \"prompt_lookup_max\": b} drafts from the latest earlier match of the "
                "last a..b tokens; {\"method\": \"synthetic\", \"num_speculative_tokens\": k, "
                "\"acceptance_length\": L} (benchmarks only: drafts forced accepted at a mean of L tokens per step, "
                "as llama.cpp's --spec-synth-len; the output is not the model's); {\"model\": DIR, "
                "\"num_speculative_tokens\": k}: a smaller checkpoint of the same vocabulary drafts greedily (its own "
                "KV pool, indexed by the target's block ids); {\"method\": \"mtp\", \"num_speculative_tokens\": k}: "
                "a Qwen3.5 checkpoint's own multi-token-prediction layer (mtp.*) drafts greedily from the target's "
                "hidden states. Optional \"disable_by_batch_size\" "
                "(no drafts once that many rows decode; by default that is measured: drafting stays on while timed "
                "drafted steps out-produce plain ones at the batch's size) and \"min_acceptance\" (a row drafting "
                "fewer accepted tokens per step pauses). Verified in one target step; greedy output is unchanged and sampling "
                "keeps the target's distribution."})
    runner: str = field(default="auto", metadata={
        "help": "What the checkpoint serves: auto|generate|embed|rerank. auto: a BERT-family encoder embeds (reranks "
                "with a classification head), a decoder with sentence-transformers' modules.json (Qwen3-Embedding) "
                "embeds, any other decoder generates. rerank on a Qwen3 checkpoint is Qwen3-Reranker's yes/no "
                "scoring. An embed or rerank model answers /v1/embeddings or /v1/rerank, and 400 elsewhere.",
        "choices": ("auto", "generate", "embed", "rerank")})
    pooling: str = field(default="auto", metadata={
        "help": "An embedding model's pooling: auto (its 1_Pooling/config.json; else cls for encoders, last for "
                "decoders), mean, cls or last.",
        "choices": ("auto", "mean", "cls", "last")})
    encoder_cache_mb: int = field(default=256, metadata={
        "help": "MiB of vision-tower outputs kept by image (LRU), so an image sent again is encoded once; 0 "
                "disables it (an image encoded again for each request that sends it). Qwen3.5-0.8B's encoding of a "
                "1920x1080 image takes 8 MiB."})
    mm_processor_kwargs: str | dict | None = field(default=None, metadata={
        "help": "Overrides of the checkpoint's image processor bounds (preprocessor_config.json), as vLLM's JSON: "
                '\'{"max_pixels": 1003520, "min_pixels": 3136}\' or transformers\' \'{"size": {"longest_edge": N, '
                '"shortest_edge": M}}\' (pixels of one resized image). A lower max_pixels gives a large image fewer '
                "tokens (and the tower less work) and lowers the memory the core reserves for the tower's largest "
                "forward; the same size is what transformers' processor gives with these kwargs."})

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or self.allow_runtime_lora_updating or bool(self.lora_modules)

    def lora_paths(self) -> dict[str, str]:
        """--lora-modules as {name: path}."""
        paths = {}
        for item in self.lora_modules or ():
            if item.lstrip().startswith("{"):
                try:
                    spec = json.loads(item)
                    name, path = spec["name"], spec["path"]
                except (ValueError, KeyError, TypeError):
                    name = path = None
                _check(isinstance(name, str) and isinstance(path, str) and bool(name and path), "lora_modules",
                       f'expected {{"name": ..., "path": ...}}, got {item!r}')
                specs = [(name, path)]
            else:
                specs = []
                for spec in item.split():
                    name, sep, path = spec.partition("=")
                    _check(bool(sep and name and path), "lora_modules", f"expected name=path, got {spec!r}")
                    specs.append((name, path))
            for name, path in specs:
                _check(name not in paths, "lora_modules", f"adapter name {name!r} given twice")
                paths[name] = path
        return paths

    def mm_pixel_bounds(self) -> dict[str, int]:
        """--mm-processor-kwargs as {"min_pixels": M, "max_pixels": N}, either absent when not given (ValueError
        naming the flag for anything else: an unknown key, a bound that is not a positive integer, one bound
        spelled two ways with two values, min above max)."""
        if self.mm_processor_kwargs is None:
            return {}
        name = "mm_processor_kwargs"
        kwargs = self.mm_processor_kwargs  # a dict from Python (LLM(mm_processor_kwargs={...}), as vLLM's)
        if isinstance(kwargs, str):
            try:
                kwargs = json.loads(kwargs)
            except ValueError as error:
                raise ValueError(f"{flag(name)}: not JSON ({error})") from None
        _check(isinstance(kwargs, dict), name, f"expected a JSON object, got {kwargs!r}")
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels", "size"})
        _check(not unknown, name, f"rawserve's image processor takes min_pixels, max_pixels and size "
                                  f"(shortest_edge, longest_edge); not {', '.join(map(repr, unknown))}")
        size = kwargs.get("size", {})
        _check(isinstance(size, dict), name, f"size must be an object, got {size!r}")
        unknown = sorted(set(size) - {"shortest_edge", "longest_edge"})
        _check(not unknown, name, f"size takes shortest_edge and longest_edge; not {', '.join(map(repr, unknown))}")
        bounds: dict[str, int] = {}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            given = {k: v for k, v in ((key, kwargs.get(key)), (f"size.{edge}", size.get(edge))) if v is not None}
            for spelled, value in given.items():
                _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                       f"{spelled} must be a positive integer (pixels), got {value!r}")
            _check(len(set(given.values())) <= 1, name, f"{key} and size.{edge} are the same bound; they differ")
            if given:
                bounds[key] = next(iter(given.values()))
        _check(bounds.get("min_pixels", 0) <= bounds.get("max_pixels", bounds.get("min_pixels", 0)), name,
               f"min_pixels {bounds.get('min_pixels')} exceeds max_pixels {bounds.get('max_pixels')}")
        return bounds

    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed and checked (ValueError naming the flag), or None without it."""
        if self.speculative_config is None:
            return None
        try:
            spec = json.loads(self.speculative_config)
        except ValueError as error:
            raise ValueError(f"{flag('speculative_config')}: not JSON ({error})") from None
        _check(isinstance(spec, dict), "speculative_config", f"expected a JSON object, got {spec!r}")
        return SpeculativeConfig.from_dict(spec)

    def __post_init__(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _check(self.dtype in DTYPES, "dtype", f"must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
               f"must be one of {'|'.join(KV_CACHE_DTYPES)} (or fp8), got {self.kv_cache_dtype!r}")
        _check(self.device in DEVICES, "device", f"must be one of {'|'.join(DEVICES)}, got {self.device!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {'|'.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        _check(self.cuda_graphs in CUDA_GRAPHS, "cuda_graphs",
               f"must be one of {'|'.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}")
        _check(not (self.cuda_graphs == "on" and self.device == "cpu"), "cuda_graphs",
               "on needs a CUDA device, but --device is cpu")
        _check(not (self.cuda_graphs == "on" and self.attention_backend != "triton"), "cuda_graphs",
               "on needs --attention-backend triton (the torch backend's decode is not capturable)")
        _check(self.attention_backend != "triton" or self.block_size >= 16, "block_size",
               f"--attention-backend triton needs a block size >= 16, got {self.block_size}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
               f"must be a power of two, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        if self.kv_cache_memory_gb != "auto":
            try:
                self.kv_cache_memory_gb = float(self.kv_cache_memory_gb)
            except (TypeError, ValueError):
                _check(False, "kv_cache_memory_gb", f"must be auto or a number of GiB, got {self.kv_cache_memory_gb!r}")
            _check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        _check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_threads != "auto":
            try:
                self.num_threads = int(self.num_threads)
            except (TypeError, ValueError):
                _check(False, "num_threads", f"must be auto or a number of threads, got {self.num_threads!r}")
            _check(self.num_threads >= 1, "num_threads", f"must be >= 1, got {self.num_threads}")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _check(self.max_loras >= 1, "max_loras", "must be >= 1")
        _check(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        _check(not self.allow_runtime_lora_updating or self.lora_root is not None, "allow_runtime_lora_updating",
               "needs --lora-root DIR, the directory runtime loads may read adapters from")
        _check(self.lora_root is None or os.path.isdir(self.lora_root), "lora_root",
               f"{self.lora_root!r} is not a directory")
        _check(self.lora_load_timeout_s > 0, "lora_load_timeout_s", "must be > 0")
        _check(self.quantization in QUANTIZATIONS, "quantization",
               f"must be one of {'|'.join(QUANTIZATIONS)}, got {self.quantization!r}")
        _check(self.quantization_group_size in QUANT_GROUP_SIZES, "quantization_group_size",
               f"must be 32 or 128, got {self.quantization_group_size!r}")
        _check(self.runner in ("auto", "generate", "embed", "rerank"), "runner",
               f"must be one of auto|generate|embed|rerank, got {self.runner!r}")
        _check(self.pooling in ("auto", "mean", "cls", "last"), "pooling",
               f"must be one of auto|mean|cls|last, got {self.pooling!r}")
        _check(self.encoder_cache_mb >= 0, "encoder_cache_mb", f"must be >= 0, got {self.encoder_cache_mb}")
        self.lora_paths()
        self.speculative()
        self.mm_pixel_bounds()


# --speculative-config's methods: what a proposer drafts from (draft_model: {"model": DIR}; mtp: a Qwen3.5
# checkpoint's own mtp.* layer). EAGLE is vLLM's other; it is refused at start until rawserve has it.
SPEC_METHODS = ("ngram", "synthetic", "draft_model", "mtp")
SPEC_MAX_TOKENS = 16  # drafts per step: past a handful, acceptance of the last positions is near zero anyway


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """--speculative-config, checked. Fields are vLLM's names (rawserve's own: acceptance_length, min_acceptance)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # synthetic: mean tokens per verified step, the target's own token included; with a draft model or MTP (for
    # benchmarks, as llama.cpp's --spec-synth-len over real drafts) their acceptance drawn at that mean
    acceptance_length: float = 1.0
    # No drafts in a step where at least this many rows decode (the step is compute-bound there). None: measured
    # at run time per batch size (engine/spec/policy.py BatchPolicy, from timed drafted and plain steps).
    disable_by_batch_size: int | None = None
    # A row whose drafts win fewer accepted tokens per step than this (an average over its recent steps) stops
    # drafting for a while, then tries again: its drafts cost a wider step and buy nothing.
    min_acceptance: float = 0.1
    seed: int = 0  # synthetic: its acceptance draws
    model: str | None = None  # draft_model: the draft checkpoint's directory

    @classmethod
    def from_dict(cls, spec: dict) -> SpeculativeConfig:
        name = "speculative_config"
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        _check(not unknown, name, f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        method = spec.get("method", "draft_model" if "model" in spec else None)
        if method in ("eagle", "eagle3", "medusa"):
            _check(False, name, f"method {method!r} is not supported by this build; use one of "
                                f"{'|'.join(SPEC_METHODS)}")
        _check(method in SPEC_METHODS, name, f"method must be one of {'|'.join(SPEC_METHODS)}, got {method!r}")
        values = dict(spec)
        values["method"] = method
        if method == "draft_model":
            model = values.get("model")
            _check(isinstance(model, str) and os.path.isdir(model), name,
                   f"the draft model needs \"model\": a checkpoint directory, got {model!r}")
        else:
            _check("model" not in values, name, f"\"model\" is for a draft model, not method {method!r}")
        k = values.get("num_speculative_tokens")
        _check(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= SPEC_MAX_TOKENS, name,
               f"num_speculative_tokens must be an integer in 1..{SPEC_MAX_TOKENS}, got {k!r}")
        for key in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "seed"):
            value = values.get(key, 1)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= (0 if key == "seed" else 1),
                   name, f"{key} must be an integer >= {0 if key == 'seed' else 1}, got {value!r}")
        for key in ("acceptance_length", "min_acceptance"):
            value = values.get(key, 1.0)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0, name,
                   f"{key} must be a number >= 0, got {value!r}")
        config = cls(**values)
        _check(config.prompt_lookup_min <= config.prompt_lookup_max, name,
               f"prompt_lookup_min ({config.prompt_lookup_min}) must be <= prompt_lookup_max "
               f"({config.prompt_lookup_max})")
        if method == "synthetic" or "acceptance_length" in spec:  # a draft model's or MTP's: benchmarks' forcing
            _check(1 <= config.acceptance_length <= k + 1, name,
                   f"acceptance_length must be in 1..num_speculative_tokens + 1 ({k + 1}), got "
                   f"{config.acceptance_length!r}")
        return config


@dataclass(slots=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0 picks a free one)."})
    served_model_name: str | None = field(default=None, metadata={
        "help": "Model id clients send and see. Default: the checkpoint directory's name."})
    api_key: list[str] = field(default_factory=list, metadata={
        "help": "Accepted bearer key for every path but /health, /ready and /metrics; repeat the flag for "
                "several. None: no auth."})
    api_key_file: str | None = field(default=None, metadata={
        "help": "File of accepted bearer keys, one 'key' or 'key:tpm' per line (blank lines and # comments "
                "skipped); tpm overrides --rate-limit-tpm for that key. Adds to --api-key."})
    rate_limit_tpm: int | None = field(default=None, metadata={
        "help": "Tokens per minute each API key may spend (prompt + max_tokens at admission, the unused part "
                "refunded when the request ends); a token bucket refilled continuously. None: unlimited."})
    per_key_cache_salt: bool = field(default=True, metadata={
        "help": "Give each API key its own prefix-cache salt, so one tenant cannot time another's prompts "
                "through cache hits (a request's cache_salt is combined with it). --no-per-key-cache-salt shares "
                "the cache across keys."})
    open_paths: list[str] = field(default_factory=list, metadata={
        "help": "More paths served without an API key (e.g. /tokenize /detokenize /version); several after one "
                "flag, or the flag repeated.", "nargs": "+"})
    allowed_origins: list[str] = field(default_factory=list, metadata={
        "help": "CORS origins allowed (repeatable; '*' for any). None: CORS off."})
    keep_alive_s: float = field(default=5.0, metadata={"help": "Idle time before a keep-alive connection closes."})
    header_timeout_s: float = field(default=10.0, metadata={
        "help": "Time to receive a request's line and headers (slowloris guard); 408 after it."})
    body_timeout_s: float = field(default=30.0, metadata={"help": "Time to receive a request body; 408 after it."})
    write_timeout_s: float = field(default=60.0, metadata={
        "help": "Time a response may wait on a client that reads nothing; then the connection is "
                "dropped and its request aborted."})
    max_header_bytes: int = field(default=16384, metadata={"help": "Limit on request line + headers; 431 past it."})
    max_body_bytes: int = field(default=8 * 1024 * 1024, metadata={"help": "Limit on a request body; 413 past it."})
    max_connections: int = field(default=1024, metadata={
        "help": "Open connections at most. At the cap a new connection closes the one idle longest (no request "
                "in progress); only when every connection is busy is it refused with 503."})
    max_connections_per_ip: int = field(default=0, metadata={
        "help": "Open connections from one client address at most; more are refused with 503 (0: no limit)."})
    first_byte_timeout_s: float = field(default=2.0, metadata={
        "help": "Time a new connection has to send its first byte before it is closed (shorter than "
                "--keep-alive-s: silent sockets must not hold connection slots)."})
    sse_ping_interval_s: float = field(default=15.0, metadata={
        "help": "Interval of ': ping' comments while a stream waits (0 disables)."})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "On SIGTERM/SIGINT, time for in-flight requests to finish before exit (vLLM: "
                "--shutdown-timeout).", "aliases": ("--shutdown-timeout",)})
    engine_mode: str = field(default="process", metadata={
        "help": "Run the engine core in a spawned process or a thread.", "choices": ENGINE_MODES})
    max_pending: int = field(default=1024, metadata={"help": "Requests in flight at most; 503 past it."})
    engine_stall_timeout_s: float = field(default=30.0, metadata={
        "help": "/health answers 503 (engine_stalled) when requests are waiting and the engine core has sent "
                "nothing, not even its heartbeat (every second), for this long; 200 again once it speaks."})
    request_timeout_s: float = field(default=600.0, metadata={"help": "Deadline of one request."})
    guided_compile_timeout_s: float = field(default=5.0, metadata={
        "help": "Deadline of one structured-output grammar compile; past it the compile's worker process is "
                "killed and replaced, and the request gets a 400."})
    guided_compile_workers: int = field(default=2, metadata={
        "help": "Processes that compile structured-output grammars (each started at its first compile); a slow "
                "compile holds up only its own."})
    chat_template: str | None = field(default=None, metadata={
        "help": "Jinja chat template file overriding the checkpoint's."})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "Tool-call output parser by name (hermes, llama3_json, qwen3_coder, openai: gpt-oss's harmony); auto: "
                "qwen3_coder when the chat template teaches the XML form (<function=...><parameter=...>), openai when "
                "it writes harmony (<|channel|>, <|message|>), else hermes."})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "Reasoning output parser by name (qwen3, deepseek_r1, gpt_oss); None: no reasoning split (gpt-oss's "
                "harmony channels are split by the openai tool parser all the same)."})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "Accepted for vLLM command lines; changes nothing: tool calls are always parsed when a "
                "request lists tools."})
    generation_config: str = field(default="auto", metadata={
        "help": "Where unset sampling fields come from: auto (the checkpoint's generation_config.json), "
                "vllm (neutral defaults, the file ignored), or a directory holding a generation_config.json. "
                "EOS ids always come from the checkpoint."})
    log_requests: bool = field(default=True, metadata={
        "help": "An access log line per request (vLLM's --enable-log-requests / --disable-log-requests "
                "also work).", "aliases": ("--enable-log-requests",), "negative_aliases": ("--disable-log-requests",)})
    log_level: str = field(default="info", metadata={
        "help": "Log level of the server and the engine process (vLLM: --uvicorn-log-level).",
        "choices": LOG_LEVELS, "aliases": ("--uvicorn-log-level",)})
    responses_store_max: int = field(default=1000, metadata={
        "help": "Stored responses kept in memory for GET /v1/responses/{id} and previous_response_id, least "
                "recently used dropped first (0: none are kept)."})
    metrics_compat: str = field(default="none", metadata={
        "help": "vllm: /metrics also shows every metric under vLLM's names (vllm:*, labels model_name and "
                "engine), for routers and dashboards built for vLLM.", "choices": METRICS_COMPAT})
    ssl_keyfile: str | None = field(default=None, metadata={
        "help": "PEM private key: serve HTTPS (with --ssl-certfile) on the same asyncio stack."})
    ssl_certfile: str | None = field(default=None, metadata={"help": "PEM certificate chain for --ssl-keyfile."})
    limit_mm_per_prompt: str = field(default="image=8", metadata={
        "help": "Media items one prompt may carry, per modality: vLLM's form, 'image=4' or JSON '{\"image\": 4}' "
                "(image is the modality rawserve takes; 0 refuses images)."})
    allowed_media_domains: list[str] = field(default_factory=list, metadata={
        "help": "Hosts http(s) image URLs may name (each redirect's too); several after one flag. None: any "
                "host the server can reach.", "nargs": "+"})
    allowed_local_media_path: str | None = field(default=None, metadata={
        "help": "Directory file:// image URLs may read from (symlinks resolved first). None: no file:// URLs."})
    media_fetch_timeout_s: float = field(default=10.0, metadata={
        "help": "Time to fetch one http(s) image, redirects included; a 400 past it."})
    max_image_bytes: int = field(default=20 * 1024 * 1024, metadata={
        "help": "Encoded bytes of one image at most (data:, fetched or file://); a 400 past it."})
    max_image_pixels: int = field(default=4096 * 4096, metadata={
        "help": "Pixels of one decoded image at most, checked from its header before it is decoded (a "
                "decompression-bomb guard); a 400 past it."})
    max_request_image_pixels: int = field(default=2 * 4096 * 4096, metadata={
        "help": "Decoded pixels of all of one request's images together at most; a 400 past it."})

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _check(all(p.startswith("/") for p in self.open_paths), "open_paths", "each path starts with '/'")
        _check(self.max_connections_per_ip >= 0, "max_connections_per_ip", "must be >= 0")
        for name in ("keep_alive_s", "first_byte_timeout_s", "engine_stall_timeout_s", "header_timeout_s", "body_timeout_s", "write_timeout_s", "drain_timeout_s",
                     "request_timeout_s", "guided_compile_timeout_s"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(self.sse_ping_interval_s >= 0, "sse_ping_interval_s", "must be >= 0")
        _check(self.rate_limit_tpm is None or self.rate_limit_tpm >= 1, "rate_limit_tpm",
               f"must be >= 1, got {self.rate_limit_tpm}")
        _check(self.api_key_file is None or os.path.isfile(self.api_key_file), "api_key_file",
               f"no such file {self.api_key_file!r}")
        _check(self.responses_store_max >= 0, "responses_store_max", f"must be >= 0, got {self.responses_store_max}")
        for name in ("max_header_bytes", "max_body_bytes", "max_connections", "max_pending",
                     "guided_compile_workers"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.engine_mode in ENGINE_MODES, "engine_mode", f"must be thread|process, got {self.engine_mode!r}")
        self.log_level = self.log_level.lower()
        _check(self.log_level in LOG_LEVELS, "log_level", f"must be one of {'|'.join(LOG_LEVELS)}, got {self.log_level!r}")
        _check(self.generation_config in GENERATION_CONFIGS or os.path.isdir(self.generation_config),
               "generation_config", f"must be auto, vllm or a directory, got {self.generation_config!r}")
        _check(self.metrics_compat in METRICS_COMPAT, "metrics_compat",
               f"must be one of {'|'.join(METRICS_COMPAT)}, got {self.metrics_compat!r}")
        _check((self.ssl_keyfile is None) == (self.ssl_certfile is None), "ssl_certfile",
               "--ssl-keyfile and --ssl-certfile go together")
        self.mm_limits()  # a malformed --limit-mm-per-prompt fails at startup
        for name in ("max_image_bytes", "max_image_pixels", "max_request_image_pixels"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.media_fetch_timeout_s > 0, "media_fetch_timeout_s", f"must be > 0, got {self.media_fetch_timeout_s}")
        _check(self.allowed_local_media_path is None or os.path.isdir(self.allowed_local_media_path),
               "allowed_local_media_path", f"no such directory {self.allowed_local_media_path!r}")

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    def mm_limits(self) -> dict[str, int]:
        """--limit-mm-per-prompt as {modality: count}: 'image=4,video=0' or a JSON object."""
        text = self.limit_mm_per_prompt.strip()
        try:
            limits = json.loads(text) if text.startswith("{") else {
                key.strip(): int(value) for key, _, value in (item.partition("=") for item in text.split(",") if item)}
        except ValueError:
            limits = None
        _check(isinstance(limits, dict) and all(isinstance(k, str) and k and type(v) is int and v >= 0
                                                for k, v in limits.items()), "limit_mm_per_prompt",
               f"expected 'image=N' or a JSON object of counts >= 0, got {self.limit_mm_per_prompt!r}")
        return limits

    def api_keys(self) -> dict[str, int | None]:
        """Every accepted key (--api-key, then --api-key-file) with its tokens-per-minute limit (None: none)."""
        keys: dict[str, int | None] = {key: self.rate_limit_tpm for key in self.api_key}
        if self.api_key_file is None:
            return keys
        with open(self.api_key_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for number, line in enumerate(lines, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, tpm = line.rpartition(":")
            if not sep or not tpm.isdigit():  # no limit given (a key may hold ':' itself)
                key, tpm = line, None
            _check(bool(key) and key == key.strip(), "api_key_file", f"line {number}: empty key")
            _check(tpm is None or int(tpm) >= 1, "api_key_file", f"line {number}: tpm must be >= 1")
            keys[key] = int(tpm) if tpm is not None else self.rate_limit_tpm
        return keys


def _scalar_type(tp: typing.Any) -> typing.Any:
    """int | None -> int; list[str] -> str (with the list flag handled by the caller)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar_type(args[0])
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0]
    return tp


class _Append(argparse._AppendAction):
    """A repeatable flag whose first use replaces its default (a list from RAWSERVE_<FLAG>) instead of
    adding to it: the command line wins over the environment, it does not merge with it."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        items = getattr(namespace, self.dest, None)
        items = [] if items is None or items is self.default else list(items)
        if isinstance(values, list):  # nargs="+": `--flag a b` is `--flag a --flag b`
            items.extend(values)
        else:
            items.append(values)
        setattr(namespace, self.dest, items)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        kwargs: dict[str, typing.Any] = {"help": f.metadata.get("help", ""), "dest": f.name}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["default"] = f.default
        elif typing.get_origin(tp) is list:
            kwargs["action"] = _Append
            kwargs["type"] = _scalar_type(tp)
            kwargs["default"] = None
            if "nargs" in f.metadata:
                kwargs["nargs"] = f.metadata["nargs"]
        else:
            kwargs["type"] = f.metadata.get("type", _scalar_type(tp))
            kwargs["default"] = f.default
        group.add_argument(flag(f.name), *f.metadata.get("aliases", ()), **kwargs)
        for negative in f.metadata.get("negative_aliases", ()):
            group.add_argument(negative, dest=f.name, action="store_false", help=f"Same as --no-{flag(f.name)[2:]}.")


def build_parser(prog: str = "rawserve serve", environ: typing.Mapping[str, str] | None = None
                 ) -> argparse.ArgumentParser:
    """The server's flags, with defaults from RAWSERVE_<FLAG> in `environ` (default: os.environ).
    No prefix matching: `--model X` is --model-dir because it says so, and `--mod X` is an error."""
    parser = argparse.ArgumentParser(prog=prog, description="rawserve: an OpenAI-compatible LLM server.",
                                     allow_abbrev=False)
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServerConfig)
    apply_environment(parser, os.environ if environ is None else environ)
    return parser


def env_name(action: argparse.Action) -> str:
    """RAWSERVE_API_KEY for --api-key: the flag's first (canonical) name."""
    return ENV_PREFIX + action.option_strings[0][2:].upper().replace("-", "_")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def apply_environment(parser: argparse.ArgumentParser, environ: typing.Mapping[str, str]) -> None:
    """Set each flag's default from RAWSERVE_<FLAG> (a list flag takes comma-separated values; a switch
    1/0, true/false, yes/no, on/off). A bad value is a parser error naming the variable."""
    seen: set[str] = set()
    for action in parser._actions:
        if not action.option_strings or not action.option_strings[0].startswith("--") or action.dest in seen:
            continue
        if action.dest == "help" or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        seen.add(action.dest)  # a negative alias shares the dest; the canonical flag came first
        name = env_name(action)
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction,
                                   argparse._StoreFalseAction)):
                if raw.strip().lower() not in _TRUE + _FALSE:
                    raise ValueError("expected 1/0, true/false, yes/no or on/off")
                value: typing.Any = raw.strip().lower() in _TRUE
            elif isinstance(action, argparse._AppendAction):
                convert = action.type or str
                value = [convert(item.strip()) for item in raw.split(",") if item.strip()]
            else:
                value = (action.type or str)(raw)
            items = value if isinstance(value, list) else [value]
            if action.choices is not None and any(v not in action.choices for v in items):
                raise ValueError(f"must be one of {'|'.join(map(str, action.choices))}")
        except ValueError as error:
            parser.error(f"{name}={raw!r}: {error}")
        parser.set_defaults(**{action.dest: value})


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    def make(cls: type) -> typing.Any:
        kwargs = {}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name)
            if value is None and f.default_factory is not dataclasses.MISSING:  # an unrepeated list flag
                continue
            kwargs[f.name] = value
        return cls(**kwargs)

    return make(EngineConfig), make(ServerConfig)
