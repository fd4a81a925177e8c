"""Shared pieces of the streaming output parsers: events, tag hold-back, and the parser interfaces.

Parsers are pure string state machines; they must not import engine, http or api.
"""
from __future__ import annotations

from typing import Protocol, Union

# What parsers produce, before OutputParser shapes it into OpenAI deltas:
#   ("content", text) | ("reasoning_content", text)
#   ("call", index, id, name)            the first delta of tool call `index`
#   ("args", index, fragment)            more argument text for tool call `index`
Event = Union[tuple[str, str], tuple[str, int, str, str], tuple[str, int, str]]


def partial_suffix(buffer: str, tag: str) -> int:
    """Length of the longest suffix of buffer that is a proper prefix of tag (text to hold back)."""
    if not buffer:
        return 0
    first = tag[0]
    start = max(0, len(buffer) - len(tag) + 1)
    p = buffer.find(first, start)
    while p >= 0:
        if tag.startswith(buffer[p:]):
            return len(buffer) - p
        p = buffer.find(first, p + 1)
    return 0


def split_at(buffer: str, tag: str) -> tuple[str, str | None, str]:
    """(text before tag, text after tag or None if absent, held text that may begin the tag)."""
    p = buffer.find(tag)
    if p >= 0:
        return buffer[:p], buffer[p + len(tag):], ""
    k = partial_suffix(buffer, tag)
    return buffer[:len(buffer) - k], None, buffer[len(buffer) - k:]


class ReasoningParser(Protocol):
    """Splits output into reasoning and content. feed returns content/reasoning_content events.

    `markers`: the tag strings it reads (and never shows); the detokenizer keeps them even when the
    tokenizer calls them special tokens, which skip_special_tokens would otherwise drop before the parser."""

    markers: tuple[str, ...]

    def feed(self, text: str, final: bool) -> list[Event]: ...


class ToolParser(Protocol):
    """Finds tool calls in content. feed returns content, call and args events. `markers`: as ReasoningParser's."""

    markers: tuple[str, ...]

    def feed(self, text: str, final: bool) -> list[Event]: ...


class CallSeparatedContent:
    """Content beside tool calls, for a tool parser: whitespace waits in `_pending` until something visible follows,
    since whitespace that only separates calls is no content. `_num_calls` counts the calls begun so far."""

    def __init__(self) -> None:
        self._pending = ""
        self._has_content = False
        self._num_calls = 0

    def _content(self, events: list[Event], text: str) -> None:
        """Show text; whitespace waits in _pending until something visible follows it."""
        visible = text.lstrip()
        self._pending += text[:len(text) - len(visible)]
        if not visible:
            return
        # Pending whitespace sits next to a call; it is kept between content, or when no call came yet.
        if self._has_content or not self._num_calls:
            visible = self._pending + visible
        self._pending = ""
        self._has_content = True
        events.append(("content", visible))
