"""A live server on a tiny random gpt-oss (tests/checkpoints.make_moe_checkpoint) with a gpt-oss-shaped tokenizer
(tests/harmony_tokenizer.py: the harmony markers at their real ids) and the real harmony template, its core spawned,
through the openai SDK: reasoning split from the answer, forced tool calls, a tool round trip, the Responses API.

Random weights write no harmony on their own, so a grammar writes the structure: guided_grammar spells the analysis
and final messages by token id, and tool_choice=required uses the harmony call grammar (api/guided.py). What the
tests check is everything after the sampler: markers kept through the detokenizer for the parser, the channels
split, <|call|> and <|return|> stopping the turn, the shapes the SDK reads. The texts themselves are random."""
from __future__ import annotations

import json
import re
import urllib.request

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread, wait_idle
from tests.harmony_tokenizer import HARMONY_EOS_IDS, HARMONY_SPECIAL_IDS, HARMONY_VOCAB_SIZE, write_harmony_tokenizer

openai = pytest.importorskip("openai")

MODEL = "gpt-oss-tiny"
IDS = {name.strip("<|>"): i for name, i in HARMONY_SPECIAL_IDS.items()}
# analysis, then final: the token ids of the markers, a few lowercase words in each body.
REASON_THEN_ANSWER = (f'root ::= <[{IDS["channel"]}]> "analysis" <[{IDS["message"]}]> [a-z]{{2,6}} " " [a-z]{{2,6}} '
                      f'<[{IDS["end"]}]> <[{IDS["start"]}]> "assistant" <[{IDS["channel"]}]> "final" '
                      f'<[{IDS["message"]}]> [a-z]{{2,6}} " " [a-z]{{2,6}}')
WORDS = re.compile(r"^[a-z]{2,6} [a-z]{2,6}$")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False}}}
# In the analysis body the grammar lets any text run until <|end|>; the bias makes a random model close it soon
# (everywhere else the grammar masks <|end|> out, so the bias changes nothing there).
SHORT_ANALYSIS = {str(IDS["end"]): 30}
MARKER = re.compile(r"<\|[a-z]+\|>")


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    checkpoints = pytest.importorskip("tests.checkpoints")
    if not hasattr(checkpoints, "make_moe_checkpoint"):
        pytest.skip("tests/checkpoints.py has no gpt-oss builder")
    directory = checkpoints.make_moe_checkpoint(
        tmp_path_factory.mktemp("gpt-oss-server"), "gpt_oss", vocab_size=HARMONY_VOCAB_SIZE, bos_token_id=199998,
        eos_token_id=IDS["return"], pad_token_id=IDS["endoftext"], max_position_embeddings=4096)
    write_harmony_tokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": HARMONY_EOS_IDS,
                                                                  "bos_token_id": 199998}))
    checkpoints.reuse_vocab_index(directory, HARMONY_VOCAB_SIZE)  # the core's index build at start, across runs
    return directory


@pytest.fixture(scope="module")
def server(gpt_oss_dir):
    # No parser flags: auto picks the harmony (openai) parser from the template, which splits the channels.
    srv = ServerThread(EngineConfig(model_dir=str(gpt_oss_dir), device="cpu", dtype="float32", num_kv_blocks=256,
                                    max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=512),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process", api_key=[]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(server.base + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_chat_splits_reasoning_from_the_answer_streamed_and_whole(client, server):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=40, temperature=0,
                  extra_body={"guided_grammar": REASON_THEN_ANSWER})
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    assert WORDS.match(reasoning) and WORDS.match(choice.message.content), (reasoning, choice.message.content)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    # Streamed: reasoning first, then the answer, no marker in any delta, the same text as the whole response.
    kinds, texts = [], {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump(exclude_none=True)
            for key in texts:
                if delta.get(key):
                    assert not MARKER.search(delta[key]) and "<|" not in delta[key], delta
                    texts[key] += delta[key]
                    kinds.append(key)
    assert texts == {"reasoning_content": reasoning, "content": choice.message.content}
    assert kinds == sorted(kinds, key=lambda k: k == "content")
    # With special tokens shown, the markers are still the parser's, never the answer's.
    kwargs["extra_body"] = {**kwargs["extra_body"], "skip_special_tokens": False}
    shown = client.chat.completions.create(**kwargs).choices[0].message
    assert (shown.content, shown.model_extra["reasoning_content"]) == (choice.message.content, reasoning)
    wait_idle(server)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_comes_back_as_a_tool_call(client, server, tool_choice):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[WEATHER], tool_choice=tool_choice, max_tokens=120, temperature=0,
                                           logit_bias=SHORT_ANALYSIS)
    choice = reply.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 3
    assert not choice.message.content
    wait_idle(server)


def test_a_json_schema_answer_is_the_final_message(client, server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is 2+2 4?"}], max_tokens=60, temperature=0,
        logit_bias=SHORT_ANALYSIS, logprobs=True, response_format={"type": "json_schema", "json_schema": {
            "name": "a", "schema": schema}})
    message = reply.choices[0].message
    assert json.loads(message.content)["answer"] in ("yes", "no"), message
    written = "".join(entry.token for entry in reply.choices[0].logprobs.content)  # the tokens, markers included
    assert written.endswith("<|channel|>final<|message|>" + message.content), written
    assert reply.choices[0].finish_reason == "stop" and "<|" not in (message.model_extra.get("reasoning_content") or "")


@pytest.mark.parametrize("marker", ["call", "return"])
def test_call_and_return_end_the_turn(client, server, marker):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           logit_bias={str(IDS[marker]): 100})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    assert not reply.choices[0].message.content and not reply.choices[0].message.model_extra.get("reasoning_content")


def test_a_streamed_forced_call_arrives_in_openai_deltas(client, server):
    name, arguments, finish = None, "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Oslo?"}],
                                                tools=[WEATHER], tool_choice="required", max_tokens=120,
                                                temperature=0, logit_bias=SHORT_ANALYSIS, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or ():
                assert call.index == 0
                name = call.function.name or name
                arguments += call.function.arguments or ""
            assert not (c.delta.content and "<|" in c.delta.content)
            finish = c.finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    assert set(json.loads(arguments)) == {"city", "days"}


def test_a_tool_round_trip_renders_the_call_its_reasoning_and_the_result(client, server):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "reasoning_content": "I should call get_weather.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    ids = post(server, "/tokenize", {"model": MODEL, "messages": history})["tokens"]
    prompt = post(server, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]
    assert ("<|start|>assistant<|channel|>analysis<|message|>I should call get_weather.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Paris", "days": 1}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
            '<|message|>"{\\"temperature\\": 21}"<|end|><|start|>assistant') in prompt
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=40,
                                           temperature=0, extra_body={"guided_grammar": REASON_THEN_ANSWER})
    assert WORDS.match(reply.choices[0].message.content) and reply.choices[0].finish_reason == "stop"


def test_reasoning_effort_reaches_the_system_message(client, server):
    """"Reasoning: medium" (the template's default) is one token more than "Reasoning: low" in this vocabulary."""
    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                              **kwargs).usage.prompt_tokens

    default = prompt_tokens()
    assert prompt_tokens(reasoning_effort="low") == default - 1
    assert prompt_tokens(reasoning_effort="low", extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}}) \
        == default  # the more specific field wins
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, reasoning={"effort": "low"}) \
        .usage.input_tokens == client.responses.create(model=MODEL, input="Hi", max_output_tokens=1) \
        .usage.input_tokens - 1
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                       extra_body={"reasoning_effort": "extreme"})
    assert info.value.body["param"] == "reasoning_effort"


def test_a_history_the_template_refuses_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as info:  # markers belong in reasoning_content, not in content
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel|>final<|message|>Hey"},
            {"role": "user", "content": "?"}])
    assert info.value.body["param"] == "messages" and "thinking" in info.value.body["message"]


def test_responses_api_gives_reasoning_message_and_function_call_items(client, server):
    reply = client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=40, temperature=0,
                                    extra_body={"guided_grammar": REASON_THEN_ANSWER})
    kinds = [item.type for item in reply.output]
    assert kinds == ["reasoning", "message"], kinds
    assert WORDS.match(reply.output[0].summary[0].text) and WORDS.match(reply.output_text)
    assert reply.usage.output_tokens_details.reasoning_tokens > 0
    tool = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
            "parameters": WEATHER["function"]["parameters"]}
    called = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool], tool_choice="required",
                                     max_output_tokens=120, temperature=0,
                                     extra_body={"logit_bias": SHORT_ANALYSIS})
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city", "days"}
    assert all(item.type in ("reasoning", "function_call") for item in called.output)
    # The next turn: the stored call (and any reasoning before it) goes back through the template with its result.
    answered = client.responses.create(model=MODEL, previous_response_id=called.id, tools=[tool],
                                       max_output_tokens=40, temperature=0, extra_body={
                                           "guided_grammar": REASON_THEN_ANSWER},
                                       input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                               "output": '{"temperature": 21}'}])
    assert [item.type for item in answered.output] == ["reasoning", "message"] and WORDS.match(answered.output_text)
    assert answered.usage.input_tokens > called.usage.input_tokens
    wait_idle(server)
