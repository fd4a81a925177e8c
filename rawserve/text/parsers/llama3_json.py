"""Llama 3 JSON tool calls: output that is {"name": …, "parameters": {…}} (optionally after
<|python_tag|>), several calls separated by ';' or whitespace.

Output that does not start that way is content. Pure string logic; must not import engine/http/api.
"""
from __future__ import annotations

from rawserve.text.parsers.base import Event
from rawserve.text.parsers.tool_call import DONE, OPEN, ToolCallStream

_START, _CALL, _SEP, _CONTENT = range(4)
_SEPARATORS = " \t\n\r;"


class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON tool calls (the format of their chat templates' "JSON tool calling").

    The decision is made at the start of the output: leading whitespace and <|python_tag|> are
    skipped, and a '{' starts a call. If the first call fails before its header is sent, the whole
    output so far is content and so is everything after it. After a call, another '{' starts the
    next one; any other text ends tool parsing and is content.
    """

    python_tag = "<|python_tag|>"
    markers = (python_tag,)

    def __init__(self) -> None:
        self._state = _START
        self._held = ""
        self._lead = ""  # what _START skipped (whitespace, tags): content again if no call follows
        self._call: ToolCallStream | None = None
        self._num_calls = 0

    def feed(self, text: str, final: bool) -> list[Event]:
        buffer = self._held + text
        self._held = ""
        events: list[Event] = []
        while True:
            state = self._state
            if state == _CONTENT:
                _content(events, buffer)
                return events
            if state in (_START, _SEP):
                stripped = buffer.lstrip(_SEPARATORS if state == _SEP else _SEPARATORS[:-1])
                if stripped.startswith(self.python_tag):
                    if state == _START:
                        self._lead += buffer[:len(buffer) - len(stripped)] + self.python_tag
                    buffer = stripped[len(self.python_tag):]
                elif stripped.startswith("{"):
                    if state == _START:
                        self._lead += buffer[:len(buffer) - len(stripped)]
                    self._call = ToolCallStream(self._num_calls)
                    self._state, buffer = _CALL, stripped
                elif not final and self.python_tag.startswith(stripped):
                    self._held = buffer  # whitespace or the start of <|python_tag|>: undecided
                    return events
                else:
                    self._state = _CONTENT
                    if state == _START:
                        buffer = self._lead + buffer
                    else:
                        buffer = stripped
            else:  # _CALL
                call = self._call
                assert call is not None
                call_events, status, used = call.feed(buffer)
                events += call_events
                if status == OPEN:
                    if final and not call.header_sent:
                        _content(events, self._fallback(call.text))
                    return events
                buffer = buffer[used:]
                if status == DONE or call.header_sent:
                    self._num_calls += 1
                    self._state = _SEP
                else:
                    self._state = _CONTENT
                    buffer = self._fallback(call.text) + buffer

    def _fallback(self, call_text: str) -> str:
        """The raw text of a block that is not a call: for the first call, with what preceded it."""
        return (self._lead if self._num_calls == 0 else "") + call_text


def _content(events: list[Event], text: str) -> None:
    if text:
        events.append(("content", text))
