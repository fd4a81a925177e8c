"""Reasoning through the whole server, forced by a grammar (random weights never think on their own): with
--reasoning-parser, the <think> block becomes chat's reasoning_content and a Responses reasoning item, streamed
and not, and the answer after it stays constrained."""
from __future__ import annotations

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread

openai = pytest.importorskip("openai")

MODEL = "demo-reasoning"
GRAMMAR = 'root ::= <think> "first plan, then answer" </think> "\\n\\n" ("yes" | "no")'
MESSAGES = [{"role": "user", "content": "Is it sunny?"}]


@pytest.fixture(scope="module")
def client():
    from rawserve.demo_model import ensure_demo_model

    srv = ServerThread(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=128,
                                    max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[],
                                    reasoning_parser="qwen3"))
    yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def test_chat_splits_the_forced_think_block_into_reasoning_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                           extra_body={"guided_grammar": GRAMMAR})
    message = reply.choices[0].message
    assert message.reasoning_content == "first plan, then answer"
    assert message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, stream=True,
                                            extra_body={"guided_grammar": GRAMMAR})
    chunks = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == "first plan, then answer"
    assert "".join(d.content or "" for d in chunks) in ("yes", "no")


def test_responses_output_a_reasoning_item_before_the_message(client):
    response = client.responses.create(model=MODEL, input="Is it sunny?", max_output_tokens=40,
                                       extra_body={"guided_grammar": GRAMMAR})
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.status == "completed"
    assert response.output[0].summary[0].text == "first plan, then answer"
    assert response.output_text in ("yes", "no")
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model=MODEL, input="Is it sunny?", max_output_tokens=40,
                                 extra_body={"guided_grammar": GRAMMAR}) as stream:
        events = [event.type for event in stream]
    assert "response.reasoning_summary_text.delta" in events
    assert events.index("response.reasoning_summary_text.done") < events.index("response.output_text.delta")
    assert events[-1] == "response.completed"
