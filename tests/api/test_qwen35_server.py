"""A live server on a tiny random Qwen3.5 (hybrid) with the Qwen3.5 tokenizer and chat template, its core spawned
(--engine-mode process), through the openai SDK: chat with thinking on and off, a json_schema response, a streamed
chat, a repeated prompt served from the prefix cache (KV and saved states), forced tool calls in the XML form
(qwen3_coder, chosen from the template), a history with a tool call and its result, and a LoRA adapter on both layer
kinds chosen by model name. Outputs are random text; the tests assert structure, parsing and usage, not content."""
from __future__ import annotations

import json
import shutil

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread, wait_idle
from tests.api.test_qwen3_coder_tools import ALERTS, SCHEMAS, WEATHER, post
from tests.conftest import fixture_path

openai = pytest.importorskip("openai")

MODEL = "qwen35-tiny"
EOS = 248046  # <|im_end|>
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    from tests.checkpoints import reuse_vocab_index
    from tests.qwen35_checkpoints import make_qwen35_checkpoint

    tokenizer = fixture_path("qwen35-tokenizer")
    directory = make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-server"), vocab_size=248320, hidden_size=32,
                                       intermediate_size=64, dtype="bfloat16", eos_token_id=EOS, bos_token_id=None,
                                       initializer_range=0.1, max_position_embeddings=4096, mtp=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 248044]}))
    reuse_vocab_index(directory, 248320)  # the core's 5-20 s index build, shared with the VL checkpoints' (same files)
    return directory


def write_adapter(model_dir, out) -> str:
    """A random rank-4 adapter in PEFT's saved form on q_proj (full-attention layers), in_proj_qkv (Gated DeltaNet
    layers) and down_proj (every layer): adapter_config.json and adapter_model.safetensors, as save_pretrained
    writes them."""
    import torch
    from safetensors.torch import save_file

    from rawserve.engine.loader import read_model_config
    from rawserve.engine.lora import layer_modules, part_shapes

    cfg = read_model_config(model_dir)
    shapes, targets = part_shapes(cfg), ("q_proj", "in_proj_qkv", "down_proj")
    blocks = {"q_proj": "self_attn", "in_proj_qkv": "linear_attn", "down_proj": "mlp"}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer, modules in enumerate(layer_modules(cfg)):
        for module in targets:
            if module in modules:
                in_f, out_f = shapes[module]
                name = f"base_model.model.model.layers.{layer}.{blocks[module]}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(4, in_f, generator=g)
                tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, 4, generator=g)
    out.mkdir()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                         "target_modules": list(targets), "bias": "none"}))
    return str(out)


@pytest.fixture(scope="module")
def server(qwen35_dir, tmp_path_factory):
    adapter = write_adapter(qwen35_dir, tmp_path_factory.mktemp("qwen35-adapter") / "sql")
    srv = ServerThread(EngineConfig(model_dir=str(qwen35_dir), device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512,
                                    lora_modules=[f"sql={adapter}"], max_loras=1, max_lora_rank=4),
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


# A random model thinks at random: no thinking, so a forced call starts at once.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather in Paris?"}]


def check_arguments(name: str, arguments: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_qwen35_template_chooses_the_xml_tool_parser(server):
    assert server.app.context.tool_call_parser == "qwen3_coder"  # --tool-call-parser auto, from the template


def test_required_tool_calls_streamed_and_not_are_valid_xml_calls(server, client):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, ALERTS], seed=4, tool_choice="required",
                  max_tokens=300, extra_body=NO_THINKING)
    choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    written = "".join(entry.token for entry in choice.logprobs.content)  # what the model wrote: the XML form
    assert "<function=" in written and "<parameter=" in written and '{"name"' not in written
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        check_arguments(call.function.name, call.function.arguments)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, parallel_tool_calls=False, **kwargs):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            if delta.id is not None:  # a call's first delta: id, type and name
                assert delta.index not in calls and delta.function.name
                calls[delta.index] = {"name": delta.function.name, "arguments": delta.function.arguments or ""}
            else:
                calls[delta.index]["arguments"] += delta.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]  # parallel_tool_calls false: one call
    check_arguments(calls[0]["name"], calls[0]["arguments"])
    wait_idle(server)


def test_named_tool_choice_streamed_and_not_calls_that_function(server, client):
    kwargs = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, ALERTS], seed=2, max_tokens=300,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINKING)
    choice = client.chat.completions.create(logprobs=True, **kwargs).choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1  # OpenAI's reason for a named call
    assert "<function=get_weather>" in "".join(entry.token for entry in choice.logprobs.content)
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    check_arguments("get_weather", call.function.arguments)
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # same seed, same call
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(server)


def test_a_history_with_a_tool_call_and_its_result_goes_on(server, client):
    arguments = {"city": "Paris", "days": 2, "unit": "celsius"}
    history = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    ids = post(server, "/tokenize", {"model": MODEL, "messages": history})["tokens"]
    prompt = post(server, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]
    # the arguments rendered as a mapping (<parameter=KEY> blocks), not as the JSON text they came in
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>") in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, ALERTS], max_tokens=300,
                                           seed=1, tool_choice="required", extra_body=NO_THINKING)
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens > len(ids)  # the history, and the tools in the system prompt
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)
    wait_idle(server)


def test_a_lora_adapter_on_both_layer_kinds_serves_beside_the_base_model(server, client):
    assert "sql" in [m.id for m in client.models.list().data]
    kwargs = dict(messages=QUESTION, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    base = client.chat.completions.create(model=MODEL, **kwargs)
    tuned = client.chat.completions.create(model="sql", **kwargs)
    assert tuned.model == "sql" and tuned.usage.completion_tokens == 8
    assert tuned.choices[0].message.content != base.choices[0].message.content  # the deltas reach the output
    again = client.chat.completions.create(model="sql", **kwargs)  # the prefix cache keyed by adapter: same text
    assert again.choices[0].message.content == tuned.choices[0].message.content
    wait_idle(server)
