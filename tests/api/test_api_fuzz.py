"""Whatever JSON a client sends to the OpenAI endpoints, the answer is a response in OpenAI's shape
(200 or a 4xx error naming a param), and the server keeps serving."""
from __future__ import annotations

import json

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread, raw

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "sk-test"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed",
          "logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "response_format", "stream_options",
          "presence_penalty", "frequency_penalty", "min_tokens", "top_k", "min_p", "echo", "stop_token_ids",
          "chat_template_kwargs", "max_completion_tokens", "priority", "prompt_logprobs", "ignore_eos"]
MESSAGE = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server():
    from rawserve.demo_model import ensure_demo_model

    srv = ServerThread(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=128,
                                    max_model_len=256),
                       ServerConfig(port=0, served_model_name="demo", engine_mode="thread", api_key=[KEY]))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> tuple[int, bytes]:
    return raw(server, "POST", path, json.dumps(body).encode(), headers=f"authorization: Bearer {KEY}\r\n")


def check_response(code: int, payload: bytes, is_stream: bool) -> None:
    if code == 200:
        if is_stream:  # chunked SSE: events, then [DONE] last
            assert b"data: " in payload and payload.rstrip().endswith(b"data: [DONE]\n\n\r\n0"), payload[-80:]
        else:
            body = json.loads(payload)
            assert body["choices"] and body["usage"]["total_tokens"] >= 1, body
        return
    assert 400 <= code < 500, (code, payload[:300])
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_random_fields_get_200_or_an_openai_error(server, overrides, path):
    base = {"messages": [MESSAGE]} if path.endswith("chat/completions") else {"prompt": "hi"}
    body = {**base, "max_tokens": 2, **overrides}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep each example fast; validation is still exercised below 1
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4
    code, payload = post(server, path, body)
    check_response(code, payload, body.get("stream") is True)


def test_server_still_serves_after_the_fuzz_and_nothing_leaks(server):
    code, payload = post(server, "/v1/completions", {"prompt": "still alive", "max_tokens": 3})
    assert code == 200 and json.loads(payload)["usage"]["completion_tokens"] == 3
    from tests.api.test_openai_server import wait_idle

    wait_idle(server)


def test_v1_needs_the_api_key_but_health_does_not(server):
    code, payload = raw(server, "POST", "/v1/completions", b'{"prompt": "x"}')
    assert code == 401 and json.loads(payload)["error"]["code"] == "invalid_api_key"
    assert raw(server, "GET", "/health")[0] == 200
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="demo", prompt="x", max_tokens=1).usage.completion_tokens == 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
