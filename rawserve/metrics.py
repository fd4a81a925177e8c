"""Counters, histograms and gauges rendered in Prometheus's text exposition format (0.0.4).

Standard library only. It measures nothing itself: the frontend feeds it observations, /metrics calls `render`.
Names, types and buckets are vLLM's under `rawserve:`; `vllm_names` renders them again as `vllm:`.
"""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PREFIX = "rawserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries, so dashboards built for vllm:* keep their meaning.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core per server


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... while <= max_value."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True, slots=True)
class MetricSpec:
    kind: str  # counter | gauge | histogram
    help: str
    buckets: tuple[float, ...] = ()
    label: str | None = None  # the one extra label besides model_name, if any
    label_values: tuple[str, ...] = ()  # rendered (as 0) before the first observation
    token_counts: bool = False  # buckets 1-2-5 up to max_model_len, as vLLM's build_1_2_5_buckets
    vllm: bool = True  # also rendered as vllm:<name> under compat="vllm" (vLLM has the same metric)


SPECS: dict[str, MetricSpec] = {
    "time_to_first_token_seconds": MetricSpec("histogram", "Time from arrival to the first output token.",
                                              TTFT_BUCKETS),
    "inter_token_latency_seconds": MetricSpec("histogram", "Time between output tokens of one request.",
                                              ITL_BUCKETS),
    "e2e_request_latency_seconds": MetricSpec("histogram", "Time from arrival to the last output token.",
                                              REQUEST_BUCKETS),
    "request_queue_time_seconds": MetricSpec("histogram", "Time a request waited before it was scheduled.",
                                             REQUEST_BUCKETS),
    "request_success_total": MetricSpec("counter", "Finished requests by finish reason.",
                                        label="finished_reason", label_values=FINISH_REASONS),
    "prompt_tokens_total": MetricSpec("counter", "Prefilled prompt tokens."),
    "generation_tokens_total": MetricSpec("counter", "Generated output tokens."),
    "prefix_cache_queries_total": MetricSpec("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_total": MetricSpec("counter", "Prompt tokens found in the prefix cache."),
    "num_preemptions_total": MetricSpec("counter", "Requests preempted to free KV blocks."),
    "num_requests_running": MetricSpec("gauge", "Requests in the running batch."),
    "num_requests_waiting": MetricSpec("gauge", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": MetricSpec("gauge", "Fraction of KV cache blocks in use (0 to 1)."),
    "requests_in_flight": MetricSpec("gauge", "Requests the frontend is serving.", vllm=False),
    "request_prompt_tokens": MetricSpec("histogram", "Number of prefill tokens processed, per request.",
                                        token_counts=True),
    "request_generation_tokens": MetricSpec("histogram", "Number of generation tokens processed, per request.",
                                            token_counts=True),
    "request_params_n": MetricSpec("histogram", "Histogram of the n request parameter.", N_BUCKETS),
    "request_params_max_tokens": MetricSpec("histogram", "Histogram of the max_tokens request parameter.",
                                            token_counts=True),
    "request_prefill_time_seconds": MetricSpec("histogram", "Time from first scheduling to the first token.",
                                               REQUEST_BUCKETS),
    "request_decode_time_seconds": MetricSpec("histogram", "Time from the first token to the last.",
                                              REQUEST_BUCKETS),
    "request_inference_time_seconds": MetricSpec("histogram", "Time from first scheduling to the last token.",
                                                 REQUEST_BUCKETS),
    "iteration_tokens_total": MetricSpec("histogram", "Prompt plus generated tokens per engine step.",
                                         ITERATION_TOKEN_BUCKETS),
    "kv_cache_bytes": MetricSpec("gauge", "Bytes of the KV cache pool (reserved; pages are committed as blocks are "
                                          "first used).", vllm=False),
    "kv_cache_capacity_tokens": MetricSpec("gauge", "Tokens the KV cache pool holds.", vllm=False),
    "engine_threads": MetricSpec("gauge", "The engine core's intra-op (OpenMP) threads now: fewer while other "
                                          "processes keep CPUs busy (auto on a CPU); 0 when not reported.", vllm=False),
    "spec_decode_num_drafts_total": MetricSpec("counter", "Speculative decoding: drafted rows verified (one per "
                                                          "row and step)."),
    "spec_decode_num_draft_tokens_total": MetricSpec("counter", "Speculative decoding: tokens drafted."),
    "spec_decode_num_accepted_tokens_total": MetricSpec("counter", "Speculative decoding: drafted tokens accepted."),
    "spec_decode_num_accepted_tokens_per_pos_total": MetricSpec(
        "counter", "Speculative decoding: drafted tokens accepted, by their position in the draft (0: the first).",
        label="position"),
    "pooling_requests_total": MetricSpec("counter", "Embedding and rerank requests answered, by task.",
                                         label="task", label_values=("embed", "rerank"), vllm=False),
    "pooling_inputs_total": MetricSpec("counter", "Inputs pooled (texts embedded, documents scored), by task.",
                                       label="task", label_values=("embed", "rerank"), vllm=False),
    "pooling_request_latency_seconds": MetricSpec("histogram", "Time from arrival to the answer of an embedding "
                                                               "or rerank request.", REQUEST_BUCKETS, vllm=False),
    "mm_items_received_total": MetricSpec("counter", "Media items read, decoded and placed in prompts, by modality.",
                                          label="modality", label_values=("image",), vllm=False),
    "mm_encoder_seconds_total": MetricSpec("counter", "Time the engine core spent in the vision tower (encoder "
                                                      "cache misses).", vllm=False),
    "mm_encoder_cache_hits_total": MetricSpec("counter", "Images whose encoding came from the encoder cache.",
                                              vllm=False),
    "mm_encoder_cache_misses_total": MetricSpec("counter", "Images the vision tower encoded.", vllm=False),
}
CACHE_CONFIG_INFO = "cache_config_info"  # a gauge fixed at 1, its value in labels (vLLM's Info emulation)


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    """One server's metrics. Thread-safe: the frontend observes on the event loop, /metrics may render
    from anywhere."""

    def __init__(self, model_name: str, prefix: str = PREFIX, vllm_names: bool = False,
                 max_model_len: int = 8192) -> None:
        """`vllm_names` (--metrics-compat vllm): every metric vLLM also has is rendered a second time as
        vllm:<name>, with vLLM's labels (model_name, engine). `max_model_len` sizes the token-count buckets
        until the engine reports its own (`set_engine_info`)."""
        self.model_name = model_name
        self.prefix = prefix
        self.vllm_names = vllm_names
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str | None], float] = {}
        self._gauges: dict[str, float] = {}
        self._cache_info: dict[str, str] | None = None
        self._buckets: dict[str, tuple[float, ...]] = {}
        # name -> (per-bucket counts with a final +Inf slot, [sum, count])
        self._histograms: dict[str, tuple[list[int], list[float]]] = {}
        for name, spec in SPECS.items():
            if spec.kind == "counter":
                # a labelled counter without fixed values (a draft position) appears with its first value
                for label_value in spec.label_values or ((None,) if spec.label is None else ()):
                    self._counters[(name, label_value)] = 0.0
            elif spec.kind == "histogram":
                self._reset_histogram(name, token_buckets(max_model_len) if spec.token_counts else spec.buckets)

    def _reset_histogram(self, name: str, buckets: tuple[float, ...]) -> None:
        self._buckets[name] = buckets
        self._histograms[name] = ([0] * (len(buckets) + 1), [0.0, 0])

    def set_engine_info(self, max_model_len: int, block_size: int | None, num_blocks: int | None) -> None:
        """What the engine reports when ready: token-count buckets up to its max_model_len (as vLLM sizes them;
        re-bucketed only while still empty) and the cache_config_info labels."""
        with self._lock:
            for name, spec in SPECS.items():
                if spec.token_counts and self._histograms[name][1][1] == 0:
                    self._reset_histogram(name, token_buckets(max_model_len))
            if block_size is not None and num_blocks is not None:
                self._cache_info = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks)}

    @staticmethod
    def _spec(name: str, kind: str) -> MetricSpec:
        spec = SPECS.get(name)
        if spec is None:
            raise ValueError(f"unknown metric {name!r}")
        if spec.kind != kind:
            raise ValueError(f"metric {name!r} is a {spec.kind}, not a {kind}")
        return spec

    def _counter_key(self, name: str, label_value: str | None) -> tuple[str, str | None]:
        spec = self._spec(name, "counter")
        if (spec.label is None) != (label_value is None):
            raise ValueError(f"metric {name!r} takes label {spec.label!r}" if spec.label
                             else f"metric {name!r} takes no label")
        return name, label_value

    def inc(self, name: str, value: float = 1.0, label_value: str | None = None) -> None:
        """Add to a counter. `label_value` fills the counter's one label (finished_reason)."""
        if value < 0:
            raise ValueError(f"counter {name!r} cannot decrease (got {value})")
        key = self._counter_key(name, label_value)
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value

    def set_total(self, name: str, value: float, label_value: str | None = None) -> None:
        """Mirror a counter the engine core keeps itself (prefix cache, preemptions): set its total."""
        key = self._counter_key(name, label_value)
        with self._lock:
            self._counters[key] = float(value)

    def set_gauge(self, name: str, value: float) -> None:
        self._spec(name, "gauge")
        with self._lock:
            self._gauges[name] = float(value)

    def observe(self, name: str, value: float) -> None:
        self.observe_many(name, (value,))

    def observe_many(self, name: str, values: Iterable[float]) -> None:
        """Several observations under one lock: the frontend records a whole step's latencies at once."""
        self._spec(name, "histogram")
        with self._lock:
            buckets = self._buckets[name]
            counts, total = self._histograms[name]
            for value in values:
                # bisect_left: a value equal to a bound belongs in that bound's bucket (le = less or equal)
                counts[bisect.bisect_left(buckets, value)] += 1
                total[0] += value
                total[1] += 1

    def counter_value(self, name: str, label_value: str | None = None) -> float:
        key = self._counter_key(name, label_value)
        with self._lock:
            return self._counters.get(key, 0.0)

    def histogram_count(self, name: str) -> int:
        self._spec(name, "histogram")
        with self._lock:
            return int(self._histograms[name][1][1])

    def render_lora_info(self, max_lora: int, running: Iterable[str], waiting: Iterable[str],
                         timestamp: float) -> str:
        """vLLM's lora_requests_info gauge: the adapters with running and with waiting requests as labels
        (comma-separated), the value the time of this reading, as routers that balance by adapter read it."""
        labels = (f'max_lora="{max_lora}",running_lora_adapters="{_label_value(",".join(running))}",'
                  f'waiting_lora_adapters="{_label_value(",".join(waiting))}"')
        return "".join(f"# HELP {prefix}lora_requests_info Running stats on lora requests.\n"
                       f"# TYPE {prefix}lora_requests_info gauge\n"
                       f"{prefix}lora_requests_info{{{labels}}} {_number(timestamp)}\n"
                       for prefix in self._prefixes())

    def _prefixes(self) -> tuple[str, ...]:
        return (self.prefix, "vllm:") if self.vllm_names else (self.prefix,)

    def render(self, gauges: Mapping[str, float] | None = None) -> str:
        """The /metrics page. `gauges` overrides stored gauge values for this rendering."""
        for name in gauges or {}:
            self._spec(name, "gauge")
        model = f'model_name="{_label_value(self.model_name)}"'
        lines: list[str] = []
        with self._lock:
            gauge_values = {**self._gauges, **(gauges or {})}
            self._render(lines, self.prefix, model, gauge_values, vllm_only=False)
            if self.vllm_names:
                self._render(lines, "vllm:", f'{model},engine="{ENGINE_INDEX}"', gauge_values, vllm_only=True)
        return "\n".join(lines) + "\n"

    def _render(self, lines: list[str], prefix: str, base: str, gauge_values: Mapping[str, float],
                vllm_only: bool) -> None:
        """One namespace: `base` is its labels on every sample (model_name, and vLLM's engine)."""
        for name, spec in SPECS.items():
            if vllm_only and not spec.vllm:
                continue
            full = prefix + name
            lines.append(f"# HELP {full} {spec.help}")
            lines.append(f"# TYPE {full} {spec.kind}")
            if spec.kind == "counter":
                rows = sorted((lv, v) for (n, lv), v in self._counters.items() if n == name)
                for label_value, value in rows:
                    labels = base if label_value is None else f'{base},{spec.label}="{_label_value(label_value)}"'
                    lines.append(f"{full}{{{labels}}} {_number(value)}")
            elif spec.kind == "gauge":
                lines.append(f"{full}{{{base}}} {_number(gauge_values.get(name, 0.0))}")
            else:
                counts, (total, count) = self._histograms[name]
                running = 0
                for bound, bucket_count in zip((*self._buckets[name], math.inf), counts):
                    running += bucket_count
                    le = "+Inf" if math.isinf(bound) else repr(float(bound))  # "1.0", as client libraries write it
                    lines.append(f'{full}_bucket{{{base},le="{le}"}} {running}')
                lines.append(f"{full}_sum{{{base}}} {_number(total)}")
                lines.append(f"{full}_count{{{base}}} {_number(count)}")
        if self._cache_info is not None:
            # vLLM's labels are the cache config's fields and engine, without model_name; rawserve's keep model_name
            info = ",".join(f'{k}="{v}"' for k, v in self._cache_info.items())
            labels = f'{info},engine="{ENGINE_INDEX}"' if vllm_only else f"{base},{info}"
            full = prefix + CACHE_CONFIG_INFO
            lines.append(f"# HELP {full} Information of the engine's KV cache configuration.")
            lines.append(f"# TYPE {full} gauge")
            lines.append(f"{full}{{{labels}}} 1")
