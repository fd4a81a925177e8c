"""Message roles through a live server, with the demo template and two real ones: developer renders as system
where the template does not know it, function messages render as tool results, content as a list of text parts
renders as the string, and any other role reaches the template, which decides."""
from __future__ import annotations

import json

import pytest

from rawserve.text.chat_template import render_chat
from tests.api.demo_server import serve_demo
from tests.api.test_openai_server import raw
from tests.conftest import fixture_path

TEMPLATES = [None, "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja"]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module", params=TEMPLATES, ids=["demo", "qwen3", "llama3.1"])
def server(request):
    options = {} if request.param is None else {"chat_template": str(fixture_path("chat_templates", request.param))}
    yield from serve_demo(dict(num_kv_blocks=32, max_model_len=512), options)


def rendered(server, messages: list[dict]) -> tuple[int, str]:
    """The prompt the server renders for `messages` (through /tokenize and /detokenize), or the error message."""
    code, payload = raw(server, "POST", "/tokenize", json.dumps({"messages": messages}).encode())
    body = json.loads(payload)
    if code != 200:
        return code, body["error"]["message"]
    return code, json.loads(raw(server, "POST", "/detokenize", json.dumps({"tokens": body["tokens"]}).encode())[1])[
        "prompt"]


def parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text[:3]}, {"type": "text", "text": text[3:]}]


def test_developer_renders_as_system_when_the_template_does_not_know_it(server):
    as_system = rendered(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    as_developer = rendered(server, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert as_developer == as_system and as_system[0] == 200 and "Be brief." in as_system[1]
    code, payload = raw(server, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_tokens": 2}).encode())
    assert code == 200, payload


def test_function_messages_render_as_tool_results(server):
    head = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    as_tool = rendered(server, head + [{"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                                        "content": "sunny"}])
    as_function = rendered(server, head + [{"role": "function", "name": "get_weather", "content": "sunny"}])
    assert as_function == as_tool and as_tool[0] == 200 and "sunny" in as_tool[1]


def test_text_parts_render_as_the_string_for_every_role(server):
    conversation = [("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", "Let me see."),
                    ("user", "Please."), ("developer", "Answer in French.")]
    as_strings = rendered(server, [{"role": r, "content": c} for r, c in conversation])
    as_parts = rendered(server, [{"role": r, "content": parts(c)} for r, c in conversation])
    assert as_parts == as_strings and as_strings[0] == 200
    head = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    assert rendered(server, head + [{"role": "tool", "tool_call_id": "call_1", "content": parts("sunny")}]) == \
        rendered(server, head + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])


# What each template does with a role it was not written for: the template decides (vLLM's behaviour).
NARRATOR = {None: (400, "Unsupported message role: narrator"),  # the demo template refuses it
            "Qwen-Qwen3-0.6B.jinja": (200, None),  # Qwen3's skips roles it does not know
            "meta-llama-Llama-3.1-8B-Instruct.jinja": (200, "<|start_header_id|>narrator<|end_header_id|>\n\n42")}


def test_an_unknown_role_reaches_the_template(server, request):
    code, text = rendered(server, [{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "42"}])
    want_code, want_text = NARRATOR[TEMPLATES[request.node.callspec.indices["server"]]]
    assert code == want_code and (want_text is None or want_text in text), text
    code, payload = raw(server, "POST", "/tokenize", json.dumps({"messages": [{"role": "", "content": "x"}]}).encode())
    assert code == 400 and json.loads(payload)["error"]["param"] == "messages.0.role"


def test_a_template_that_knows_developer_keeps_it():
    template = fixture_path("chat_templates", "openai-gpt-oss-120b.jinja").read_text()
    text = render_chat(template, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in text
