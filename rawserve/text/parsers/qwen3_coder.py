"""Qwen3-Coder / Qwen3.5 tool calls, the XML form:
<tool_call><function=NAME><parameter=KEY>value</parameter>…</function></tool_call>.

Values are raw text, converted to the JSON type the tool's schema declares for their key, and streamed as one
JSON object of arguments. Pure string logic; must not import engine, http or api.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from rawserve.text.parsers.base import CallSeparatedContent, Event, partial_suffix
from rawserve.text.parsers.tool_call import new_call_id

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
MAX_NAME_CHARS = 256
# A function name with any of these is a stray template token or prose (`<function={{ name }}>`), not a call.
_NOT_IN_FUNCTION_NAME = frozenset("{}<>\"' \t\n\r")
_NOT_IN_KEY = frozenset("<>\n")
# Python literals a model trained on `| string` renderings writes (True, None, {'a': 1}); longer text is not
# worth literal_eval's time.
_MAX_LITERAL_CHARS = 65536
# After </function>, how far to look for </tool_call> before going back to plain text.
_AFTER_LIMIT = 256
_TYPE_KEYWORDS = (("object", ("properties", "additionalProperties", "required", "minProperties", "maxProperties")),
                  ("array", ("items", "prefixItems", "minItems", "maxItems", "uniqueItems")),
                  ("string", ("minLength", "maxLength", "pattern", "format")),
                  ("number", ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")))

_TEXT, _OPENED, _NAME, _BODY, _KEY, _VALUE, _AFTER, _RAW = range(8)
_MISSING = object()


# ----- what a parameter's schema says about its value (the forced-call grammar reads the same answers)


def resolve_ref(schema: Any, root: Any, limit: int = 16) -> Any:
    """Follow a local `$ref` ("#" or "#/a/b") into `root`; a reference that does not resolve stays as it is."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and limit > 0:
        ref, node = schema["$ref"], root
        if ref != "#" and not ref.startswith("#/"):
            return schema
        for token in ref[2:].split("/") if ref != "#" else ():
            token = token.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or token not in node:
                return schema
            node = node[token]
        schema, limit = node, limit - 1
    return schema


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def declared_types(schema: Any, root: Any = None, depth: int = 0) -> tuple[frozenset[str], bool]:
    """(the non-null JSON types a value may take, whether null is allowed). No types: nothing narrows it."""
    schema = resolve_ref(schema, root)
    if not isinstance(schema, dict) or depth > 16:
        return frozenset(), False
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, list):
        types.update(k for k in kind if isinstance(k, str))
    elif isinstance(schema.get("anyOf", schema.get("oneOf")), list):
        nullable = False
        for branch in schema.get("anyOf", schema.get("oneOf")):
            sub, sub_nullable = declared_types(branch, root, depth + 1)
            if not sub and not sub_nullable:
                return frozenset(), False  # a branch that takes anything
            types |= sub
            nullable |= sub_nullable
        if nullable:
            types.add("null")
    elif "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if isinstance(values, list):
            types.update(_json_type(v) for v in values)
    else:
        types.update(t for t, keywords in _TYPE_KEYWORDS if any(k in schema for k in keywords))
    nullable = "null" in types or schema.get("nullable") is True
    types.discard("null")
    return frozenset(types), nullable


def is_raw_string(schema: Any, root: Any = None) -> bool:
    """Whether the value is written as raw text: a string-typed parameter, or one nothing narrows (vLLM keeps
    those raw too). Anything else is written as JSON."""
    types, _ = declared_types(schema, root)
    return not types - {"string"}


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _has_type(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def convert_value(raw: str, schema: Any, root: Any = None) -> Any:
    """A parameter's raw text as the JSON value its schema declares; the raw text when it is not one.

    Strings stay raw (no JSON parsing). "null"/"None" is null for a nullable or non-string parameter; JSON
    first for the other types, then Python's spelling (True, {'a': 1}), which a template's `| string` teaches."""
    types, nullable = declared_types(schema, root)
    text = raw.strip()
    if text.lower() in ("null", "none") and (nullable or types - {"string"}):
        return None
    if not types - {"string"}:
        return raw
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        value = _MISSING
    if value is not _MISSING and _has_type(value, types):
        return value
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in types and isinstance(value, float) and value.is_integer():
        return int(value)
    if types & {"object", "array"} and len(text) <= _MAX_LITERAL_CHARS:
        try:
            value = ast.literal_eval(text)
            json.dumps(value, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return raw
        if isinstance(value, (dict, list)) and _has_type(value, types):
            return value
    return raw


def _escaped(text: str) -> str:
    """JSON string content (no quotes); escaping is per character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderToolParser(CallSeparatedContent):
    """Content with XML-form tool calls; `tools` maps a function name to its parameters schema (None: none).

    A call's header goes out once `<function=NAME>` is followed by its first parameter or its end. Before that,
    a block that fails (no `<function=`, a name that cannot be one, the stream ends) is content, tags included;
    a bare `<function=NAME>` without `<tool_call>` is read as a call too (vLLM does the same). The arguments
    stream as a JSON object whose text is json.dumps of the converted values: a string-typed value as it
    arrives, any other value whole once its `</parameter>` is seen. As in vLLM, one newline right after
    `<parameter=KEY>` and one before `</parameter>` belong to the markup; a `</parameter>` counts only when
    `<parameter=`, `</function>`, `</tool_call>` or the end follows it, so a value may quote one; a missing
    `</parameter>` ends at `</function></tool_call>`. A call cut short (max_tokens) ends with the text it has
    and its object closed. Text between calls that is not markup is content; whitespace next to a call is kept
    only between two pieces of content, as in the hermes parser.
    """

    markers = (TOOL_OPEN, TOOL_CLOSE)

    def __init__(self, tools: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._tools = dict(tools or {})
        self._state = _TEXT
        self._held = ""
        self._wrapped = False  # the call opened with <tool_call>
        self._block = ""  # the call's text before its header went out: content if it fails
        self._header_sent = False
        self._name = ""
        self._num_params = 0
        self._key_schema: Any = None
        self._streams_value = False
        self._value = ""
        self._scan = 0  # offset into _value before which no closing tag can start
        self._skip = 0  # the newline right after <parameter=KEY> (0 or 1)
        self._sent = 0  # offset into _value up to which a streamed string has gone out

    def feed(self, text: str, final: bool) -> list[Event]:
        buffer: str | None = self._held + text
        self._held = ""
        events: list[Event] = []
        handlers = (self._text, self._opened, self._function_name, self._body, self._param_key, self._param_value,
                    self._after, self._raw)
        while buffer is not None:
            buffer = handlers[self._state](buffer, final, events)
        return events

    # ----- states: each consumes from buffer and returns what is left to read, or None when it waits

    def _text(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        found = [(p, tag) for tag in (TOOL_OPEN, FUNCTION_OPEN) if (p := buffer.find(tag)) >= 0]
        if found:
            p, tag = min(found)
            self._show_before_call(buffer[:p], events)
            self._wrapped, self._block, self._header_sent = tag == TOOL_OPEN, tag, False
            self._state = _OPENED if self._wrapped else _NAME
            return buffer[p + len(tag):]
        keep = 0 if final else max(partial_suffix(buffer, TOOL_OPEN), partial_suffix(buffer, FUNCTION_OPEN))
        self._show_before_call(buffer[:len(buffer) - keep], events)
        self._held = buffer[len(buffer) - keep:]
        if final and not self._num_calls and self._pending:
            events.append(("content", self._pending))  # no calls: the content is kept exactly
            self._pending = ""
        return None

    def _opened(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        rest = buffer.lstrip()
        if rest.startswith(FUNCTION_OPEN):
            self._block += buffer[:len(buffer) - len(rest) + len(FUNCTION_OPEN)]
            self._state = _NAME
            return rest[len(FUNCTION_OPEN):]
        if FUNCTION_OPEN.startswith(rest) and not final:
            self._held = buffer
            return None
        return self._fail(buffer, events)

    def _function_name(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        p = buffer.find(">", 0, MAX_NAME_CHARS + 1)
        name = buffer[:p] if p >= 0 else buffer[:MAX_NAME_CHARS + 1]
        if _NOT_IN_FUNCTION_NAME.intersection(name) or (p < 0 and (final or len(name) > MAX_NAME_CHARS)) \
                or p == 0:
            return self._fail(buffer, events)
        if p < 0:
            self._held = buffer
            return None
        self._block += buffer[:p + 1]
        self._name, self._num_params, self._state = name, 0, _BODY
        return buffer[p + 1:]

    def _body(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        """Between a call's parameters: the next <parameter=, or </function> (or a lone </tool_call>)."""
        rest = buffer.lstrip()
        spaces = buffer[:len(buffer) - len(rest)]
        if rest.startswith(PARAM_OPEN):
            self._send_header(spaces, events)
            self._state = _KEY
            return rest[len(PARAM_OPEN):]
        if rest.startswith(FUNCTION_CLOSE) or (self._wrapped and rest.startswith(TOOL_CLOSE)):
            self._send_header(spaces, events)
            self._close_call(events)
            if rest.startswith(TOOL_CLOSE):
                self._state = _TEXT
                return rest[len(TOOL_CLOSE):]
            self._state = _AFTER if self._wrapped else _TEXT
            return rest[len(FUNCTION_CLOSE):]
        if not final and any(tag.startswith(rest) for tag in (PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE)):
            self._held = buffer
            return None
        if not self._header_sent:
            return self._fail(buffer, events)
        self._close_call(events)
        if final:  # a closing tag cut short belongs to the call
            return None
        self._state = _AFTER if self._wrapped else _TEXT  # text that is no markup: content from here
        return rest

    def _param_key(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        p = buffer.find(">", 0, MAX_NAME_CHARS + 1)
        key = buffer[:p] if p >= 0 else buffer[:MAX_NAME_CHARS + 1]
        if p == 0 or _NOT_IN_KEY.intersection(key) or (p < 0 and len(key) > MAX_NAME_CHARS):
            self._close_call(events)
            self._state = _AFTER if self._wrapped else _TEXT
            return PARAM_OPEN + buffer
        if p < 0:
            if final:
                self._close_call(events)
                return None
            self._held = buffer
            return None
        parameters = self._tools.get(self._name)
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schema = properties.get(key) if isinstance(properties, dict) else None
        self._key_schema = schema
        types, nullable = declared_types(schema, parameters)
        # A string streams as it comes; anything else (and a nullable string, which "null" turns into null) is
        # converted whole.
        self._streams_value = not types - {"string"} and not nullable
        head = ("{" if not self._num_params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._args(events, head + ('"' if self._streams_value else ""))
        self._num_params += 1
        self._value, self._scan, self._skip, self._sent = "", 0, -1, 0
        self._state = _VALUE
        return buffer[p + 1:]

    def _param_value(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        self._value += buffer
        value = self._value
        wait = -1  # a closing tag whose meaning the next characters decide
        while True:
            found = [(p, tag) for tag in (PARAM_CLOSE, FUNCTION_CLOSE) if (p := value.find(tag, self._scan)) >= 0]
            if not found:
                break
            p, tag = min(found)
            after = value[p + len(tag):].lstrip()
            ends = (PARAM_OPEN, FUNCTION_CLOSE, TOOL_CLOSE) if tag == PARAM_CLOSE else (TOOL_CLOSE,)
            may_end = any(end.startswith(after) for end in ends)  # the next tag cut short, or nothing yet
            if after.startswith(ends) or (final and may_end):
                return self._end_value(p, value[p + len(PARAM_CLOSE):] if tag == PARAM_CLOSE else value[p:], events)
            if may_end:
                wait = p
                break
            self._scan = p + 1  # quoted in the value
        if final:
            return self._end_value(len(value), "", events)
        if wait < 0:
            self._scan = len(value) - max(partial_suffix(value, PARAM_CLOSE), partial_suffix(value, FUNCTION_CLOSE))
        if self._streams_value:
            self._stream_value(self._scan if wait < 0 else wait, events)
        return None

    def _after(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        """After </function>: up to </tool_call>; text in between is content."""
        limit = _AFTER_LIMIT + len(TOOL_CLOSE)
        p = buffer.find(TOOL_CLOSE, 0, limit)
        if p >= 0:
            self._content(events, buffer[:p].strip())
            self._state = _TEXT
            return buffer[p + len(TOOL_CLOSE):]
        if final:
            self._content(events, buffer.strip())
            return None
        if len(buffer) >= limit:
            self._state = _TEXT  # no closing tag: back to plain text
            return buffer.lstrip()
        self._held = buffer
        return None

    def _raw(self, buffer: str, final: bool, events: list[Event]) -> str | None:
        """A block that is no call: content through its </tool_call>."""
        p = buffer.find(TOOL_CLOSE)
        if p >= 0:
            self._content(events, buffer[:p + len(TOOL_CLOSE)])
            self._state = _TEXT
            return buffer[p + len(TOOL_CLOSE):]
        keep = 0 if final else partial_suffix(buffer, TOOL_CLOSE)
        self._content(events, buffer[:len(buffer) - keep])
        self._held = buffer[len(buffer) - keep:]
        return None

    # ----- helpers

    def _fail(self, buffer: str, events: list[Event]) -> str:
        """The block before its header is no call: it is content, and so is what follows it in its block."""
        self._content(events, self._block)
        self._state = _RAW if self._wrapped else _TEXT
        return buffer

    def _send_header(self, spaces: str, events: list[Event]) -> None:
        if self._header_sent:
            return
        self._header_sent = True
        self._block += spaces
        events.append(("call", self._num_calls, new_call_id(), self._name))
        self._num_calls += 1

    def _args(self, events: list[Event], fragment: str) -> None:
        if fragment:
            events.append(("args", self._num_calls - 1, fragment))

    def _close_call(self, events: list[Event]) -> None:
        self._args(events, "}" if self._num_params else "{}")

    def _stream_value(self, limit: int, events: list[Event]) -> None:
        """Send the string value's text before `limit`, holding back a newline that may precede </parameter>."""
        value = self._value
        if self._skip < 0:
            if not value:
                return
            self._skip = self._sent = 1 if value[0] == "\n" else 0
        if limit > self._sent and value[limit - 1] == "\n":
            limit -= 1
        if limit > self._sent:
            self._args(events, _escaped(value[self._sent:limit]))
            self._sent = limit

    def _end_value(self, end: int, rest: str, events: list[Event]) -> str | None:
        """The value is _value[:end]; `rest` is what follows its </parameter> (or starts at </function>)."""
        value = self._value
        start = 1 if value.startswith("\n") else 0
        if end > start and value[end - 1] == "\n":
            end -= 1
        if self._streams_value:
            self._args(events, _escaped(value[max(start, self._sent):end]) + '"')
        else:
            parameters = self._tools.get(self._name)
            converted = convert_value(value[start:end], self._key_schema, parameters)
            self._args(events, json.dumps(converted, ensure_ascii=False))
        self._value = ""
        self._state = _BODY  # at the end of the stream, _body closes the call
        return rest

    def _show_before_call(self, text: str, events: list[Event]) -> None:
        body = text.rstrip()
        self._content(events, body)
        self._pending += text[len(body):]

