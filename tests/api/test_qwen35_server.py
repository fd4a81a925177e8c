"""A live server on a tiny random Qwen3.5 (hybrid) with the Qwen3.5 tokenizer and chat template, its core spawned
(--engine-mode process), through the openai SDK: chat with thinking on and off, a json_schema response, a streamed
chat, a repeated prompt served from the prefix cache (KV and saved states). Outputs are random text; the tests
assert structure, parsing and usage, not content."""
from __future__ import annotations

import json
import shutil

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread, wait_idle
from tests.conftest import fixture_path

openai = pytest.importorskip("openai")

MODEL = "qwen35-tiny"
EOS = 248046  # <|im_end|>
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    from tests.qwen35_checkpoints import make_qwen35_checkpoint

    tokenizer = fixture_path("qwen35-tokenizer")
    directory = make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-server"), vocab_size=248320, hidden_size=32,
                                       intermediate_size=64, dtype="bfloat16", eos_token_id=EOS, bos_token_id=None,
                                       initializer_range=0.1, max_position_embeddings=4096, mtp=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 248044]}))
    return directory


@pytest.fixture(scope="module")
def server(qwen35_dir):
    srv = ServerThread(EngineConfig(model_dir=str(qwen35_dir), device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process", api_key=[],
                                    reasoning_parser="qwen3"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "Is the sky blue? Answer briefly."}]


def test_thinking_on_puts_the_output_in_reasoning_and_off_in_content(server, client):
    on = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    message = on.choices[0].message
    # The template opens <think> in the prompt; a random model never closes it, so all of it is reasoning
    assert getattr(message, "reasoning_content", None) and not message.content
    assert on.usage.completion_tokens == 12 and on.choices[0].finish_reason == "length"
    off = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed empty <think></think> block
    wait_idle(server)


def test_json_schema_response_parses_and_fits_the_schema(server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    value = json.loads(r.choices[0].message.content)
    assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and set(value) == {"answer", "score"}
    assert r.choices[0].finish_reason == "stop"
    wait_idle(server)


def test_streamed_chat_equals_the_whole_response(server, client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    wait_idle(server)


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache(server, client):
    messages = [{"role": "system", "content": "You answer questions about the weather. " * 12}, *QUESTION]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cold = client.chat.completions.create(**kwargs)
    warm = client.chat.completions.create(**kwargs)
    assert warm.choices[0].message == cold.choices[0].message
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # A hybrid resumes from the saved state at the prompt's last full block: all but the last partial block
    assert cached == (warm.usage.prompt_tokens - 1) // 16 * 16 > 0
    wait_idle(server)


def test_responses_api_and_metrics_on_the_hybrid(server, client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0,
                                reasoning=None, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.object == "response" and r.usage.output_tokens == 6 and r.status == "incomplete"
    assert r.output_text == r.output[-1].content[0].text
    wait_idle(server)
    import urllib.request

    text = urllib.request.urlopen(server.base + "/metrics", timeout=30).read().decode()
    assert "rawserve:prefix_cache_hits_total" in text and "rawserve:generation_tokens_total" in text
