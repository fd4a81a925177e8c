"""Hermes / Qwen tool calls: <tool_call>{"name": …, "arguments": {…}}</tool_call> in the content.

Streams each call as it is generated; text outside the tags is content, and a block that turns
out not to be a call falls back to content. Pure string logic; must not import engine/http/api.
"""
from __future__ import annotations

from rawserve.text.parsers.base import CallSeparatedContent, Event, split_at
from rawserve.text.parsers.tool_call import DONE, OPEN, ToolCallStream

_TEXT, _CALL, _AFTER, _RAW = range(4)
# After a call's closing brace, how far to look for </tool_call> before giving up on it.
_AFTER_LIMIT = 256


class HermesToolParser(CallSeparatedContent):
    """Content with <tool_call> blocks.

    A block is a call once its name and the start of its arguments are valid (see ToolCallStream).
    If the block fails before that (not JSON, no name, the stream ends), the whole block, tags
    included, is content. If it fails after that, the call keeps the arguments already sent (they
    are then not valid JSON, like a call cut off by max_tokens) and the text from the failure to
    </tool_call> is content. Text between a call's closing brace and </tool_call> is content.
    Whitespace next to a call is kept only between two pieces of content, so an answer made of
    calls has no content at all; without calls the content is the text exactly.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    markers = (open_tag, close_tag)

    def __init__(self) -> None:
        super().__init__()
        self._state = _TEXT
        self._held = ""  # text that may be the start of a tag
        self._call: ToolCallStream | None = None

    def feed(self, text: str, final: bool) -> list[Event]:
        buffer = self._held + text
        self._held = ""
        events: list[Event] = []
        while True:
            state = self._state
            if state == _TEXT:
                before, after, held = split_at(buffer, self.open_tag)
                body = before.rstrip()
                self._content(events, body)
                self._pending += before[len(body):]
                if after is not None:
                    self._call = ToolCallStream(self._num_calls)
                    self._state, buffer = _CALL, after
                    continue
                if not final:
                    self._held = held
                elif held:
                    self._content(events, held)
                elif not self._num_calls and self._pending:
                    events.append(("content", self._pending))  # no calls: the content is kept exactly
                return events
            if state == _CALL:
                call = self._call
                assert call is not None
                call_events, status, used = call.feed(buffer)
                events += call_events
                if status == OPEN:
                    if final and not call.header_sent:
                        self._content(events, self.open_tag + call.text)
                    elif final:
                        self._num_calls += 1
                    return events
                buffer = buffer[used:]
                if status == DONE or call.header_sent:
                    self._num_calls += 1
                    self._state = _AFTER
                else:
                    self._content(events, self.open_tag + call.text)
                    self._state = _RAW
            elif state == _AFTER:
                limit = _AFTER_LIMIT + len(self.close_tag)
                p = buffer.find(self.close_tag, 0, limit)
                if p >= 0:
                    self._content(events, buffer[:p].strip())
                    self._state, buffer = _TEXT, buffer[p + len(self.close_tag):]
                elif final:
                    self._content(events, buffer.strip())
                    return events
                elif len(buffer) >= limit:
                    self._state, buffer = _TEXT, buffer.lstrip()  # no closing tag: back to plain text
                else:
                    self._held = buffer
                    return events
            else:  # _RAW: a failed block, shown as content through its closing tag
                before, after, held = split_at(buffer, self.close_tag)
                self._content(events, before)
                if after is None:
                    if final:
                        self._content(events, held)
                    else:
                        self._held = held
                    return events
                self._content(events, self.close_tag)
                self._state, buffer = _TEXT, after

