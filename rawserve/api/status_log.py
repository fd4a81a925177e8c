"""The server's own log lines besides the access log: the one startup summary, and a stats line every
10 s while busy (throughput, running and waiting requests, KV usage, prefix-cache hit rate), as vLLM prints.

Reads what exists (the checkpoint's files, the core's READY payload, the metrics counters); measures nothing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import struct
import time
from typing import Any

from rawserve.config import EngineConfig, ServerConfig

log = logging.getLogger("rawserve")

STATS_INTERVAL_S = 10.0


def checkpoint_facts(model_dir: str | pathlib.Path, count_params: bool = True) -> tuple[str, int | None]:
    """(architecture, parameter count) read from config.json and the safetensors headers: no torch, no
    weights read. The count is None when a header cannot be read (the core will have said why), or when
    not `count_params` (the headers are not opened at all)."""
    root = pathlib.Path(model_dir)
    try:
        config = json.loads((root / "config.json").read_text())
        architecture = ",".join(config.get("architectures") or []) or str(config.get("model_type", "?"))
    except (OSError, ValueError, AttributeError):
        architecture = "?"
    if not count_params:
        return architecture, None
    total = 0
    try:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            return architecture, None
        for file in files:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in entry["shape"]:
                        count *= int(dim)
                    total += count
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return architecture, None
    return architecture, total


def format_count(n: int | None) -> str:
    if n is None:
        return "?"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def startup_summary(engine_config: EngineConfig, server_config: ServerConfig, model_name: str,
                    info: dict[str, Any], port: int) -> str:
    """The one line an operator reads to know what is being served, where and how."""
    model_dir = engine_config.model_dir or "?"
    # The core's READY info counts the parameters already; reading every safetensors header again would run on
    # the event loop after the server listens, so only a core that did not count has them read here.
    architecture, num_params = checkpoint_facts(model_dir, count_params="num_params" not in info)
    num_params = info.get("num_params", num_params)
    num_blocks = info.get("num_blocks")
    block_size = info.get("block_size", engine_config.block_size)
    kv = f"{num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}" if num_blocks else "?"
    if num_blocks:
        kv_bytes = info.get("kv_cache_bytes")
        kv += (f", {kv_bytes / (1 << 20):.1f} MiB" if isinstance(kv_bytes, int) else "")
        kv += (f", {info['kv_cache_dtype']}" if info.get("kv_cache_dtype") else "") + ")"
        if info.get("kv_cache_reason"):
            kv += f" [{info['kv_cache_reason']}]"
    threads = ""
    if isinstance(info.get("num_threads"), int):
        threads = f", {info['num_threads']} engine threads [{info.get('threads_reason', '?')}]"
    host = server_config.host
    url = f"{server_config.scheme}://{'[' + host + ']' if ':' in host else host}:{port}/v1"
    lora = ""
    if engine_config.lora_enabled:
        names = ", ".join(info.get("loras") or {}) or "none yet"
        lora = (f", LoRA adapters: {names} ({engine_config.max_loras} resident at once, rank <= "
                f"{engine_config.max_lora_rank})")
    quant = f", quantization {info.get('quantization', engine_config.quantization)}" \
        if engine_config.quantization != "none" else ""
    return (f"serving {model_name!r} from {model_dir}: {architecture}, {format_count(num_params)} parameters, "
            f"dtype {info.get('dtype', engine_config.dtype)}{quant}, device {info.get('device', engine_config.device)}{threads}, "
            f"max_model_len {info.get('max_model_len', '?')}, KV cache {kv}{lora}, engine in a "
            f"{server_config.engine_mode}, listening on {url}, API key {'on' if server_config.api_key or server_config.api_key_file else 'off'}")


class StatsLogger:
    """Logs a stats line every `interval_s` while the server is busy; quiet when idle.

    `tick(now)` does one interval's work, so tests drive it with their own clock; `run()` is the loop.
    """

    def __init__(self, llm: Any, interval_s: float = STATS_INTERVAL_S, clock=time.monotonic) -> None:
        self.llm = llm
        self.interval_s = interval_s
        self._clock = clock
        self._last = (clock(), *self._counters())
        self._spec_last = self._spec_counters()

    def _spec_counters(self) -> tuple[float, float, float]:
        m = self.llm.metrics
        return (m.counter_value("spec_decode_num_drafts_total"), m.counter_value("spec_decode_num_draft_tokens_total"),
                m.counter_value("spec_decode_num_accepted_tokens_total"))

    def _spec_part(self, stats: Any) -> str:
        """Speculative decoding over the interval, as vLLM's SpecDecoding line: mean acceptance length (tokens a
        verified row emits per step), accepted over drafted tokens, and where drafting is off and why."""
        spec = stats.extra.get("spec")
        if spec is None:
            return ""
        (drafts0, tokens0, accepted0), counters = self._spec_last, self._spec_counters()
        self._spec_last = counters
        drafts, tokens, accepted = (now - then for now, then in zip(counters, (drafts0, tokens0, accepted0)))
        part = (f", Spec decode: mean acceptance length {1 + accepted / drafts if drafts else 0:.2f}, "
                f"accepted {accepted:.0f}/{tokens:.0f} draft tokens")
        if spec["off_reason"]:
            part += f", {spec['off_reason']}"
        if spec["num_paused_rows"]:
            part += f", paused for low acceptance: {spec['num_paused_rows']} rows"
        return part

    def _counters(self) -> tuple[float, float, float, float]:
        m = self.llm.metrics
        return (m.counter_value("prompt_tokens_total"), m.counter_value("generation_tokens_total"),
                m.counter_value("prefix_cache_queries_total"), m.counter_value("prefix_cache_hits_total"))

    def tick(self, now: float | None = None) -> str | None:
        """The line for the interval that ends now, logged, or None (and nothing logged) when idle."""
        now = self._clock() if now is None else now
        then, prompt0, gen0, queries0, hits0 = self._last
        prompt, gen, queries, hits = counters = self._counters()
        self._last = (now, *counters)
        stats = self.llm.core_stats
        if prompt == prompt0 and gen == gen0 and not stats.num_running and not stats.num_waiting:
            return None
        elapsed = max(now - then, 1e-9)
        window = queries - queries0
        hit_rate = (hits - hits0) / window if window > 0 else 0.0
        line = (f"Avg prompt throughput: {(prompt - prompt0) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(gen - gen0) / elapsed:.1f} tokens/s, "
                f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
                f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%"
                f"{self._spec_part(stats)}")
        log.info("%s", line)
        return line

    async def run(self) -> None:
        """Tick every interval until cancelled (OpenAIServer owns the task)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()
