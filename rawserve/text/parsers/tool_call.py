"""One streamed tool call: a JSON object {"name": ..., "arguments"|"parameters": {...}}.

Emits the call's header once its name is known and its arguments have begun, then the raw text of
the arguments as it is validated. Knows nothing of the tags around the object (hermes, llama3_json).
"""
from __future__ import annotations

import json
import re
import secrets

from rawserve.text.parsers.base import Event
from rawserve.text.parsers.json_stream import JsonScanner, JsonSyntaxError

OPEN, DONE, FAILED = "open", "done", "failed"
# An arguments object has really begun once its first key (or its end) is valid: a Python-style
# {'a': 1} then fails before the header goes out, and falls back to content cleanly.
_ARGS_BEGUN = re.compile(r'\{\s*(?:\}|"(?:[^"\\]|\\.)*"\s*:)')


def new_call_id() -> str:
    """OpenAI-style tool call id: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCallStream:
    """Feed the text after the opening marker; get events and a status.

    The header ("call", index, id, name) goes out once the name is a complete string and the
    arguments object's first key is valid (or the arguments are complete); argument text
    ("args", index, fragment) follows only as far as it is valid JSON, so the fragments of a
    well-formed call concatenate to exactly its arguments.
    An object value streams as it arrives; any other value (a JSON-encoded string, null) is sent
    whole when complete. `header_sent` says whether anything of this call has gone out: before
    that, a failure can still fall back to plain content.
    """

    def __init__(self, index: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.index = index
        self.arg_keys = arg_keys
        self.text = ""  # what the scanner consumed before the header went out (the content fallback)
        self.header_sent = False
        self.args_complete = False
        self._scanner = JsonScanner()
        self._name: str | None = None
        self._args_member = -1
        self._args_sent_to = -1  # offset into text up to which argument text has gone out
        self._keys: list[str] = []
        self.id: str | None = None

    def feed(self, text: str) -> tuple[list[Event], str, int]:
        """(events, status, used): status is open (wants more), done (the object closed after `used`
        characters of text) or failed (text[used] cannot continue a valid call)."""
        scanner = self._scanner
        start = scanner.pos
        try:
            used = scanner.feed(text)
            status = DONE if scanner.done else OPEN
        except JsonSyntaxError as error:
            used, status = error.pos - start, FAILED
        if self.header_sent:
            events = [] if self.args_complete else self._stream_args(text[:used], start)
        else:
            self.text += text[:used]
            if scanner.first and scanner.first != "{":
                return [], FAILED, used
            try:
                events = self._progress()
            except ValueError:  # a name that is not a string: the call is malformed
                return [], FAILED, used
        if status == DONE and not self.args_complete:
            if self._name is None:
                return events, FAILED, used
            events += self._finish_without_args()
        return events, status, used

    def _progress(self) -> list[Event]:
        """Before the header: look for the name and the arguments in everything consumed so far."""
        members = self._scanner.members
        for m in members[len(self._keys):]:
            self._keys.append(json.loads(self.text[m.key_start:m.key_end]))
        if self._name is None:
            for key, m in zip(self._keys, members):
                if key == "name" and m.value_end >= 0:
                    name = json.loads(self.text[m.value_start:m.value_end])
                    if not isinstance(name, str) or not name:
                        raise ValueError("tool call name must be a non-empty string")
                    self._name = name
        if self._args_member < 0:
            for k, (key, m) in enumerate(zip(self._keys, members)):
                if key in self.arg_keys and m.value_start >= 0:
                    self._args_member = k
                    break
        events: list[Event] = []
        if self._name is None or self._args_member < 0:
            return events
        m = members[self._args_member]
        is_object = self.text[m.value_start] == "{"
        if m.value_end < 0 and not self.header_sent:
            if not is_object or not _ARGS_BEGUN.match(self.text, m.value_start):
                return events  # a non-object is sent whole when complete; an object waits for its first key
        if not self.header_sent:
            self.header_sent = True
            self.id = new_call_id()
            events.append(("call", self.index, self.id, self._name))
        if is_object:
            start = max(self._args_sent_to, m.value_start)
            end = m.value_end if m.value_end >= 0 else len(self.text)
            if end > start:
                events.append(("args", self.index, self.text[start:end]))
                self._args_sent_to = end
            self.args_complete = m.value_end >= 0
        elif m.value_end >= 0 and not self.args_complete:
            events.append(("args", self.index, _normalize_arguments(self.text[m.value_start:m.value_end])))
            self.args_complete = True
        return events

    def _stream_args(self, chunk: str, start: int) -> list[Event]:
        """After the header: the part of this chunk (which begins at offset `start`) inside the
        arguments object. Only the new chunk is touched, so a long call costs O(1) per token."""
        m = self._scanner.members[self._args_member]
        end = m.value_end if m.value_end >= 0 else start + len(chunk)
        self.args_complete = m.value_end >= 0
        fragment = chunk[max(self._args_sent_to, start) - start:end - start]
        self._args_sent_to = max(self._args_sent_to, end)
        return [("args", self.index, fragment)] if fragment else []

    def _finish_without_args(self) -> list[Event]:
        """A complete object with a name and no arguments member: a call with no arguments."""
        events: list[Event] = []
        if not self.header_sent:
            self.header_sent = True
            self.id = new_call_id()
            events.append(("call", self.index, self.id, self._name))
        events.append(("args", self.index, "{}"))
        self.args_complete = True
        return events


def _normalize_arguments(raw: str) -> str:
    """Arguments given as a non-object JSON value, turned into the JSON text OpenAI expects."""
    value = json.loads(raw)
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            json.loads(value)  # a JSON document encoded as a string: send the document itself
            return value
        except ValueError:
            return raw
    return raw
