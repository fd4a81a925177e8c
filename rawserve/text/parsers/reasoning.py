"""Reasoning parsers: split <think>…</think> reasoning from the answer, as text streams in.

Used for Qwen3 / QwQ / DeepSeek-R1 style output, including prompts that already opened <think>.
Pure string logic; must not import engine, http or api.
"""
from __future__ import annotations

from rawserve.text.parsers.base import Event, split_at

# States
_START, _OPENING, _REASONING, _CONTENT_START, _CONTENT = range(5)


def prompt_opens_reasoning(prompt: str, start_tag: str = "<think>", end_tag: str = "</think>") -> bool:
    """Whether a rendered prompt leaves a reasoning block open (its last <think> is not closed),
    so the model's output begins inside reasoning (QwQ, DeepSeek-R1 with thinking on)."""
    opened = prompt.rfind(start_tag)
    return opened >= 0 and prompt.find(end_tag, opened) < 0


class ThinkReasoningParser:
    """<think>reasoning</think>answer.

    Output that starts with <think> (after optional whitespace) is reasoning until </think>; output
    that does not is all content (e.g. enable_thinking=False, whose template closed the block in
    the prompt). With starts_in_reasoning the output is reasoning from its first character (the
    prompt opened <think>), and a repeated <think> there is dropped. Whitespace around the
    reasoning and at the start of the answer is trimmed, as the chat templates trim it when the
    message comes back. A tag split across deltas is held until it is complete.
    """

    def __init__(self, starts_in_reasoning: bool = False, start_tag: str = "<think>",
                 end_tag: str = "</think>") -> None:
        self._start_tag, self._end_tag = start_tag, end_tag
        self.markers = (start_tag, end_tag)
        self._state = _OPENING if starts_in_reasoning else _START
        self._held = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped

    def feed(self, text: str, final: bool) -> list[Event]:
        buffer = self._held + text
        self._held = ""
        events: list[Event] = []
        while True:
            state = self._state
            if state == _CONTENT:
                if buffer:
                    events.append(("content", buffer))
                return events
            if state == _CONTENT_START:
                buffer = buffer.lstrip()
                if buffer:
                    self._state = _CONTENT
                    continue
                return events
            if state in (_START, _OPENING):
                stripped = buffer.lstrip()
                if stripped.startswith(self._start_tag):
                    buffer = stripped[len(self._start_tag):]
                    self._state = _REASONING
                    continue
                if not final and self._start_tag.startswith(stripped):
                    self._held = buffer  # empty, whitespace, or the start of the tag: undecided
                    return events
                self._state = _REASONING if state == _OPENING else _CONTENT
                continue
            # _REASONING
            before, after, held = split_at(buffer, self._end_tag)
            if after is not None:
                self._emit_reasoning(events, before.rstrip())
                self._state = _CONTENT_START
                buffer = after
                continue
            if final:
                self._emit_reasoning(events, (before + held).rstrip())
                return events
            # Trailing whitespace is held too: it is dropped if </think> follows it.
            body = before.rstrip()
            self._held = before[len(body):] + held
            self._emit_reasoning(events, body)
            return events

    def _emit_reasoning(self, events: list[Event], text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return
            self._reasoning_started = True
        if text:
            events.append(("reasoning_content", text))
