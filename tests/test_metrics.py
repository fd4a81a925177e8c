"""rawserve.metrics: Prometheus text exposition checked with prometheus_client's own parser."""
from __future__ import annotations

import math
import threading

import pytest

from rawserve.metrics import ITL_BUCKETS, SPECS, TTFT_BUCKETS, Metrics

parser = pytest.importorskip("prometheus_client.parser")

REQUIRED = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_success_total", "prompt_tokens_total", "generation_tokens_total",
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
    "prefix_cache_hits_total", "num_preemptions_total", "requests_in_flight",
)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value, for every sample on the page."""
    out = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in parser.text_string_to_metric_families(text)}


def test_every_required_metric_is_rendered_with_prefix_type_and_model_label():
    text = Metrics("tiny-qwen").render()
    types = families(text)
    for name in REQUIRED:
        kind = SPECS[name].kind
        family = "rawserve:" + (name[:-len("_total")] if kind == "counter" else name)
        assert types.get(family) == kind, (name, types.get(family))
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels["model_name"] == "tiny-qwen"


def test_histogram_buckets_are_cumulative_and_bounds_are_inclusive():
    m = Metrics("m")
    for value in (0.003, 0.005, 0.05, 5000.0):  # 0.005 sits exactly on a bound: le means <=
        m.observe("time_to_first_token_seconds", value)
    got = samples(m.render())
    name = "rawserve:time_to_first_token_seconds"
    assert got[(name + "_bucket", (("le", "0.001"),))] == 0
    assert got[(name + "_bucket", (("le", "0.005"),))] == 2
    assert got[(name + "_bucket", (("le", "0.06"),))] == 3
    assert got[(name + "_bucket", (("le", "2560.0"),))] == 3
    assert got[(name + "_bucket", (("le", "+Inf"),))] == 4
    assert got[(name + "_count", ())] == 4
    assert got[(name + "_sum", ())] == pytest.approx(5000.058)
    bounds = [float(labels[0][1]) for (n, labels) in got if n == name + "_bucket"]
    assert sorted(bounds) == [*TTFT_BUCKETS, math.inf]


def test_observe_many_equals_one_by_one():
    one, many = Metrics("m"), Metrics("m")
    values = [0.001 * i for i in range(300)]
    for v in values:
        one.observe("inter_token_latency_seconds", v)
    many.observe_many("inter_token_latency_seconds", values)
    assert one.render() == many.render()
    assert len([b for b in ITL_BUCKETS]) + 1 == sum(
        1 for (n, _) in samples(many.render()) if n == "rawserve:inter_token_latency_seconds_bucket")


def test_finish_reason_counter_starts_at_zero_for_each_reason_and_counts_by_label():
    m = Metrics("m")
    m.inc("request_success_total", label_value="stop")
    m.inc("request_success_total", 2, label_value="length")
    got = samples(m.render())
    name = "rawserve:request_success_total"
    assert got[(name, (("finished_reason", "stop"),))] == 1
    assert got[(name, (("finished_reason", "length"),))] == 2
    assert got[(name, (("finished_reason", "abort"),))] == 0
    assert m.counter_value("request_success_total", "length") == 2


def test_core_counters_are_mirrored_and_gauges_are_overridden_per_render():
    m = Metrics("m")
    m.set_total("prefix_cache_hits_total", 128)
    m.set_total("num_preemptions_total", 3)
    m.set_gauge("num_requests_running", 5)
    got = samples(m.render({"kv_cache_usage_perc": 0.25, "requests_in_flight": 7}))
    assert got[("rawserve:prefix_cache_hits_total", ())] == 128
    assert got[("rawserve:num_preemptions_total", ())] == 3
    assert got[("rawserve:num_requests_running", ())] == 5
    assert got[("rawserve:kv_cache_usage_perc", ())] == 0.25
    assert got[("rawserve:requests_in_flight", ())] == 7
    assert got[("rawserve:num_requests_waiting", ())] == 0


def test_label_values_with_quotes_backslashes_and_newlines_round_trip():
    name = 'my "model"\\v2\nlatest'
    m = Metrics(name)
    for family in parser.text_string_to_metric_families(m.render()):
        for s in family.samples:
            assert s.labels["model_name"] == name


@pytest.mark.parametrize("call", [
    lambda m: m.inc("no_such_metric_total"),
    lambda m: m.observe("prompt_tokens_total", 1.0),  # a counter, not a histogram
    lambda m: m.inc("request_success_total"),  # missing its finished_reason label
    lambda m: m.inc("prompt_tokens_total", label_value="x"),  # takes no label
    lambda m: m.inc("prompt_tokens_total", -1),  # counters never decrease
    lambda m: m.render({"prompt_tokens_total": 1}),  # not a gauge
])
def test_misuse_raises_value_error(call):
    with pytest.raises(ValueError):
        call(Metrics("m"))


def test_concurrent_observations_are_all_counted():
    m = Metrics("m")

    def work() -> None:
        for _ in range(2000):
            m.observe("e2e_request_latency_seconds", 0.7)
            m.inc("generation_tokens_total")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.histogram_count("e2e_request_latency_seconds") == 8000
    assert m.counter_value("generation_tokens_total") == 8000


def test_token_buckets_follow_vllms_1_2_5_series_up_to_max_model_len():
    from rawserve.metrics import token_buckets

    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_engine_info_rebuckets_empty_token_histograms_and_adds_cache_config_info():
    m = Metrics("m", vllm_names=True)
    m.observe("request_generation_tokens", 7)  # already observed: its buckets stay
    m.set_engine_info(100, block_size=16, num_blocks=64)
    got = samples(m.render())
    bounds = {n: sorted(float(dict(labels)["le"]) for (name, labels) in got if name == n + "_bucket")
              for n in ("rawserve:request_prompt_tokens", "rawserve:request_generation_tokens")}
    assert bounds["rawserve:request_prompt_tokens"] == [1, 2, 5, 10, 20, 50, 100, math.inf]
    # still the default max_model_len's (8192) buckets
    assert bounds["rawserve:request_generation_tokens"] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000,
                                                            math.inf]
    assert got[("rawserve:cache_config_info", (("block_size", "16"), ("num_gpu_blocks", "64")))] == 1
    assert got[("vllm:cache_config_info", (("block_size", "16"), ("engine", "0"), ("num_gpu_blocks", "64")))] == 1
    assert got[("vllm:request_generation_tokens_sum", (("engine", "0"),))] == 7
