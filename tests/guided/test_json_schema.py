"""JSON Schema -> grammar: jsonschema is the oracle for what the grammar must accept and reject."""
from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from rawserve.engine.guided.grammar import Grammar, GrammarError, accepts, alt, lit, seq
from rawserve.engine.guided.json_schema import (add_schema_rules, count_nodes, json_object_grammar,
                                                schema_to_grammar)

FORMATS = Draft202012Validator.FORMAT_CHECKER
NUMBER_TEXT = re.compile(r"-?(0|[1-9]\d{0,18})(\.\d{1,16})?([eE][+-]?\d{1,3})?")

WEATHER = {"type": "object", "properties": {"location": {"type": "string"},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["location"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string", "maxLength": 5}},
           "required": ["street"], "additionalProperties": False}
TWENTY = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1},
    "name": {"type": "string", "minLength": 1},
    "email": {"type": "string", "format": "email"},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "score": {"type": "number"},
    "active": {"type": "boolean"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "home": ADDRESS,
    "work": {"anyOf": [ADDRESS, {"type": "null"}]},
    "prefs": {"type": "object", "properties": {
        "theme": {"enum": ["dark", "light"]},
        "font": {"type": "object", "properties": {"size": {"type": "integer"}, "family": {"type": "string"}},
                 "additionalProperties": False}},
        "additionalProperties": False},
    "orders": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"],
        "additionalProperties": False}},
    "note": {"type": ["string", "null"]},
    "created": {"type": "string", "format": "date-time"},
    "birthday": {"type": "string", "format": "date"},
    "uuid": {"type": "string", "format": "uuid"},
    "ip": {"type": "string", "format": "ipv4"},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "level": {"type": "integer", "enum": [1, 2, 3]},
    "meta": {}},
    "required": ["id", "name", "home"], "additionalProperties": False}

CORPUS = [
    ("weather", WEATHER,
     [{"location": "Paris"}, {"location": "Paris", "unit": "celsius"}, {"location": "", "unit": "fahrenheit"}],
     [{}, {"unit": "celsius"}, {"location": "x", "unit": "kelvin"}, {"location": 1}, "Paris", None]),
    ("twenty_properties", TWENTY,
     [{"id": 1, "name": "a", "home": {"street": "s"}},
      {"id": 7, "name": "Bob", "email": "b@x.org", "age": 130, "score": -2.5, "active": True, "role": "admin",
       "tags": ["a", "b"], "home": {"street": "s", "zip": "12345"}, "work": None,
       "prefs": {"theme": "dark", "font": {"size": 12}}, "orders": [{"sku": "x", "qty": 2}],
       "note": None, "created": "2024-02-29T12:00:00Z", "birthday": "2000-01-01",
       "uuid": "123e4567-e89b-12d3-a456-426614174000", "ip": "10.0.0.1", "ratio": 0.5, "level": 2,
       "meta": {"any": [1, {"x": None}]}},
      {"id": 2, "name": "c", "home": {"street": "s"}, "work": {"street": "w"}, "orders": []}],
     [{"id": 0, "name": "a", "home": {"street": "s"}}, {"id": 1, "name": "", "home": {"street": "s"}},
      {"id": 1, "name": "a"}, {"id": 1, "name": "a", "home": {"street": "s", "zip": "123456"}},
      {"id": 1, "name": "a", "home": {"street": "s"}, "age": 131},
      {"id": 1, "name": "a", "home": {"street": "s"}, "tags": ["a", "b", "c", "d"]},
      {"id": 1, "name": "a", "home": {"street": "s"}, "orders": [{"sku": "x", "qty": 0}]},
      {"id": 1, "name": "a", "home": {"street": "s"}, "prefs": {"font": {"size": 1.5}}},
      {"id": 1, "name": "a", "home": {"street": "s"}, "birthday": "2023-02-29"},
      {"id": 1, "name": "a", "home": {"street": "s"}, "ratio": 1.5},
      {"id": 1, "name": "a", "home": {"street": "s"}, "level": 4},
      {"id": 1, "name": "a", "home": {"street": "s"}, "extra": 1}]),
    ("defs_reused", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                          "y": {"type": "number"}},
                                         "required": ["x", "y"], "additionalProperties": False}},
                     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                     "required": ["a", "b"]},
     [{"a": {"x": 1, "y": 2}, "b": {"x": -1.5, "y": 0}}],
     [{"a": {"x": 1}, "b": {"x": 1, "y": 2}}, {"a": {"x": 1, "y": 2}, "b": {"x": "1", "y": 2}}]),
    ("recursive_tree", TREE,
     [{"value": 1, "children": []}, {"value": -3, "children": [{"value": 2, "children": [{"value": 3, "children": []}]},
                                                               {"value": 4, "children": []}]}],
     [{"value": 1}, {"value": 1, "children": [{"value": 2}]}, {"value": 1.5, "children": []},
      {"value": 1, "children": [], "x": 1}, {"value": 1, "children": [1]}]),
    ("string_or_null", {"anyOf": [{"type": "string"}, {"type": "null"}]},
     ["", "x", None], [1, True, [], {}]),
    ("enum_mixed", {"enum": ["a", 1, None, True]}, ["a", 1, None, True], ["b", 2, False, [], "1"]),
    ("enum_quotes_unicode", {"enum": ['say "hi"', "é😀中文", "back\\slash", "tab\t"]},
     ['say "hi"', "é😀中文", "back\\slash", "tab\t"], ["say hi", "é", "tab"]),
    ("const_object", {"const": {"a": [1, "x"], "b": None}}, [{"a": [1, "x"], "b": None}],
     [{"a": [1, "x"]}, {"a": [1, "y"], "b": None}]),
    ("const_string", {"type": "string", "const": "x\"y"}, ['x"y'], ["xy", 'x"y"']),
    ("all_optional", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                       "c": {"type": "integer"}}, "additionalProperties": False},
     [{}, {"b": 1}, {"a": 1, "c": 2}, {"a": 1, "b": 2, "c": 3}, {"c": 3}], [{"d": 1}, {"a": "x"}]),
    ("mixed_required", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                         "c": {"type": "integer"}}, "required": ["b"]},
     [{"b": 1}, {"a": 1, "b": 2}, {"b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}], [{}, {"a": 1}, {"a": 1, "c": 2}]),
    ("additional_false", {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
     [{}, {"a": "x"}], [{"b": 1}, {"a": "x", "b": 1}]),
    ("additional_true", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     [{}, {"a": 1}, {"a": 1, "b": "x"}, {"b": [1]}, {"ab": 1, "c": None}], [{"a": "x"}, [], 1]),
    ("additional_schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{}, {"x": 1}, {"a\"b": 2, "ключ": 3}], [{"x": "1"}, {"x": 1, "y": None}]),
    ("escaped_keys", {"type": "object", "properties": {"a\"b": {"type": "integer"}, "ключ": {"type": "string"}},
                      "required": ["a\"b", "ключ"], "additionalProperties": False},
     [{"a\"b": 1, "ключ": "значение"}], [{"a\"b": 1}, {"ab": 1, "ключ": "x"}]),
    ("string_length", {"type": "string", "minLength": 2, "maxLength": 3},
     ["😀😀", "a\n", "abc", "é中"], ["a", "😀", "abcd", "😀😀😀😀"]),
    ("integer_range", {"type": "integer", "minimum": -5, "maximum": 150},
     [-5, 0, 99, 150], [-6, 151, 1000, 1.5, "1"]),
    ("number_bounds", {"type": "number", "exclusiveMinimum": -1.5, "maximum": 2.25},
     [-1.25, -1, 0, 0.5, 2, 2.25, 2.2], [-1.5, -2, 2.26, 3, 1e10]),
    ("type_list", {"type": ["integer", "string"], "minimum": 0, "maxLength": 2}, [0, 5, "", "ab"],
     [-1, "abc", None, 1.5]),
    ("arrays", {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
     [[], [[]], [[1, 2], [3]]], [[1], [[1, "a"]], {}]),
    ("array_bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[], [1], [1, 2, 3, 4]]),
    ("array_of_objects", {"type": "array", "items": ADDRESS},
     [[], [{"street": "a"}, {"street": "b", "zip": "1"}]], [[{}], [{"street": "a", "x": 1}]]),
    ("prefix_items", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     [[], ["a"], ["a", 1]], [[1], ["a", "b"], ["a", 1, 2]]),
    ("prefix_items_rest", {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"},
                           "minItems": 2},
     [["a", 1], ["a", 1, 2, 3]], [[], ["a"], ["a", "b"], [1, 1]]),
    ("prefix_items_min", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"},
                                                           {"type": "boolean"}], "minItems": 2, "items": False},
     [["a", 1], ["a", 1, True]], [[], ["a"], ["a", 1, True, 2], ["a", True]]),
    ("prefix_items_max", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "maxItems": 1},
     [[], ["a"]], [["a", 1], [1]]),
    ("pattern", {"type": "string", "pattern": "^[a-z]+\\d{2}$"}, ["abc12", "z00"], ["abc1", "ABC12", "12", ""]),
    ("pattern_needing_escapes", {"type": "string", "pattern": "^[^x]{1,3}$"},
     ['"', "\\", "\n", 'a"\\'], ["", "x", "abcd"]),
    ("pattern_length", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ["a", "abc"], ["", "abcd"]),
    ("format_date_time", {"type": "string", "format": "date-time"},
     ["2024-02-29T12:00:00Z", "2024-02-29T12:00:00+05:30", "2024-01-01T00:00:00.123-08:00"],
     ["2024-02-29 12:00:00Z", "2024-02-30T12:00:00Z", "2024-02-29T12:00:00", "2024-02-29T24:00:00Z"]),
    ("format_date", {"type": "string", "format": "date"}, ["2024-02-29", "2000-02-29", "1999-12-31"],
     ["2023-02-29", "1900-02-29", "2024-13-01", "2024-04-31", "24-01-01"]),
    ("format_time", {"type": "string", "format": "time"}, ["12:00:00Z", "23:59:59.5+01:00"], ["24:00:00Z", "12:00Z"]),
    ("format_uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"],
     ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"]),
    ("format_email", {"type": "string", "format": "email"}, ["a.b+c@example.com", "x@y"], ["ab", "a.com"]),
    ("format_ipv4", {"type": "string", "format": "ipv4"}, ["192.168.0.1", "0.0.0.0", "255.255.255.255"],
     ["256.1.1.1", "01.1.1.1", "1.2.3", "1.2.3.4.5"]),
    ("format_ipv6", {"type": "string", "format": "ipv6"},
     ["::1", "::", "2001:db8::8a2e:370:7334", "::ffff:192.0.2.1", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::"],
     ["1:2:3:4:5:6:7:8:9", "1::2::3", ":::", "12345::", "1:2:3:4:5:6:7"]),
    ("root_ref", {"type": "object", "properties": {"name": {"type": "string"},
                                                   "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                  "required": ["name", "next"], "additionalProperties": False},
     [{"name": "a", "next": None}, {"name": "a", "next": {"name": "b", "next": None}}],
     [{"name": "a"}, {"name": "a", "next": {"name": "b"}}]),
    ("anyof_with_parent", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
     [{"a": 1}, {"b": 1}, {"a": 1, "b": 2}], [{}, {"c": 1}]),
    ("allof_single", {"allOf": [{"type": "string", "maxLength": 1}]}, ["", "a"], ["ab", 1]),
    ("enum_filtered_by_siblings", {"type": "integer", "enum": [1, 2.5, "x", 300], "maximum": 100},
     [1], [2.5, "x", 300]),
    ("empty_schema", {}, [None, 1, "x", [1, {"a": []}], {"b": {}}], []),
]


def texts(value: object) -> list[str]:
    return [json.dumps(value), json.dumps(value, separators=(",", ":"))]


@pytest.mark.parametrize("name,schema,valid,invalid", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_accepts_valid_and_rejects_invalid_instances(name, schema, valid, invalid):
    grammar = schema_to_grammar(schema)
    oracle = Draft202012Validator(schema, format_checker=FORMATS)
    for value in valid:
        assert oracle.is_valid(value), f"test data: {value!r} should be valid"
        for text in texts(value):
            assert accepts(grammar, text), text
    for value in invalid:
        assert not oracle.is_valid(value), f"test data: {value!r} should be invalid"
        for text in texts(value):
            assert not accepts(grammar, text), text


def test_listed_properties_without_additional_properties_allow_no_other_keys():
    value = {"location": "x", "foo": 1}
    assert Draft202012Validator(WEATHER).is_valid(value)  # JSON Schema would allow it; documented as refused
    assert not any(accepts(schema_to_grammar(WEATHER), text) for text in texts(value))


def test_empty_properties_mean_an_empty_object():  # a tool without arguments
    grammar = schema_to_grammar({"type": "object", "properties": {}})
    assert accepts(grammar, "{}")
    assert not accepts(grammar, '{"a":1}') and not accepts(grammar, "[]")


def test_openapi_nullable_adds_null():
    grammar = schema_to_grammar({"type": "integer", "nullable": True})
    assert accepts(grammar, "1") and accepts(grammar, "null")
    assert not accepts(grammar, '"1"') and not accepts(grammar, "1.5")
    grammar = schema_to_grammar({"enum": ["a"], "nullable": True})
    assert accepts(grammar, '"a"') and accepts(grammar, "null") and not accepts(grammar, '"b"')


def test_non_ascii_pattern_content_is_spelled_raw():
    grammar = schema_to_grammar({"type": "string", "pattern": "^[α-ω]+$"})
    assert accepts(grammar, '"αβγ"')
    assert not accepts(grammar, '"abc"')
    assert not accepts(grammar, json.dumps("αβγ"))  # \u escapes: documented as unreachable


# ----- raw texts: strings, numbers, object and array syntax


@pytest.mark.parametrize("text,ok", [
    ('"a\\"b"', True), ('"\\\\"', True), ('"\\u00e9"', True), ('"\\u00E9"', True), ('"\\ud83d\\ude00"', True),
    ('"é😀中文"', True), ('"\\/\\b\\f\\n\\r\\t"', True), ('""', True),
    ('"a\nb"', False), ('"\t"', False), ('"\\x"', False), ('"\\ud83d"', False), ('"\\ude00"', False),
    ('"\\u12"', False), ('"a"b"', False), ('"a', False), ("'a'", False),
])
def test_string_escapes(text, ok):
    assert accepts(schema_to_grammar({"type": "string"}), text) is ok


def test_string_length_counts_escapes_and_surrogate_pairs_as_one_character():
    grammar = schema_to_grammar({"type": "string", "minLength": 2, "maxLength": 3})
    assert accepts(grammar, '"\\ud83d\\ude00\\ud83d\\ude00"')  # 2 characters, 4 escapes
    assert accepts(grammar, '"a\\n"') and accepts(grammar, '"\\n\\t\\""')
    assert not accepts(grammar, '"\\n"') and not accepts(grammar, '"\\n\\n\\n\\n"')


@pytest.mark.parametrize("text", ["-0", "0", "0.0", "1e10", "1E+10", "-1.5e-3", "123456789012345678", "1e-7", "2.5E3"])
def test_number_accepts(text):
    assert accepts(schema_to_grammar({"type": "number"}), text)


@pytest.mark.parametrize("text", ["01", ".5", "1.", "+1", "NaN", "Infinity", "1e", "-", "1e1234", "--1", "0x1",
                                  "1" * 20, "0." + "1" * 17])
def test_number_rejects(text):
    assert not accepts(schema_to_grammar({"type": "number"}), text)


def test_integer_rejects_fractions_and_exponents():
    grammar = schema_to_grammar({"type": "integer"})
    assert accepts(grammar, "-12") and accepts(grammar, "9" * 19)
    for text in ("1.0", "1e3", "01", "9" * 20, "+1"):
        assert not accepts(grammar, text)


@pytest.mark.parametrize("lo,hi", [(-5, 150), (0, 9), (10, 99), (-100, -3), (1, None), (None, 0), (7, 7),
                                   (-1, 1), (95, 1005), (None, -10)])
def test_integer_range_is_exact(lo, hi):
    schema = {"type": "integer"}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    grammar = schema_to_grammar(schema)
    for n in range(-1100, 1100):
        assert accepts(grammar, str(n)) is ((lo is None or n >= lo) and (hi is None or n <= hi)), n
    big = 10 ** 18
    assert accepts(grammar, str(big)) is (hi is None)
    assert accepts(grammar, str(-big)) is (lo is None)


def test_exclusive_integer_bounds_and_float_bounds_round_inward():
    grammar = schema_to_grammar({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 5.5})
    assert [n for n in range(-10, 10) if accepts(grammar, str(n))] == [3, 4, 5]
    grammar = schema_to_grammar({"type": "integer", "minimum": 0.5, "maximum": 3.0})
    assert [n for n in range(-10, 10) if accepts(grammar, str(n))] == [1, 2, 3]


NUMBER_BOUNDS = [
    {"minimum": 0}, {"exclusiveMinimum": 0}, {"maximum": 0}, {"exclusiveMaximum": 0},
    {"minimum": -1.5, "maximum": 2.25}, {"exclusiveMinimum": -1.5, "exclusiveMaximum": 2},
    {"minimum": 0.05, "exclusiveMaximum": 0.5}, {"minimum": 2, "maximum": 2}, {"minimum": 1.25, "maximum": 1.75},
    {"exclusiveMinimum": -0.25, "maximum": -0.125},
]
SAMPLE_NUMBERS = [f"{sign}{whole}{frac}" for sign in ("", "-") for whole in range(0, 4)
                  for frac in ("", ".0", ".05", ".125", ".25", ".2500", ".5", ".75", ".99", ".0001", ".049")]


@pytest.mark.parametrize("bounds", NUMBER_BOUNDS, ids=[json.dumps(b) for b in NUMBER_BOUNDS])
def test_number_bounds_are_exact_on_the_decimal_text(bounds):
    grammar = schema_to_grammar({"type": "number", **bounds})
    oracle = Draft202012Validator({"type": "number", **bounds})
    for text in SAMPLE_NUMBERS:
        value = Decimal(text)
        if text.startswith("-") and value == 0 and bounds.get("minimum") == 0:
            continue  # -0 is valid for minimum 0, but the grammar refuses a sign there (documented)
        assert accepts(grammar, text) is oracle.is_valid(json.loads(text)), text


def test_number_exponents_only_on_an_unbounded_side():
    grammar = schema_to_grammar({"type": "number", "minimum": 0})
    assert accepts(grammar, "1e5") and accepts(grammar, "2.5E-3")
    assert not accepts(grammar, "-1e5") and not accepts(grammar, "-1")
    grammar = schema_to_grammar({"type": "number", "minimum": 0, "maximum": 10})
    assert not accepts(grammar, "1e0")


@pytest.mark.parametrize("text,ok", [
    ("{}", True), ('{"b":1}', True), ('{"a":1,"c":2}', True), ('{"a": 1, "b": 2, "c": 3}', True),
    ('{"c":1,"a":2}', False), ("{,}", False), ('{"a":1,}', False), ('{,"a":1}', False), ('{"a":1,,"b":2}', False),
    ('{"a":1 ,"b":2}', False), ('{"a":1,"a":2}', False), ('{ "a":1}', False), ('{"a":1}\n', False),
])
def test_all_optional_properties_keep_order_and_syntax(text, ok):
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}}
    assert accepts(schema_to_grammar(schema), text) is ok


def test_optional_properties_grammar_grows_linearly():
    def size(n: int) -> int:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
        grammar = schema_to_grammar(schema)
        return count_nodes(list(grammar.rules.values()))

    s30, s60, s120 = size(30), size(60), size(120)
    assert (s60 - s30) / 30 == pytest.approx((s120 - s60) / 60, rel=0.05)  # constant cost per property
    assert s120 < 25 * 120
    grammar = schema_to_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30)}})
    assert accepts(grammar, '{"p29":1}') and accepts(grammar, '{"p3":1,"p17":2}')
    assert not accepts(grammar, '{"p17":1,"p3":2}')


def test_extra_keys_cannot_repeat_a_listed_key():
    grammar = schema_to_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                 "additionalProperties": {"type": "string"}})
    assert accepts(grammar, '{"a":1,"ab":"x","b":"y"}') and accepts(grammar, '{"":"x"}')
    assert not accepts(grammar, '{"a":1,"a":"x"}')
    assert not accepts(grammar, '{"a":"x"}')


def test_required_key_outside_properties_takes_the_additional_schema():
    grammar = schema_to_grammar({"type": "object", "required": ["k"], "additionalProperties": {"type": "integer"}})
    assert accepts(grammar, '{"k":1}') and accepts(grammar, '{"k":1,"z":2}')
    assert not accepts(grammar, "{}") and not accepts(grammar, '{"k":"1"}')


# ----- arrays and nesting


@pytest.mark.parametrize("text,ok", [
    ("[]", True), ("[[1,2],[3]]", True), ("[[], [1]]", True), ("[,]", False), ("[1,]", False), ("[[1]", False),
])
def test_nested_arrays(text, ok):
    grammar = schema_to_grammar({"type": "array", "items": {"type": "array", "items": {"type": "integer"}}})
    assert accepts(grammar, text) is ok


def test_objects_nested_five_deep():
    schema: dict = {"type": "integer"}
    value: object = 1
    for key in "abcde":
        schema = {"type": "object", "properties": {key: schema}, "required": [key], "additionalProperties": False}
        value = {key: value}
    grammar = schema_to_grammar(schema)
    assert all(accepts(grammar, t) for t in texts(value))
    assert not accepts(grammar, json.dumps(value).replace("1", '"1"'))


# ----- json_object


@pytest.mark.parametrize("text,ok", [
    ("{}", True), ('{"a":[{"b":[[]]}]}', True), ('{"a": {"b": {"c": [1, -2.5e3, "x", true, false, null]}}}', True),
    ('{"a":1,"a":2}', True), ('{"a":[1,2,]}', False), ("[]", False), ('"x"', False), ("1", False), ("", False),
    ('{"a":1}}', False), ('{"a" : 1}', False), ('{"a":  1}', False), ('{\n"a":1}', False),
])
def test_json_object_grammar(text, ok):
    assert accepts(json_object_grammar(), text) is ok


def test_json_object_uses_recursive_value_object_array_rules():
    grammar = json_object_grammar()
    assert {"value", "object", "array"} <= set(grammar.rules)
    deep = '{"a":' * 20 + "[]" + "}" * 20
    assert accepts(grammar, deep)


def test_pretty_whitespace_is_bounded():
    value = {"a": [1, {"b": None}], "c": {}}
    pretty = json_object_grammar("pretty")
    for indent in (1, 2, 4):
        assert accepts(pretty, json.dumps(value, indent=indent))
    assert accepts(pretty, json.dumps(value, indent="\t"))
    assert accepts(pretty, json.dumps(value)) and accepts(pretty, json.dumps(value, separators=(",", ":")))
    assert accepts(pretty, '{"a":\n' + " " * 20 + "1}")
    assert not accepts(pretty, '{"a":\n' + " " * 21 + "1}")
    assert not accepts(pretty, '{"a":\n\n1}') and not accepts(pretty, '{"a":  1}') and not accepts(pretty, ' {}')
    assert not accepts(json_object_grammar(), json.dumps(value, indent=2))
    schema_pretty = schema_to_grammar(TWENTY, whitespace="pretty")
    assert accepts(schema_pretty, json.dumps(CORPUS[1][2][1], indent=2))


# ----- embedding, determinism, limits


def test_add_schema_rules_embeds_two_schemas_under_their_prefixes():
    rules: dict = {}
    calls = []
    for fn, schema in (("get_weather", WEATHER), ("walk", TREE)):
        args = add_schema_rules(rules, schema, f"{fn}_")
        calls.append(seq(lit('{"name": "' + fn + '", "arguments": '), args, lit("}")))
    rules["root"] = alt(*calls)
    assert all(name.startswith(("get_weather_", "walk_")) for name in rules if name != "root")
    grammar = Grammar(rules)
    assert accepts(grammar, '{"name": "get_weather", "arguments": {"location": "Oslo"}}')
    assert accepts(grammar, '{"name": "walk", "arguments": {"value": 1, "children": []}}')
    assert not accepts(grammar, '{"name": "walk", "arguments": {"location": "Oslo"}}')
    assert not accepts(grammar, '{"name": "get_weather", "arguments": {"value": 1, "children": []}}')


def test_a_refused_schema_leaves_the_callers_rules_untouched():
    rules = {"root": lit("x")}
    with pytest.raises(GrammarError):
        # "a" adds the any-JSON rules before "b" is refused
        add_schema_rules(rules, {"type": "object", "properties": {"a": {}, "b": {"not": {}}}}, "f_")
    assert rules == {"root": lit("x")}


def test_same_schema_gives_the_same_grammar():
    first, second = schema_to_grammar(TWENTY), schema_to_grammar(json.loads(json.dumps(TWENTY)))
    assert list(first.rules) == list(second.rules)
    assert first.rules == second.rules


def test_recursive_ref_is_one_recursive_rule():
    grammar = schema_to_grammar(TREE)
    assert list(grammar.rules) == ["def_node", "root"]
    deep = '{"value":1,"children":[' * 12 + '{"value":0,"children":[]}' + "]}" * 12
    assert accepts(grammar, deep)


def test_left_recursive_ref_is_refused():
    with pytest.raises(GrammarError, match="loops back"):
        schema_to_grammar({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"})


def test_recursion_without_a_way_out_is_refused():
    endless = {"$defs": {"a": {"type": "object", "properties": {"next": {"$ref": "#/$defs/a"}},
                               "required": ["next"]}}, "$ref": "#/$defs/a"}
    with pytest.raises(GrammarError, match="no finite JSON value"):
        schema_to_grammar(endless)


def test_only_a_schema_whose_refs_recurse_has_its_rules_checked(monkeypatch):
    """check_grammar (can every rule finish, is none left-recursive) runs when a $ref reached a schema still being
    compiled, the one way a schema's rules can reach themselves; the others, any JSON value's rules among them, are
    left unchecked, and still compile."""
    from rawserve.engine.guided import json_schema

    checked = []
    monkeypatch.setattr(json_schema, "check_grammar", lambda grammar: checked.append(grammar))
    shared = {"$defs": {"a": {"type": "string"}}, "type": "object",
              "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"$ref": "#/$defs/a"}, "z": True}}
    for schema in (TWENTY, WEATHER, ADDRESS, shared, {"type": "array", "items": {}}):
        schema_to_grammar(schema)
    assert checked == []
    schema_to_grammar(TREE)
    assert len(checked) == 1


def test_depth_and_size_limits():
    deep: dict = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="deeper than 64"):
        schema_to_grammar(deep)
    with pytest.raises(GrammarError, match="'enum' at # has 20,000 values"):
        schema_to_grammar({"enum": [f"v{i}" for i in range(20_000)]})
    with pytest.raises(GrammarError, match="grammar nodes"):
        schema_to_grammar({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}})


def test_annotations_are_ignored():
    schema = {"type": "string", "title": "T", "description": "d", "default": "x", "examples": ["y"],
              "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "urn:x", "$comment": "c",
              "deprecated": False, "readOnly": True, "writeOnly": False, "x-vendor": {"not": 1}}
    assert accepts(schema_to_grammar(schema), '"s"')


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"tags": {"type": "object", "patternProperties": {"^x": {}}}}},
     "unsupported JSON Schema keyword 'patternProperties' at #/properties/tags"),
    ({"not": {"type": "string"}}, "unsupported JSON Schema keyword 'not' at #"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "keyword 'if' at #/properties/a"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "keyword 'dependentRequired' at #"),
    ({"type": "array", "contains": {"type": "integer"}}, "keyword 'contains' at #"),
    ({"type": "array", "items": {"type": "object", "propertyNames": {"maxLength": 2}}},
     "keyword 'propertyNames' at #/items"),
    ({"anyOf": [{"type": "object", "unevaluatedProperties": False}]}, "keyword 'unevaluatedProperties' at #/anyOf/0"),
    ({"$defs": {"x": {"type": "array", "minContains": 1}}, "$ref": "#/$defs/x"}, "keyword 'minContains' at #/$defs/x"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at #"),
    ({"type": "number", "multipleOf": 3}, "'multipleOf' at #"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' at # has 2 subschemas"),
    ({"type": "string", "format": "color"}, "unsupported string format 'color' at #"),
    ({"$ref": "https://example.com/schema.json"}, "only references into this schema"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "object", "minProperties": 1}, "'minProperties' at #"),
    ({"type": "object", "properties": {"a": {}}, "maxProperties": 0}, "'maxProperties' at #"),
    ({"type": "strnig"}, "'type' at #"),
    ({"type": "string", "pattern": "(?=a)b"}, "lookahead"),
    ({"type": "string", "pattern": "(ab)+", "maxLength": 4}, "minLength/maxLength together with the pattern"),
    ({"$ref": "#/$defs/a", "maxLength": 3, "$defs": {"a": {}}}, "'maxLength' beside '$ref' at #"),
    ({"type": "string", "maxLength": 1, "minLength": 2, "nullable": False}, "matches no JSON value"),
])
def test_unsupported_or_unsatisfiable_schemas_are_refused_with_keyword_and_path(schema, message):
    with pytest.raises(GrammarError) as info:
        schema_to_grammar(schema)
    assert message in str(info.value)


def test_allowed_trivial_cases_of_restricted_keywords():
    assert accepts(schema_to_grammar({"type": "array", "uniqueItems": True, "maxItems": 1}), "[1]")
    grammar = schema_to_grammar({"type": "number", "multipleOf": 1, "minimum": 0})
    assert accepts(grammar, "3") and not accepts(grammar, "3.5")
    grammar = schema_to_grammar({"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 1,
                                 "maxProperties": 1})
    assert accepts(grammar, '{"a":[]}')


# ----- Hypothesis: accepts(grammar, text) iff jsonschema says valid


def finite_floats():
    # -0.0 and integral floats are left out: the grammar refuses `-0.0` under minimum 0 and `1.0` as an
    # integer (both documented as narrower than JSON Schema).
    return st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).filter(
        lambda f: not f.is_integer() and NUMBER_TEXT.fullmatch(json.dumps(f)) is not None)


def keyed(spec: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Dicts with a random subset of spec's keys, in spec order (the grammar fixes schema order;
    jsonschema ignores order), each valued by its own strategy."""
    keys = list(spec)
    return st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)).flatmap(
        lambda chosen: st.fixed_dictionaries({k: spec[k] for k in chosen})).map(
        lambda d: {k: d[k] for k in keys if k in d})


def leaves(*extra: object) -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.integers(-300, 300), finite_floats(),
                     st.text(max_size=4), st.sampled_from(extra) if extra else st.nothing())


def trees() -> st.SearchStrategy:
    small_ints = st.integers(-50, 50)
    mostly_valid = st.fixed_dictionaries({"value": st.one_of(small_ints, small_ints, leaves())})
    return st.recursive(
        mostly_valid.map(lambda d: {**d, "children": []}) | keyed({"value": leaves(), "children": leaves(),
                                                                  "x": leaves()}),
        lambda kids: st.builds(lambda v, ch: {"value": v, "children": ch}, st.one_of(small_ints, leaves()),
                               st.lists(kids, max_size=2)),
        max_leaves=5)


def mostly(strategy: st.SearchStrategy, *others: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(strategy, strategy, strategy, *others)


PROPERTY_CASES = [
    # the oracle gets additionalProperties false: the grammar's documented reading of a missing one
    ("weather", {**WEATHER, "additionalProperties": False},
     mostly(keyed({"location": st.text(max_size=4), "unit": st.sampled_from(["celsius", "fahrenheit", "kelvin"])})
            .filter(lambda d: "location" in d),
            keyed({"location": leaves(), "unit": leaves("celsius"), "other": leaves()}))),
    ("tree", TREE, trees()),
    ("int_or_null", {"type": ["integer", "null"], "minimum": -5, "maximum": 150},
     mostly(st.integers(-10, 160), st.none(), leaves(-5, 150, 151, -6))),
    ("number_bounds", {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25},
     # bounded numbers are spelled without exponents (documented)
     st.one_of(st.floats(-3, 3, allow_nan=False).filter(lambda f: f != 0 and not f.is_integer() and "e" not in repr(f)
                                                         and NUMBER_TEXT.fullmatch(repr(f)) is not None),
               st.integers(-3, 3), st.sampled_from([-1.5, 2.25, 2.2499999999999996, -1.5000000000000002]))),
    ("short_strings", {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 3},
     st.lists(mostly(st.text(max_size=2), st.text(min_size=3, max_size=4), st.integers(0, 3)),
              max_size=4)
     | st.lists(st.text(max_size=2), min_size=1, max_size=3)),
    ("all_optional", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                                       "c": {"type": "boolean"}}, "additionalProperties": False},
     mostly(keyed({"a": st.integers(-99, 99), "b": st.text(max_size=3), "c": st.booleans()}),
            keyed({"a": leaves(), "b": leaves(), "c": leaves(), "d": leaves()}))),
    ("enum_mixed", {"enum": ["a", 1, None, True, [1, "x"], {"k": False}]},
     mostly(st.sampled_from(["a", 1, None, True, [1, "x"], {"k": False}]),
            st.one_of(leaves("b"), st.just([1, "y"]), st.just({"k": True})))),
    ("any_json", {}, st.recursive(leaves(), lambda kids: st.lists(kids, max_size=3)
                                  | st.dictionaries(st.text(max_size=3), kids, max_size=3), max_leaves=8)),
]


@pytest.mark.parametrize("name,schema,values", PROPERTY_CASES, ids=[c[0] for c in PROPERTY_CASES])
def test_grammar_agrees_with_jsonschema_on_random_values(name, schema, values):
    grammar = schema_to_grammar(WEATHER if name == "weather" else schema)
    oracle = Draft202012Validator(schema)

    outcomes: set[bool] = set()

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                     HealthCheck.filter_too_much])
    @given(values)
    def check(value):
        expected = oracle.is_valid(value)
        outcomes.add(expected)
        for text in texts(value):
            assert accepts(grammar, text) is expected, text

    check()
    assert outcomes == ({True} if schema == {} else {True, False}), "the strategy must produce both kinds"
