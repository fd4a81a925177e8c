"""Forced tool calls as a grammar, in the model's own tool-call format (the one its tool parser reads).

`hermes` (Qwen, Hermes): <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, calls joined by
a newline. `llama3_json`: {"name": "f", "parameters": {...}}, calls joined by "; ". `qwen3_coder` (Qwen3.5,
Qwen3-Coder): <tool_call>\\n<function=f>\\n<parameter=k>\\nvalue\\n</parameter>\\n…</function>\\n</tool_call>,
calls joined by a newline. `openai` (gpt-oss's harmony): <|channel|>commentary to=functions.f <|constrain|>json
<|message|>{...}<|call|>, one call (<|call|> ends the model's turn). Pure Python.
"""
from __future__ import annotations

import json

from rawserve.engine.guided.grammar import (Grammar, GrammarError, Node, Ref, Repeat, alt, codepoint_ranges,
                                            complement_codepoints, lit, optional, seq)
from rawserve.engine.guided.json_formats import FORMATS
from rawserve.engine.guided.json_keywords import ANNOTATIONS, count_keyword
from rawserve.engine.guided.json_schema import add_schema_rules
from rawserve.engine.guided.json_strings import fit_length
from rawserve.text.parsers.qwen3_coder import (FUNCTION_CLOSE, PARAM_CLOSE, declared_types, is_raw_string,
                                               resolve_ref)

STYLES = ("hermes", "llama3_json", "qwen3_coder", "openai")
# A function without `parameters` takes none, as OpenAI reads it: its arguments are exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
HARMONY_CALL_MARKERS = ("<|channel|>", "<|constrain|>", "<|message|>", "<|call|>")


def tool_call_grammar(tools: list[tuple[str, dict | None]], *, style: str, parallel: bool,
                      open_tag: Node | None = None, close_tag: Node | None = None,
                      whitespace: str = "compact", indices: list[int] | None = None,
                      markers: dict[str, Node] | None = None) -> Grammar:
    """One or more calls (exactly one unless `parallel`), each naming one of `tools` (name,
    parameters schema) with arguments valid against that schema. For hermes and qwen3_coder, open_tag/close_tag are
    the <tool_call> tags as the vocabulary has them (a Token when it is one added token); for openai, `markers`
    are harmony's (<|channel|>, <|constrain|>, <|message|>, <|call|>) the same way. `indices`: each
    tool's place in the request's tools list, for the param of an error in its schema."""
    if not tools:
        raise GrammarError("a forced tool call needs at least one tool")
    if style not in STYLES:
        raise GrammarError(f"tool-call format {style!r} cannot be forced (supported: {', '.join(STYLES)})")
    rules: dict[str, Node] = {}
    calls = []
    for i, (name, parameters) in enumerate(tools):
        index = indices[i] if indices is not None else i
        if style == "qwen3_coder":
            calls.append(seq(open_tag or lit("<tool_call>"), _xml_call(rules, name, parameters, f"tool{i}-",
                                                                       whitespace, index),
                             close_tag or lit("</tool_call>")))
            continue
        try:
            args = add_schema_rules(rules, NO_PARAMETERS if parameters is None else parameters, f"tool{i}-",
                                    whitespace)
        except GrammarError as error:
            raise GrammarError(f"function {name!r}: {error}", param=f"tools.{index}.function.parameters") from None
        if style == "openai":
            mark = {**{m: lit(m) for m in HARMONY_CALL_MARKERS}, **(markers or {})}
            if not name or any(c.isspace() or c == "<" for c in name):
                raise GrammarError(f"function name {name!r} cannot be written in a harmony header",
                                   param=f"tools.{index}.function.name")
            calls.append(seq(mark["<|channel|>"], lit(f"commentary to=functions.{name} "), mark["<|constrain|>"],
                             lit("json"), mark["<|message|>"], args, mark["<|call|>"]))
            continue
        head = lit('{"name": ' + json.dumps(name, ensure_ascii=False) + ", ")
        if style == "hermes":
            calls.append(seq(open_tag or lit("<tool_call>"), lit("\n"), head, lit('"arguments": '), args,
                             lit("}\n"), close_tag or lit("</tool_call>")))
        else:
            calls.append(seq(head, lit('"parameters": '), args, lit("}")))
    rules["call"] = alt(*calls)
    call = Ref("call")
    separator = lit("; ") if style == "llama3_json" else lit("\n")
    # A harmony call ends the turn (<|call|> is a stop token): one call, whatever `parallel` says.
    rules["root"] = seq(call, Repeat(seq(separator, call), 0, None)) if parallel and style != "openai" else call
    return Grammar(rules, "root")


# ----- the XML form: raw text for string values, JSON for the others (the parser reads them back by the same rule)

# What a raw string value may say about itself; anything else it cannot be held to.
_RAW_STRING_KEYWORDS = frozenset({"type", "enum", "const", "nullable", "anyOf", "oneOf", "pattern", "format",
                                  "minLength", "maxLength", "$ref"}) | ANNOTATIONS
_OBJECT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties"}) | ANNOTATIONS
_NOT_IN_NAME = frozenset("<>\n")
_NULL = lit("null")


def _text_without(tags: tuple[str, ...]) -> Node:
    """Any text in which none of `tags` occurs (each starts with "<" and has no other "<").

    Every "<" starts an attempt at a tag: a proper prefix of one, then a character that neither continues it
    nor is "<" (which starts the next attempt), or the end of the text."""
    prefixes = sorted({tag[:k] for tag in tags for k in range(1, len(tag))})
    attempt = alt(*(lit(p) for p in prefixes))
    ended = []
    for prefix in prefixes:
        stop = {ord(tag[len(prefix)]) for tag in tags if tag.startswith(prefix)} | {ord("<")}
        ended.append(seq(lit(prefix), codepoint_ranges(complement_codepoints([(c, c) for c in stop]))))
    plain = codepoint_ranges(complement_codepoints([(ord("<"), ord("<"))]))
    unit = alt(plain, seq(Repeat(attempt, 0, None), alt(*ended)))
    return seq(Repeat(unit, 0, None), Repeat(attempt, 0, None))


# The parser ends a raw value at a </parameter> or </function> that markup follows; a free value has neither.
_FREE_TEXT = _text_without((PARAM_CLOSE, FUNCTION_CLOSE))
_NO_TAG_CHAR = codepoint_ranges(complement_codepoints([(ord("<"), ord("<"))]))


def _raw_string(schema: object, root: object, path: str, depth: int = 0) -> Node:
    """A string-typed value as raw text: enum/const values spelled out, pattern and format content unquoted,
    length bounds over characters other than "<" (narrower than the schema, never wider)."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or not schema:
        return _FREE_TEXT
    unknown = sorted(k for k in schema if k not in _RAW_STRING_KEYWORDS and not k.startswith("x-"))
    if unknown or "$ref" in schema or depth > 16:
        what = f"keyword {unknown[0]!r}" if unknown else "a $ref that does not resolve"
        raise GrammarError(f"{what} at {path} cannot be enforced on a raw string value")
    branches = schema.get("anyOf", schema.get("oneOf"))
    if isinstance(branches, list):
        return alt(*(_raw_string(b, root, f"{path}/anyOf/{k}", depth + 1) for k, b in enumerate(branches)))
    types, nullable = declared_types(schema, root)
    if not types:  # null alone, or nothing said but annotations
        return _NULL if nullable else _FREE_TEXT
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [v for v in values if isinstance(v, str)] if isinstance(values, list) else []
        if any(PARAM_CLOSE in t or FUNCTION_CLOSE in t for t in texts):
            raise GrammarError(f"an enum value at {path} contains a closing tag of the XML tool-call form")
        nodes = [lit(t) for t in texts] + ([_NULL] if nullable and None in values else [])
        if not nodes:
            raise GrammarError(f"the enum at {path} has no string value")
        return alt(*nodes)
    lo = count_keyword(schema, "minLength", path) if "minLength" in schema else 0
    hi = count_keyword(schema, "maxLength", path) if "maxLength" in schema else None
    if hi is not None and lo > hi:
        raise GrammarError(f"minLength exceeds maxLength at {path}")
    if "pattern" in schema:
        from rawserve.engine.guided.regex import parse_regex  # loaded only when a pattern needs it

        if not isinstance(schema["pattern"], str):
            raise GrammarError(f"'pattern' at {path} must be a string")
        node = fit_length(parse_regex(schema["pattern"]), lo, hi, f"{path}/pattern")
    elif "format" in schema:
        make = FORMATS.get(schema["format"])
        if make is None:
            raise GrammarError(f"unsupported string format {schema['format']!r} at {path}; supported: "
                               + ", ".join(sorted(FORMATS)))
        node = fit_length(make(), lo, hi, f"{path}/format")
    elif lo or hi is not None:
        node = Repeat(_NO_TAG_CHAR, lo, hi)
    else:
        node = _FREE_TEXT
    return alt(node, _NULL) if nullable else node


def _xml_call(rules: dict[str, Node], name: str, parameters: dict | None, prefix: str, whitespace: str,
              index: int) -> Node:
    """<function=NAME> and its parameters in schema order, the required ones always, each value valid for its
    property: raw text where the parser keeps text (is_raw_string), else JSON from the schema compiler."""
    param = f"tools.{index}.function.parameters"
    if _NOT_IN_NAME.intersection(name) or not name:
        raise GrammarError(f"function name {name!r} cannot be written in the XML tool-call form",
                           param=f"tools.{index}.function.name")
    schema = NO_PARAMETERS if parameters is None else parameters
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise GrammarError(f"function {name!r}: the XML tool-call form needs parameters of type object", param=param)
    unknown = sorted(k for k in schema if k not in _OBJECT_KEYWORDS and not k.startswith("x-"))
    if unknown:
        raise GrammarError(f"function {name!r}: keyword {unknown[0]!r} of parameters cannot be enforced in the "
                           "XML tool-call form", param=param)
    properties, required = schema.get("properties", {}), schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(r, str) for r in required):
        raise GrammarError(f"function {name!r}: properties must be an object and required a list of names",
                           param=param)
    extra = schema.get("additionalProperties", True)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    items = []
    for j, key in enumerate(list(properties) + [r for r in dict.fromkeys(required) if r not in properties]):
        if _NOT_IN_NAME.intersection(key) or not key:
            raise GrammarError(f"function {name!r}: parameter name {key!r} cannot be written in the XML tool-call "
                               "form", param=param)
        value_schema = properties[key] if key in properties else extra
        if value_schema is False:
            raise GrammarError(f"function {name!r}: required parameter {key!r} can have no value", param=param)
        path = f"#/properties/{key}"
        try:
            if is_raw_string(value_schema, schema):
                value = _raw_string(value_schema, schema, path)
            else:
                target = resolve_ref(value_schema, schema)
                if isinstance(target, dict) and defs:  # references inside it resolve against the parameters
                    target = {**defs, **target}
                value = add_schema_rules(rules, target, f"{prefix}p{j}-", whitespace)
        except GrammarError as error:
            raise GrammarError(f"function {name!r}: {error}", param=param) from None
        item = seq(lit(f"<parameter={key}>\n"), value, lit("\n</parameter>\n"))
        items.append(item if key in required else optional(item))
    return seq(lit(f"\n<function={name}>\n"), *items, lit("</function>\n"))
