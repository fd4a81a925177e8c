"""Constrained answers in gpt-oss's harmony turn: an optional analysis message, then a forced call in the commentary
channel to functions.NAME, or a structured answer in the final channel; markers matched by token id."""
from __future__ import annotations

import json
import re

import pytest

from rawserve.api.guided import GuidedSpec, build_grammar, think_mode, vocabulary_of
from rawserve.engine.guided.automaton import Automaton
from rawserve.engine.guided.grammar import TOKEN_BASE, GrammarError, lit, symbols
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.tool_calls import tool_call_grammar
from rawserve.text.chat_template import render_chat
from rawserve.text.tokenizer import Tokenizer
from tests.harmony_tokenizer import HARMONY_SPECIAL_IDS, harmony_template, write_harmony_tokenizer

SCHEMA = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
TOOLS = json.dumps(["openai", True, [[0, "get_weather", SCHEMA], [1, "now", ""]]])  # api.guided.request_spec's


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return vocabulary_of(Tokenizer.from_dir(write_harmony_tokenizer(tmp_path_factory.mktemp("harmony-tok"))))


def harmony_symbols(text: str) -> tuple[int, ...]:
    """Text with harmony markers as the model emits it: each marker one token, the rest bytes."""
    out: list[int] = []
    for piece in re.split(r"(<\|[a-z]+\|>)", text):
        out += [TOKEN_BASE + HARMONY_SPECIAL_IDS[piece]] if piece in HARMONY_SPECIAL_IDS else symbols(piece)
    return tuple(out)


def automaton(spec: GuidedSpec, vocab) -> Automaton:
    return Automaton(compile_grammar(build_grammar(spec, vocab), spec.key))


def test_the_harmony_prompt_selects_harmony_mode_whatever_the_reasoning_parser():
    prompt = render_chat(harmony_template(), [{"role": "user", "content": "Hi"}])
    assert think_mode(prompt, None) == think_mode(prompt, "gpt_oss") == "harmony"
    assert think_mode("<|im_start|>assistant\n", "qwen3") == "may"


def test_a_forced_call_may_follow_one_analysis_message(vocab):
    a = automaton(GuidedSpec("tools", TOOLS, "tool_choice", "harmony"), vocab)
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    assert a.matches(harmony_symbols(call))
    assert a.matches(harmony_symbols("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                                     + call))
    assert a.matches(harmony_symbols("<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}<|call|>"))
    # Not: a second analysis, unknown function, arguments off the schema, the marker spelled as text, two calls.
    assert not a.matches(harmony_symbols("<|channel|>analysis<|message|>a<|end|><|start|>assistant"
                                         "<|channel|>analysis<|message|>b<|end|><|start|>assistant" + call))
    assert not a.matches(harmony_symbols(call.replace("get_weather", "get_time")))
    assert not a.matches(harmony_symbols(call.replace('"city"', '"town"')))
    assert not a.matches(symbols(call))
    assert not any(a.matches(harmony_symbols(call + between + call)) for between in ("<|start|>assistant", "\n", ""))


def test_a_structured_answer_goes_in_the_final_channel(vocab):
    a = automaton(GuidedSpec("json", SCHEMA, "response_format", "harmony"), vocab)
    assert a.matches(harmony_symbols('<|channel|>final<|message|>{"city": "Oslo"}'))
    assert a.matches(harmony_symbols('<|channel|>analysis<|message|>JSON it is.<|end|><|start|>assistant'
                                     '<|channel|>final<|message|>{"city": "Oslo"}'))
    assert not a.matches(symbols('{"city": "Oslo"}'))
    assert not a.matches(harmony_symbols('<|channel|>commentary<|message|>{"city": "Oslo"}'))


def test_a_name_a_header_cannot_hold_is_refused():
    with pytest.raises(GrammarError, match="harmony header") as info:
        tool_call_grammar([("get weather", None)], style="openai", parallel=False)
    assert info.value.param == "tools.0.function.name"
    grammar = tool_call_grammar([("f", None)], style="openai", parallel=True, markers={"<|call|>": lit("END")})
    assert Automaton(compile_grammar(grammar, "f")).matches(
        symbols("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}END"))
