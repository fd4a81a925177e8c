"""The compiled NFA and its lazy pushdown automaton accept exactly what the reference matcher does, on the
regex and JSON Schema corpora (the front ends' own tests check their grammars with the reference alone)."""
from __future__ import annotations

import json
import pickle

import pytest

from rawserve.engine.guided.automaton import Automaton
from rawserve.engine.guided.grammar import Grammar, accepts
from rawserve.engine.guided.json_schema import json_object_grammar, schema_to_grammar
from rawserve.engine.guided.nfa import CompiledGrammar, compile_grammar
from rawserve.engine.guided.regex import parse_regex
from tests.guided.test_json_schema import CORPUS, texts
from tests.guided.test_regex import ORACLE_CASES


@pytest.mark.parametrize(("pattern", "samples"), ORACLE_CASES, ids=[p for p, _ in ORACLE_CASES])
def test_regex_automaton_equals_reference(pattern, samples):
    grammar = Grammar({"root": parse_regex(pattern)})
    automaton = Automaton(pickle.loads(pickle.dumps(compile_grammar(grammar, pattern))))
    for text in samples:
        assert automaton.matches(text.encode()) == accepts(grammar, text), (pattern, text)


@pytest.mark.parametrize("name,schema,valid,invalid", CORPUS, ids=[c[0] for c in CORPUS])
def test_schema_automaton_equals_reference(name, schema, valid, invalid):
    grammar = schema_to_grammar(schema)
    automaton = Automaton(compile_grammar(grammar, name))
    for value in [*valid, *invalid]:
        for text in texts(value):
            assert automaton.matches(text.encode()) == accepts(grammar, text), (name, text)
    object_grammar = json_object_grammar()
    any_object = Automaton(compile_grammar(object_grammar, "json_object"))
    for value in [*valid, *invalid]:
        for text in texts(value):
            assert any_object.matches(text.encode()) == (isinstance(value, dict)), text
    assert not any_object.matches(json.dumps([1]).encode())


def final_consumes() -> CompiledGrammar:
    """root calls r, then takes `c`; r is `a` then `b`*, its final state looping on `b` (state 4 consumes and ends
    a rule)."""
    return CompiledGrammar(
        "final-consumes",
        eps=[[], [], [], [], []],
        byte_edges=[[], [(0x63, 0x63, 2)], [], [(0x61, 0x61, 4)], [(0x62, 0x62, 4)]],
        token_edges=[[], [], [], [], []],
        call_edges=[[(1, 1)], [], [], [], []],
        is_final=[False, False, True, False, True],
        rule_start=[0, 3], rule_final=[2, 4], start_rule=0)


@pytest.mark.parametrize("packed", [False, True])
def test_a_rule_end_that_also_consumes_returns_to_its_caller(packed):
    """A closure made without its work loop (a thread that only consumes) must not take a called rule's final state
    for one: root calls r, then takes `c`; r is `a` then `b`*, its final state looping on `b`. After `a` the
    configuration holds both r's final state and the return to `c`."""
    compiled = final_consumes()
    if packed:
        compiled = pickle.loads(pickle.dumps(compiled))
    automaton = Automaton(compiled)
    for text, ok in [(b"ac", True), (b"abbc", True), (b"a", False), (b"abb", False), (b"c", False), (b"acb", False)]:
        assert automaton.matches(text) == ok, text


COUNTED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 80},
                                           "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 40}}}


@pytest.mark.parametrize("name,schema", [(c[0], c[1]) for c in CORPUS] + [("counted", COUNTED), ("final", None)],
                         ids=[c[0] for c in CORPUS] + ["counted", "final_consumes"])
def test_plain_flags_agree_with_each_state_s_edges(name, schema):
    """plain_flags works every state out at once, from the edge offsets and copied along virtual spans: it must say
    what each state's own rows say (packed and pickled, as the core gets them, and as made): a schema's, with virtual
    spans, and a hand-made grammar whose rule end consumes (no schema's does)."""
    compiled = final_consumes() if schema is None else compile_grammar(schema_to_grammar(schema), name)
    assert compiled.virtual or name != "counted"  # long runs' middle copies are virtual
    for g in (pickle.loads(pickle.dumps(compiled)), compiled):
        flags = Automaton(g)._plain
        assert len(flags) == g.num_states + 1 and flags[g.num_states] == 1
        for s in range(g.num_states):
            plain = (g.byte_edges[s] or g.token_edges[s]) and not (g.eps[s] or g.call_edges[s] or g.is_final[s])
            assert flags[s] == (1 if plain else 2), (name, s)
