"""Forced tool-call grammars in both formats, read back by the server's own tool parsers; and guided
decoding on a byte-fallback vocabulary (stories260k: <0xNN> pieces and ▁ for spaces)."""
from __future__ import annotations

import json
import re

import pytest

from rawserve.engine.guided.automaton import Automaton
from rawserve.engine.guided.grammar import TOKEN_BASE, GrammarError, Token, accepts, symbols
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.tool_calls import tool_call_grammar
from rawserve.text.parsers.hermes import HermesToolParser
from rawserve.text.parsers.llama3_json import Llama3JsonToolParser
from tests.conftest import fixture_path

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("ping", None)]
OPEN, CLOSE = 7, 8


def hermes_symbols(*calls: str) -> tuple[int, ...]:
    out: list[int] = []
    for k, call in enumerate(calls):
        if k:
            out += symbols("\n")
        out += [TOKEN_BASE + OPEN, *symbols("\n" + call + "\n"), TOKEN_BASE + CLOSE]
    return tuple(out)


def calls_of(events) -> list[tuple[str, str]]:
    """(name, arguments text) per call from a tool parser's events."""
    calls: list[list[str]] = []
    for event in events:
        if event[0] == "call":
            calls.append([event[3], ""])
        elif event[0] == "args":
            calls[-1][1] += event[2]
    return [(name, args) for name, args in calls]


def test_hermes_grammar_takes_valid_calls_and_refuses_others():
    grammar = tool_call_grammar(TOOLS, style="hermes", parallel=True, open_tag=Token(OPEN), close_tag=Token(CLOSE))
    a = Automaton(compile_grammar(grammar, "hermes"))
    one = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    two = '{"name": "ping", "arguments": {}}'
    for ok in (hermes_symbols(one), hermes_symbols(one, two), hermes_symbols(two, two, one)):
        assert a.matches(ok) and accepts(grammar, ok)
    for bad in (hermes_symbols('{"name": "nope", "arguments": {}}'),
                hermes_symbols('{"name": "ping", "arguments": {"x": 1}}'),
                hermes_symbols('{"name": "get_weather", "arguments": {"unit": "c"}}'),  # city is required
                symbols("<tool_call>\n" + two + "\n</tool_call>"),  # the tags spelled out, not the tokens
                hermes_symbols(one)[:-1]):
        assert not a.matches(bad)
    single = Automaton(compile_grammar(tool_call_grammar(TOOLS, style="hermes", parallel=False,
                                                         open_tag=Token(OPEN), close_tag=Token(CLOSE)), "one"))
    assert single.matches(hermes_symbols(two)) and not single.matches(hermes_symbols(two, two))


def test_llama3_json_grammar_output_is_what_its_parser_reads():
    grammar = tool_call_grammar(TOOLS, style="llama3_json", parallel=True)
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "ping", "parameters": {}}'
    assert Automaton(compile_grammar(grammar, "l3")).matches(text.encode())
    calls = calls_of(Llama3JsonToolParser().feed(text, final=True))
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"}), ("ping", {})]
    assert not Automaton(compile_grammar(grammar, "l3b")).matches(b'{"name": "ping", "arguments": {}}')


def test_hermes_output_is_what_its_parser_reads():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    calls = calls_of(HermesToolParser().feed(text, final=True))
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Rome"}), ("ping", {})]


def test_unknown_format_and_no_tools_are_refused():
    with pytest.raises(GrammarError, match="cannot be forced"):
        tool_call_grammar(TOOLS, style="mistral", parallel=True)
    with pytest.raises(GrammarError, match="at least one tool"):
        tool_call_grammar([], style="hermes", parallel=True)


def test_byte_fallback_vocabulary_guided_generation_matches():
    from rawserve.config import EngineConfig
    from rawserve.engine.core import EngineCore
    from rawserve.engine.guided.grammar import Grammar
    from rawserve.engine.guided.regex import parse_regex
    from rawserve.engine.guided.vocab import VocabIndex
    from rawserve.engine.types import SamplingParams
    from rawserve.text.tokenizer import Tokenizer

    model = fixture_path("stories260k")
    tok = Tokenizer.from_dir(model)
    index = VocabIndex(tok.vocab_bytes(), set(tok.added_token_ids), tok.vocab_size)
    by_bytes = {b: i for i, b in enumerate(index.token_bytes) if b}
    assert b"\n" in by_bytes and b" " in by_bytes  # <0x0A> is a newline, ▁ is a space
    core = EngineCore(EngineConfig(model_dir=str(model), device="cpu", num_kv_blocks=64, max_model_len=256))
    pattern = r"(Once|One day), (a|the) [a-z]{2,12}( [a-z]{1,10}){0,3}\."
    compiled = compile_grammar(Grammar({"root": parse_regex(pattern)}), "stories")
    prompt = tok.encode("Lily", add_special_tokens=True)
    for seed in range(6):
        core.add_request(f"s{seed}", prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=seed,
                                                            guided=compiled))
    outs: dict[str, list[int]] = {}
    reasons = {}
    while core.has_unfinished:
        for out in core.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    for rid, ids in outs.items():
        text = tok.decode([i for i in ids if i not in tok.special_token_ids])
        assert reasons[rid] == "stop" and re.fullmatch(pattern, text), (rid, text)
