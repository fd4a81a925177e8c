"""The compiled NFA and its lazy pushdown automaton accept exactly what the reference matcher does, on the
regex and JSON Schema corpora (the front ends' own tests check their grammars with the reference alone)."""
from __future__ import annotations

import json
import pickle

import pytest

from rawserve.engine.guided.automaton import Automaton
from rawserve.engine.guided.grammar import Grammar, accepts
from rawserve.engine.guided.json_schema import json_object_grammar, schema_to_grammar
from rawserve.engine.guided.nfa import compile_grammar
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
