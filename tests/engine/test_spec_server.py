"""Speculative decoding through a live server whose core is spawned (--engine-mode process) with
--speculative-config (a draft model): the same completions, logprobs, stop strings and usage as a plain server;
vLLM's spec_decode metrics; the stats line's speculative part; the frontend's cut at a stop string in a run."""
from __future__ import annotations

import json
import urllib.request

import pytest

from rawserve.api.status_log import StatsLogger
from rawserve.config import EngineConfig, ServerConfig
from rawserve.engine.types import EngineStats
from rawserve.metrics import Metrics
from tests.api.test_openai_server import ServerThread, wait_idle

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def servers():
    from rawserve.demo_model import ensure_demo_model

    demo = str(ensure_demo_model())
    common = dict(model_dir=demo, device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=1024)
    plain = ServerThread(EngineConfig(**common), ServerConfig(port=0, served_model_name="m", api_key=[]))
    # The checkpoint as its own draft model: greedy rows accept every draft, so outputs come 5 tokens at a time
    # and a stop string lands inside a verified run
    spec_config = json.dumps({"model": demo, "num_speculative_tokens": 4, "min_acceptance": 0})
    spec = ServerThread(EngineConfig(**common, speculative_config=spec_config),
                        ServerConfig(port=0, served_model_name="m", api_key=[], engine_mode="process",
                                     metrics_compat="vllm"))
    yield plain, spec
    plain.stop()
    spec.stop()


def complete(server, **body) -> dict:
    body = {"model": "m", "prompt": PROMPT, "temperature": 0, "max_tokens": 48, **body}
    request = urllib.request.Request(server.base + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_spawned_core_with_drafts_answers_as_the_plain_server(servers):
    plain, spec = servers
    a, b = complete(plain), complete(spec)
    assert b["choices"][0]["text"] == a["choices"][0]["text"] and b["usage"] == a["usage"]
    # A stop string completed by the 4th token: the first comes alone from the prompt's step, the next five from
    # one verified run, so it ends inside that run; both servers end there, with the same token count
    with_logprobs = complete(plain, logprobs=1)["choices"][0]["logprobs"]
    spec_logprobs = complete(spec, logprobs=1)["choices"][0]["logprobs"]  # the target's, for accepted drafts
    tokens = with_logprobs["tokens"]
    assert spec_logprobs["tokens"] == tokens
    assert spec_logprobs["token_logprobs"] == pytest.approx(with_logprobs["token_logprobs"], abs=1e-4)
    stop = "".join(tokens[:4])
    a, b = complete(plain, stop=[stop]), complete(spec, stop=[stop])
    assert a["choices"][0]["finish_reason"] == "stop" and a["usage"]["completion_tokens"] == 4
    assert b["choices"][0] == a["choices"][0] and b["usage"] == a["usage"]
    # n > 1, seeded sampling: each sample is its own request, drawing the same tokens with or without drafts
    a = complete(plain, n=3, temperature=0.8, top_p=0.9, seed=11, max_tokens=32)
    b = complete(spec, n=3, temperature=0.8, top_p=0.9, seed=11, max_tokens=32)
    assert [c["text"] for c in b["choices"]] == [c["text"] for c in a["choices"]] and b["usage"] == a["usage"]
    wait_idle(spec)
    wait_idle(plain)
    with urllib.request.urlopen(spec.base + "/metrics", timeout=30) as response:
        page = response.read().decode()
    with urllib.request.urlopen(plain.base + "/metrics", timeout=30) as response:
        plain_page = response.read().decode()
    # the same requests generated as many tokens (none counted past the stop string inside a verified run)
    generated = [next(line for line in p.splitlines() if line.startswith("rawserve:generation_tokens_total"))
                 for p in (page, plain_page)]
    assert generated[0] == generated[1]
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
              if line.startswith("vllm:spec_decode") and 'position="0"' not in line}
    assert counts["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < counts["vllm:spec_decode_num_accepted_tokens_total"] <= counts["vllm:spec_decode_num_draft_tokens_total"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",engine="0",position="0"}' in page


class FakeLLM:
    def __init__(self) -> None:
        self.metrics = Metrics("m")
        self.core_stats = EngineStats()


def test_the_stats_line_gives_acceptance_and_why_drafting_is_off():
    llm, now = FakeLLM(), [0.0]
    logger = StatsLogger(llm, 10.0, lambda: now[0])
    llm.metrics.inc("generation_tokens_total", 300)
    for name, value in (("num_drafts", 100), ("num_draft_tokens", 300), ("num_accepted_tokens", 150)):
        llm.metrics.set_total(f"spec_decode_{name}_total", value)
    llm.core_stats = EngineStats(num_running=20, extra={"spec": {
        "off_reason": "off: 20 rows decode (disable_by_batch_size 16)", "num_paused_rows": 2}})
    now[0] = 10.0
    line = logger.tick()
    assert line.endswith(", Spec decode: mean acceptance length 2.50, accepted 150/300 draft tokens, off: 20 rows "
                         "decode (disable_by_batch_size 16), paused for low acceptance: 2 rows")


def test_a_stop_string_inside_a_multi_token_output_cuts_the_tokens_after_it():
    """A verified run arrives as one output of several tokens: the frontend ends it at the token whose text
    completes the stop string, as token-by-token outputs would end, and drops (and does not count) the rest."""
    from rawserve.demo_model import ensure_demo_model
    from rawserve.engine.frontend.output_processor import OutputProcessor
    from rawserve.engine.types import RequestOutput, SamplingParams
    from rawserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ensure_demo_model())
    words = [tok.encode(w) for w in (" alpha", " beta", " gamma", " delta", " omega")]
    ids = [t for w in words for t in w]
    stop_at = len(words[0]) + len(words[1]) + len(words[2])  # " gamma" ends there
    params = SamplingParams(max_tokens=50, stop=["gamma"])
    logprobs = [(t, -1.0, 1, ()) for t in ids]
    whole = OutputProcessor("r", tok, params).process(RequestOutput(
        "r", ids, logprobs=logprobs, num_prompt_tokens=3, num_output_tokens=len(ids)))
    out, abort = whole
    assert abort and out.finished and out.finish_reason == "stop" and out.stop_reason == "gamma"
    assert out.new_token_ids == ids[:stop_at] and out.num_output_tokens == stop_at and len(out.logprobs) == stop_at
    assert out.text == " alpha beta "
    # The same tokens one output each end at the same token, with the same text
    one = OutputProcessor("r", tok, params)
    texts, kept = [], []
    for i, t in enumerate(ids):
        piece, abort = one.process(RequestOutput("r", [t], num_output_tokens=i + 1))
        texts.append(piece.text)
        kept.append(t)
        if piece.finished:
            break
    assert kept == out.new_token_ids and "".join(texts) == out.text
