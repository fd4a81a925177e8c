"""Per-key token buckets and tenant isolation through a live server with keys from --api-key-file: a burst gets
OpenAI's 429 with a Retry-After that works, other keys are unaffected, x-ratelimit-* headers on every response,
unused max_tokens refunded, oversize requests refused with a 400, and no prefix-cache hit across keys."""
from __future__ import annotations

import json
import re
import time

import pytest

from rawserve.api.rate_limit import TokenBucket, duration
from tests.api.demo_server import exchange, serve_demo
from tests.api.test_openai_server import wait_idle

PROMPT = "The dragon slept on a hill of gold. " * 20  # a few hundred tokens: each request costs mostly prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# tenants\nalpha:6000\nbeta:6000\n\ntiny:100\ndelta:3000\n")
    yield from serve_demo(dict(num_kv_blocks=300, max_model_len=4096),
                          dict(api_key=["gamma"], api_key_file=str(keys)))


def call(server, key: str, body: dict, path: str = "/v1/completions", headers: str = "") -> tuple[int, dict, bytes]:
    """-> (status, response headers, body) of one request with `key`."""
    return exchange(server, path, {"prompt": PROMPT, "max_tokens": 1, **body},
                    f"authorization: Bearer {key}\r\n{headers}")


def test_a_burst_gets_429_with_a_retry_after_that_is_honoured_and_other_keys_are_unaffected(server):
    for sent in range(1, 80):
        code, head, body = call(server, "alpha", {})
        if code != 200:
            break
        assert head["x-ratelimit-limit-tokens"] == "6000"
        cost = json.loads(body)["usage"]["prompt_tokens"] + 1  # the prompt, and max_tokens 1
    assert code == 429 and sent - 1 >= 6000 // cost, (sent, body)
    error = json.loads(body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"] and "param" in error
    retry_after = int(head["retry-after"])  # 100 tokens a second come back
    assert 1 <= retry_after <= cost // 100 + 1 and int(head["x-ratelimit-remaining-tokens"]) < cost
    assert re.fullmatch(r"\d+ms|\d+s|\d+m\d+s", head["x-ratelimit-reset-tokens"])
    # A stream is refused before any byte of it: a 429, not a 200 with an error event.
    code, head, _ = call(server, "alpha", {"stream": True, "max_tokens": 2000})  # 20 s of refill away
    assert code == 429 and head["content-type"] == "application/json"
    code, head, _ = call(server, "beta", {})  # another tenant: its own bucket
    assert code == 200 and int(head["x-ratelimit-remaining-tokens"]) >= 6000 - cost
    code, head, _ = call(server, "gamma", {})  # a key without a limit carries no x-ratelimit headers
    assert code == 200 and "x-ratelimit-limit-tokens" not in head
    time.sleep(retry_after)
    code, head, body = call(server, "alpha", {})
    assert code == 200, body
    wait_idle(server)


def test_a_request_larger_than_the_bucket_is_a_400_not_a_429_that_never_clears(server):
    code, head, body = call(server, "tiny", {"prompt": "hi", "max_tokens": 200})
    error = json.loads(body)["error"]
    assert code == 400 and error["code"] == "request_too_large" and error["param"] == "max_tokens"
    assert head["x-should-retry"] == "false" and head["x-ratelimit-limit-tokens"] == "100"
    code, head, _ = call(server, "tiny", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                         path="/v1/chat/completions")
    assert code == 200 and int(head["x-ratelimit-remaining-tokens"]) < 100


def test_unused_max_tokens_are_refunded_when_the_request_ends(server):
    # 3000 tokens a minute; each request reserves 2000 of max_tokens. Without a refund the second would find
    # under 1,100 tokens; cut short by its deadline, the first gives back what it did not generate, so it fits.
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    code, head, payload = call(server, "delta", body, headers="x-request-timeout: 0.3\r\n")
    usage = json.loads(payload)["usage"]
    generated = usage["completion_tokens"]
    assert code == 200 and generated < 900
    # A whole response's headers go out after the refund: what it did not generate is back.
    assert int(head["x-ratelimit-remaining-tokens"]) >= 3000 - usage["prompt_tokens"] - generated
    code, head, payload = call(server, "delta", body, headers="x-request-timeout: 0.3\r\n")
    assert code == 200, payload
    wait_idle(server)


def test_no_prefix_cache_hit_crosses_api_keys(server):
    def counter(name: str) -> float:
        text = server.app.llm.render_metrics()
        return float(re.search(rf"rawserve:{name}\{{[^}}]*\}} (\S+)", text).group(1))

    prompt = "A secret plan, known to one tenant only, spans several KV blocks of sixteen tokens. " * 3
    cached = []
    for key in ("gamma", "gamma", "beta"):
        cached.append(json.loads(call(server, key, {"prompt": prompt})[2])["usage"]["prompt_tokens_details"][
            "cached_tokens"])
        wait_idle(server)
    assert cached[1] >= 16 and cached[2] == 0  # the cache works within a key, never across
    queries, hits = counter("prefix_cache_queries_total"), counter("prefix_cache_hits_total")
    code, _, payload = call(server, "beta", {"prompt": prompt, "cache_salt": "x"})  # own salt: still beta's alone
    assert code == 200 and json.loads(payload)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    deadline = time.monotonic() + 10
    while counter("prefix_cache_queries_total") == queries and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter("prefix_cache_queries_total") > queries and counter("prefix_cache_hits_total") == hits


def test_bucket_refills_continuously_and_reports_openai_durations():
    now = [0.0]
    bucket = TokenBucket(600, clock=lambda: now[0])  # 10 tokens a second
    assert bucket.take(600) == 0 and bucket.take(20) == pytest.approx(2.0)
    now[0] = 1.5
    assert bucket.take(15) == 0 and bucket.tokens == pytest.approx(0)
    bucket.refund(30)
    assert dict(bucket.headers())[b"x-ratelimit-remaining-tokens"] == b"30"
    assert [duration(s) for s in (0.02, 1, 59.2, 360)] == ["20ms", "1s", "1m0s", "6m0s"]


def test_api_key_file_lines_give_keys_and_their_limits(tmp_path):
    from rawserve.config import ServerConfig

    path = tmp_path / "keys"
    path.write_text("# comment\n\nplain\nwith:limit:500\nsk-a:b\n")
    config = ServerConfig(api_key=["flag"], api_key_file=str(path), rate_limit_tpm=1000)
    assert config.api_keys() == {"flag": 1000, "plain": 1000, "with:limit": 500, "sk-a:b": 1000}
    path.write_text("zero:0\n")
    with pytest.raises(ValueError, match="--api-key-file: line 1: tpm must be >= 1"):
        ServerConfig(api_key_file=str(path)).api_keys()
    with pytest.raises(ValueError, match="--rate-limit-tpm: must be >= 1"):
        ServerConfig(rate_limit_tpm=0)
