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
