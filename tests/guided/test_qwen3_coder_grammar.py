"""Forced calls in the XML form (Qwen3.5, Qwen3-Coder): the grammar takes valid calls and refuses invalid values,
the compiled automaton agrees with the reference matcher, and random walks through it are calls the qwen3_coder
parser reads back with arguments valid against their schema."""
from __future__ import annotations

import json
import random

import pytest

from rawserve.engine.guided.automaton import DEAD, Automaton
from rawserve.engine.guided.grammar import TOKEN_BASE, GrammarError, Token, accepts, symbols
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.tool_calls import tool_call_grammar
from rawserve.text.parsers.qwen3_coder import Qwen3CoderToolParser

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "when": {"type": "string", "format": "date"},
    "code": {"type": "string", "pattern": "[A-Z]{2}[0-9]"},
    "short": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
    "hot": {"type": "boolean"},
    "where": {"$ref": "#/$defs/point"}},
    "required": ["city", "days"], "additionalProperties": False,
    "$defs": {"point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                        "additionalProperties": False}}}
TOOLS = [("get_weather", WEATHER), ("ping", None)]
OPEN, CLOSE = 7, 8


def call(body: str, *params: tuple[str, str]) -> tuple[int, ...]:
    text = f"\n<function={body}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return (TOKEN_BASE + OPEN, *symbols(text + "</function>\n"), TOKEN_BASE + CLOSE)


def grammar(parallel: bool = True):
    return tool_call_grammar(TOOLS, style="qwen3_coder", parallel=parallel, open_tag=Token(OPEN),
                             close_tag=Token(CLOSE))


VALID = [
    call("get_weather", ("city", "Paris"), ("days", "3")),
    call("get_weather", ("city", 'a "quoted" </param value\non two lines <x>'), ("days", "7"),
         ("unit", "celsius"), ("when", "2024-07-26"), ("code", "AB1"), ("short", "abc"), ("hot", "true"),
         ("where", '{"lat": 1.5}')),
    call("get_weather", ("city", ""), ("days", "1"), ("short", "null")),
    call("ping"),
    call("ping") + symbols("\n") + call("get_weather", ("city", "x"), ("days", "2")),
]
INVALID = [
    call("get_weather", ("city", "Paris")),  # days is required
    call("get_weather", ("days", "3"), ("city", "Paris")),  # schema order
    call("get_weather", ("city", "Paris"), ("days", "8")),  # past its maximum
    call("get_weather", ("city", "Paris"), ("days", '"3"')),  # an integer is no JSON string
    call("get_weather", ("city", "a</parameter>b"), ("days", "3")),  # a raw value cannot hold its closing tag
    call("get_weather", ("city", "a</function>b"), ("days", "3")),
    call("get_weather", ("city", "x"), ("days", "3"), ("unit", '"celsius"')),  # raw, not quoted
    call("get_weather", ("city", "x"), ("days", "3"), ("unit", "kelvin")),
    call("get_weather", ("city", "x"), ("days", "3"), ("when", "yesterday")),
    call("get_weather", ("city", "x"), ("days", "3"), ("code", "ab1")),
    call("get_weather", ("city", "x"), ("days", "3"), ("short", "abcd")),
    call("get_weather", ("city", "x"), ("days", "3"), ("hot", "True")),
    call("get_weather", ("city", "x"), ("days", "3"), ("where", '{"lat": "n"}')),
    call("get_weather", ("city", "x"), ("days", "3"), ("extra", "1")),
    call("nope"),
    symbols("<tool_call>\n<function=ping>\n</function>\n</tool_call>"),  # the tags spelled, not the tokens
]


def test_valid_calls_are_taken_and_invalid_values_refused_by_automaton_and_reference():
    g = grammar()
    automaton = Automaton(compile_grammar(g, "xml"))
    for text in VALID:
        assert automaton.matches(text) and accepts(g, text), bytes(s for s in text if s < 256)
    for text in INVALID:
        assert not automaton.matches(text) and not accepts(g, text), bytes(s for s in text if s < 256)


def test_parallel_false_takes_exactly_one_call():
    single = Automaton(compile_grammar(grammar(parallel=False), "one"))
    assert single.matches(call("ping")) and not single.matches(VALID[-1])


# Bytes a walk may write: every byte of the markup and of short values, so a walk can always finish.
ALPHABET = sorted(set(b"\n<>/=_-.:,\"{}[] abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))


def moves_of(automaton: Automaton, cid: int) -> list[tuple[str, int]]:
    """(text, configuration) for each symbol the walk may write next."""
    row = automaton.expand(cid)
    out = [(chr(b), row[b]) for b in ALPHABET if row[b] != DEAD]
    names = {OPEN: "<tool_call>", CLOSE: "</tool_call>"}
    return out + [(names[t], nxt) for t, nxt in automaton.allowed_tokens(cid).items()]


def shortest_ending(automaton: Automaton, cid: int) -> str | None:
    """The shortest text that completes the output from `cid` (breadth first over configurations)."""
    back: dict[int, tuple[int, str] | None] = {cid: None}
    queue = [cid]
    for c in queue:
        if automaton.is_accepting[c]:
            text = []
            while back[c] is not None:
                c, piece = back[c]
                text.append(piece)
            return "".join(reversed(text))
        for piece, nxt in moves_of(automaton, c):
            if nxt not in back:
                back[nxt] = (c, piece)
                queue.append(nxt)
    return None


def random_call_text(automaton: Automaton, rng: random.Random) -> str | None:
    """Random symbols for a random number of steps, then the shortest way to a complete output."""
    cid, out = automaton.start, []
    for _ in range(rng.randrange(400)):
        moves = moves_of(automaton, cid)
        if not moves:
            break
        markup = [m for m in moves if m[0][0] in "\n<"]  # leaning toward the markup reaches later parameters
        piece, cid = rng.choice(markup if markup and rng.random() < 0.3 else moves)
        out.append(piece)
    ending = shortest_ending(automaton, cid)
    return None if ending is None else "".join(out) + ending


def test_random_walks_through_the_grammar_parse_to_arguments_valid_for_their_schema():
    every = {**WEATHER, "required": list(WEATHER["properties"])}  # each walk writes every kind of value
    tools = [("get_weather", every), ("ping", None)]
    automaton = Automaton(compile_grammar(tool_call_grammar(tools, style="qwen3_coder", parallel=True,
                                                            open_tag=Token(OPEN), close_tag=Token(CLOSE)), "walks"))
    schemas = {"get_weather": every, "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
    rng = random.Random(0)
    num_calls = 0
    values: set[str] = set()
    for _ in range(60):
        text = random_call_text(automaton, rng)
        if text is None:
            continue
        events = Qwen3CoderToolParser(dict(tools)).feed(text, final=True)
        assert not [e for e in events if e[0] == "content"], text
        calls: list[list[str]] = []
        for event in events:
            if event[0] == "call":
                calls.append([event[3], ""])
            else:
                calls[-1][1] += event[2]
        assert calls, text
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
            values.update(json.dumps(v) for v in json.loads(arguments).values())
            num_calls += 1
    assert num_calls >= 40 and len(values) >= 40  # many different values, not one path


def test_what_the_xml_form_cannot_hold_is_refused_naming_the_tool():
    bad = {"type": "object", "properties": {"a": {"type": "string", "not": {}}}}
    with pytest.raises(GrammarError) as error:
        tool_call_grammar([("f", bad)], style="qwen3_coder", parallel=False, indices=[3])
    assert error.value.param == "tools.3.function.parameters"
    with pytest.raises(GrammarError):
        tool_call_grammar([("f", {"type": "object", "properties": {"a>b": {"type": "string"}}})],
                          style="qwen3_coder", parallel=False)
    with pytest.raises(GrammarError):
        tool_call_grammar([("f", {"anyOf": [{"type": "object"}]})], style="qwen3_coder", parallel=False)
