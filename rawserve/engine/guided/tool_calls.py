"""Forced tool calls as a grammar, in the model's own tool-call format (the one its tool parser reads).

`hermes` (Qwen, Hermes): <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, calls joined by
a newline. `llama3_json`: {"name": "f", "parameters": {...}}, calls joined by "; ". Pure Python.
"""
from __future__ import annotations

import json

from rawserve.engine.guided.grammar import Grammar, GrammarError, Node, Ref, Repeat, alt, lit, seq
from rawserve.engine.guided.json_schema import add_schema_rules

STYLES = ("hermes", "llama3_json")
# A function without `parameters` takes none, as OpenAI reads it: its arguments are exactly {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_grammar(tools: list[tuple[str, dict | None]], *, style: str, parallel: bool,
                      open_tag: Node | None = None, close_tag: Node | None = None,
                      whitespace: str = "compact", indices: list[int] | None = None) -> Grammar:
    """One or more calls (exactly one unless `parallel`), each naming one of `tools` (name,
    parameters schema) with arguments valid against that schema. For hermes, open_tag/close_tag are
    the <tool_call> tags as the vocabulary has them (a Token when it is one added token). `indices`: each
    tool's place in the request's tools list, for the param of an error in its schema."""
    if not tools:
        raise GrammarError("a forced tool call needs at least one tool")
    if style not in STYLES:
        raise GrammarError(f"tool-call format {style!r} cannot be forced (supported: {', '.join(STYLES)})")
    rules: dict[str, Node] = {}
    calls = []
    for i, (name, parameters) in enumerate(tools):
        try:
            args = add_schema_rules(rules, NO_PARAMETERS if parameters is None else parameters, f"tool{i}-",
                                    whitespace)
        except GrammarError as error:
            index = indices[i] if indices is not None else i
            raise GrammarError(f"function {name!r}: {error}", param=f"tools.{index}.function.parameters") from None
        head = lit('{"name": ' + json.dumps(name, ensure_ascii=False) + ", ")
        if style == "hermes":
            calls.append(seq(open_tag or lit("<tool_call>"), lit("\n"), head, lit('"arguments": '), args,
                             lit("}\n"), close_tag or lit("</tool_call>")))
        else:
            calls.append(seq(head, lit('"parameters": '), args, lit("}")))
    rules["call"] = alt(*calls)
    call = Ref("call")
    separator = lit("\n") if style == "hermes" else lit("; ")
    rules["root"] = seq(call, Repeat(seq(separator, call), 0, None)) if parallel else call
    return Grammar(rules, "root")
