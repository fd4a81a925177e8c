"""EngineConfig and ServerConfig: the only lists of knobs. One field is one CLI flag.

Standard library only. `build_parser` makes argparse from the fields' metadata, so `--help` and
the dataclasses cannot drift apart; `__post_init__` checks ranges and names the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("torch",)  # triton kernels are planned; the portable backend runs everywhere
ENGINE_MODES = ("thread", "process")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{flag(name)}: {message}")


@dataclass(slots=True)
class EngineConfig:
    model_dir: str | None = field(default=None, metadata={
        "help": "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer). "
                "Without it the built-in tiny demo model is used."})
    dtype: str = field(default="auto", metadata={
        "help": "Weight and activation dtype: auto|float32|bfloat16|float16. auto is the checkpoint's "
                "dtype on a GPU, and float32 on a CPU without native bf16 arithmetic.",
        "choices": DTYPES})
    device: str = field(default="auto", metadata={
        "help": "auto|cpu|cuda. auto picks cuda when available.", "choices": DEVICES})
    max_model_len: int | None = field(default=None, metadata={
        "help": "Longest prompt + output, in tokens. Default: the checkpoint's max_position_embeddings."})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV cache block."})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV cache size in blocks. Overrides --kv-cache-memory-gb."})
    kv_cache_memory_gb: float = field(default=1.0, metadata={
        "help": "KV cache budget in GiB, used when --num-kv-blocks is not given."})
    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences in one step's batch."})
    max_num_batched_tokens: int = field(default=2048, metadata={
        "help": "Token budget of one step (prefill chunks + decodes)."})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Share KV blocks of identical prompt prefixes across requests."})
    attention_backend: str = field(default="torch", metadata={
        "help": "Attention implementation: torch (portable, CPU and CUDA; the only one so far).",
        "choices": ATTENTION_BACKENDS})
    seed: int = field(default=0, metadata={"help": "Seed for unseeded sampling."})

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device in DEVICES, "device", f"must be one of {'|'.join(DEVICES)}, got {self.device!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               f"must be one of {'|'.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
               f"must be a power of two, got {self.block_size}")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        _check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")


@dataclass(slots=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on."})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (0 picks a free one)."})
    served_model_name: str | None = field(default=None, metadata={
        "help": "Model id clients send and see. Default: the checkpoint directory's name."})
    api_key: list[str] = field(default_factory=list, metadata={
        "help": "Accepted bearer key for /v1/*; repeat the flag for several. None: no auth."})
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
    max_connections: int = field(default=1024, metadata={"help": "Open connections at most; more are refused."})
    sse_ping_interval_s: float = field(default=15.0, metadata={
        "help": "Interval of ': ping' comments while a stream waits (0 disables)."})
    drain_timeout_s: float = field(default=30.0, metadata={
        "help": "On SIGTERM/SIGINT, time for in-flight requests to finish before exit."})
    engine_mode: str = field(default="process", metadata={
        "help": "Run the engine core in a spawned process or a thread.", "choices": ENGINE_MODES})
    max_pending: int = field(default=1024, metadata={"help": "Requests in flight at most; 503 past it."})
    request_timeout_s: float = field(default=600.0, metadata={"help": "Deadline of one request."})
    chat_template: str | None = field(default=None, metadata={
        "help": "Jinja chat template file overriding the checkpoint's."})
    tool_call_parser: str = field(default="hermes", metadata={"help": "Tool-call output parser by name."})
    reasoning_parser: str | None = field(default=None, metadata={
        "help": "Reasoning output parser by name (e.g. qwen3); None: no reasoning split."})

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        for name in ("keep_alive_s", "header_timeout_s", "body_timeout_s", "write_timeout_s", "drain_timeout_s",
                     "request_timeout_s"):
            _check(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _check(self.sse_ping_interval_s >= 0, "sse_ping_interval_s", "must be >= 0")
        for name in ("max_header_bytes", "max_body_bytes", "max_connections", "max_pending"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check(self.engine_mode in ENGINE_MODES, "engine_mode", f"must be thread|process, got {self.engine_mode!r}")


def _scalar_type(tp: typing.Any) -> typing.Any:
    """int | None -> int; list[str] -> str (with the list flag handled by the caller)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _scalar_type(args[0])
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0]
    return tp


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
            kwargs["action"] = "append"
            kwargs["type"] = _scalar_type(tp)
            kwargs["default"] = None
        else:
            kwargs["type"] = _scalar_type(tp)
            kwargs["default"] = f.default
        group.add_argument(flag(f.name), **kwargs)


def build_parser(prog: str = "python -m rawserve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="rawserve: an OpenAI-compatible LLM server.")
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServerConfig)
    return parser


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
