"""--metrics-compat vllm: both namespaces parsed with prometheus_client, against vLLM's own metric table.

The table below is written from vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py) and its metrics design
doc: name, type, label names and bucket bounds. A real spawned server serves one n=2 completion first, so the
per-request histograms hold values that are checked too.
"""
from __future__ import annotations

import pytest

from bench.spawn import Replica

parser = pytest.importorskip("prometheus_client.parser")

MAX_MODEL_LEN = 512
LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TOKENS_512 = (1, 2, 5, 10, 20, 50, 100, 200, 500)  # vLLM's build_1_2_5_buckets(max_model_len=512)
ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# vLLM name (parser family: counters without _total) -> (type, extra labels besides model_name/engine, buckets)
VLLM = {
    "num_requests_running": ("gauge", (), None),
    "num_requests_waiting": ("gauge", (), None),
    "kv_cache_usage_perc": ("gauge", (), None),
    "prefix_cache_queries": ("counter", (), None),
    "prefix_cache_hits": ("counter", (), None),
    "num_preemptions": ("counter", (), None),
    "prompt_tokens": ("counter", (), None),
    "generation_tokens": ("counter", (), None),
    "request_success": ("counter", ("finished_reason",), None),
    "request_prompt_tokens": ("histogram", (), TOKENS_512),
    "request_generation_tokens": ("histogram", (), TOKENS_512),
    "request_params_n": ("histogram", (), (1, 2, 5, 10, 20)),
    "request_params_max_tokens": ("histogram", (), TOKENS_512),
    "iteration_tokens_total": ("histogram", (), ITERATION),
    "time_to_first_token_seconds": ("histogram", (), TTFT),
    "inter_token_latency_seconds": ("histogram", (), ITL),
    "e2e_request_latency_seconds": ("histogram", (), LATENCY),
    "request_queue_time_seconds": ("histogram", (), LATENCY),
    "request_inference_time_seconds": ("histogram", (), LATENCY),
    "request_prefill_time_seconds": ("histogram", (), LATENCY),
    "request_decode_time_seconds": ("histogram", (), LATENCY),
    "spec_decode_num_drafts": ("counter", (), None),
    "spec_decode_num_draft_tokens": ("counter", (), None),
    "spec_decode_num_accepted_tokens": ("counter", (), None),
    "spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",), None),
}
# vLLM's cache_config_info carries every CacheConfig field; rawserve renders the two a router reads, and engine.
CACHE_INFO_LABELS = {"block_size", "num_gpu_blocks"}


@pytest.fixture(scope="module")
def page() -> str:
    with Replica(["--metrics-compat", "vllm", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
                  "--served-model-name", "demo"]) as server:
        status, _, body = server.request("POST", "/v1/completions", {
            "model": "demo", "prompt": "Once upon a time", "max_tokens": 5, "n": 2, "ignore_eos": True})
        assert status == 200, body
        yield server.metrics()


def families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def labels_of(family) -> set[str]:
    names = set()
    for s in family.samples:
        names |= set(s.labels) - {"le"}
    return names


def buckets_of(family) -> tuple[float, ...]:
    return tuple(float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket"))[:-1]


def value(family, suffix: str = "", **labels) -> float:
    for s in family.samples:
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((family.name, suffix, labels))


@pytest.mark.parametrize("prefix,base", [("vllm:", {"model_name", "engine"}), ("rawserve:", {"model_name"})])
def test_every_vllm_metric_has_vllms_name_type_labels_and_buckets(page, prefix, base):
    got = families(page)
    for name, (kind, extra, buckets) in VLLM.items():
        family = got.get(prefix + name)
        assert family is not None, f"{prefix}{name} missing"
        assert family.type == kind, (name, family.type)
        # a counter by draft position has samples only once a speculative server has verified drafts
        assert labels_of(family) == base | set(extra) or (name.endswith("_per_pos") and not family.samples), \
            (name, labels_of(family))
        if buckets is not None:
            assert buckets_of(family) == tuple(float(b) for b in buckets), name
        for s in family.samples:
            assert s.labels["model_name"] == "demo"
            if "engine" in base:
                assert s.labels["engine"] == "0"
    info = got[prefix + "cache_config_info"]
    assert info.type == "gauge"
    want = CACHE_INFO_LABELS | ({"engine"} if prefix == "vllm:" else {"model_name"})
    assert labels_of(info) == want
    assert value(info, block_size="16", num_gpu_blocks="64") == 1


def test_per_request_histograms_count_the_completion_and_both_namespaces_agree(page):
    got = families(page)
    for prefix in ("vllm:", "rawserve:"):
        def fam(name):
            return got[prefix + name]
        assert value(fam("request_params_n"), "_count") == 1 and value(fam("request_params_n"), "_sum") == 2
        assert value(fam("request_generation_tokens"), "_count") == 2
        assert value(fam("request_generation_tokens"), "_sum") == 10
        assert value(fam("request_params_max_tokens"), "_sum") == 10
        prompt = value(fam("prompt_tokens"), "_total")
        assert value(fam("request_prompt_tokens"), "_sum") == prompt > 0
        # every step's tokens add up to the token counters
        assert value(fam("iteration_tokens_total"), "_sum") == prompt + value(fam("generation_tokens"), "_total")
        for phase in ("prefill", "decode", "inference"):
            assert value(fam(f"request_{phase}_time_seconds"), "_count") == 2
        assert value(fam("request_success"), "_total", finished_reason="length") == 2
    rawserve_only = {n for n in got if n.startswith("rawserve:")} - {"rawserve:" + n for n in VLLM}
    # rawserve's own memory families (the KV pool; the core process's RSS and CPU when it runs apart)
    memory = {"rawserve:kv_cache_bytes", "rawserve:kv_cache_capacity_tokens"}
    core = {"rawserve:engine_core_resident_memory_bytes", "rawserve:engine_core_cpu_seconds",
            "rawserve:engine_threads"}
    # embeddings and rerank, which vLLM counts under no name of its own
    pooling = {"rawserve:pooling_requests", "rawserve:pooling_inputs", "rawserve:pooling_request_latency_seconds"}
    media = {"rawserve:mm_items_received", "rawserve:mm_encoder_seconds", "rawserve:mm_encoder_cache_hits",
             "rawserve:mm_encoder_cache_misses"}  # images read and encoded, which vLLM does not count
    assert memory <= rawserve_only and rawserve_only - memory - core - pooling - media == {
        "rawserve:requests_in_flight", "rawserve:cache_config_info"}
    vllm_samples = {(s.name[len("vllm:"):], tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine")),
                     s.value) for f in got.values() if f.name.startswith("vllm:") for s in f.samples}
    rawserve_samples = {(s.name[len("rawserve:"):], tuple(sorted(s.labels.items())), s.value)
                        for f in got.values() if f.name.startswith("rawserve:") and f.name not in rawserve_only
                        for s in f.samples}
    assert rawserve_samples <= vllm_samples


def test_without_the_flag_there_is_no_vllm_namespace():
    from rawserve.metrics import Metrics

    text = Metrics("m").render()
    assert not any(f.name.startswith("vllm:") for f in parser.text_string_to_metric_families(text))
