"""gpt-oss's harmony output, messages `<|channel|>NAME [to=RECIPIENT] [<|constrain|>TYPE]<|message|>BODY<|end|>`:
analysis is reasoning, final (and a commentary preamble) content, a message to `functions.NAME` a tool call with BODY
as its arguments. Pure string logic; must not import engine, http or api."""
from __future__ import annotations

from rawserve.text.parsers.base import Event, partial_suffix
from rawserve.text.parsers.tool_call import new_call_id

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
BODY_ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."
# A header is a role, a channel name, a recipient and a content type: a few words. Text that runs longer without
# <|message|>, or that has a line break, is no header: the model is not writing harmony, and it is shown as content.
MAX_HEADER_CHARS = 256
_LONGEST_MARKER = max(map(len, MARKERS))

_HEADER, _BODY, _BETWEEN, _PLAIN = range(4)


def _earliest(buffer: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(position, tag) of the first of `tags` in buffer, or (-1, "")."""
    found = (-1, "")
    for tag in tags:
        p = buffer.find(tag)
        if p >= 0 and (found[0] < 0 or p < found[0]):
            found = (p, tag)
    return found


def _held_back(buffer: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buffer that may begin one of `tags` (each starts with "<")."""
    if "<" not in buffer[-_LONGEST_MARKER:]:  # most deltas: no tag can be starting
        return 0
    return max(partial_suffix(buffer, tag) for tag in tags)


def strip_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


class Header:
    """One message's header as the model wrote it, between <|start|> (or the prompt's `<|start|>assistant`) and
    <|message|>: `assistant to=functions.f<|channel|>commentary json` or `<|channel|>commentary to=functions.f
    <|constrain|>json` (the recipient goes either side of the channel). The content type (json) is not read: a
    call's body is its arguments whatever it says."""

    __slots__ = ("channel", "recipient")

    def __init__(self, text: str) -> None:
        self.channel = self.recipient = ""
        # The channel's name is the first word after <|channel|>; the recipient is a `to=` word anywhere.
        p = text.find(CHANNEL)
        if p >= 0:
            words = strip_markers(text[p + len(CHANNEL):].split(CONSTRAIN, 1)[0]).split()
            self.channel = words[0] if words else ""
        for word in strip_markers(text.replace(CONSTRAIN, " ").replace(CHANNEL, " ")).split():
            if word.startswith("to="):
                self.recipient = word[3:]

    @property
    def function(self) -> str | None:
        """The function a message to `functions.NAME` calls; None for any other message."""
        if self.recipient.startswith(FUNCTIONS) and len(self.recipient) > len(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None


class HarmonyParser:
    """Harmony messages to reasoning_content, content and tool-call events, as text streams in.

    The output starts inside a header (the prompt ends with `<|start|>assistant`). Per message: the analysis
    channel, and a message to any recipient that is not turned into a call (a built-in tool's, or a function's
    when `parse_calls` is off), are reasoning; a message to `functions.NAME` is a call when `parse_calls` is on,
    its body streamed as the arguments (`{}` when empty); anything else (final, commentary preambles, a missing
    channel) is content. Markers never reach content or reasoning: a marker split across deltas is held until it
    is whole. Output that never writes a header (no <|message|> within MAX_HEADER_CHARS, or a line break first)
    is plain content from then on, with any marker text removed.
    """

    markers = MARKERS

    def __init__(self, parse_calls: bool = True) -> None:
        self.parse_calls = parse_calls
        self._state = _HEADER
        self._held = ""
        self._kind = ""  # the current body's event: content, reasoning_content or args
        self._num_calls = 0
        self._args_sent = False

    def feed(self, text: str, final: bool) -> list[Event]:
        buffer = self._held + text
        self._held = ""
        events: list[Event] = []
        while True:
            state = self._state
            if state == _PLAIN:
                self._held = buffer
                self._emit_plain(events, final)
                return events
            if state == _HEADER:
                p = buffer.find(MESSAGE)
                head = buffer if p < 0 else buffer[:p]
                if "\n" in strip_markers(head) or len(head) > MAX_HEADER_CHARS:
                    self._state = _PLAIN
                    continue
                if p < 0:
                    if final and not any(m in head for m in MARKERS):
                        self._state = _PLAIN  # a short answer in no harmony at all
                        continue
                    if not final:
                        self._held = buffer
                    return events  # else a header cut off by the end of the output: nothing to show
                self._open(events, Header(head))
                self._state, buffer = _BODY, buffer[p + len(MESSAGE):]
                continue
            if state == _BODY:
                p, tag = _earliest(buffer, BODY_ENDS)
                if p >= 0:
                    self._body(events, buffer[:p])
                    self._close(events)
                    self._state, buffer = _BETWEEN, buffer[p + len(tag):]
                    continue
                keep = 0 if final else _held_back(buffer, MARKERS)
                self._body(events, buffer[:len(buffer) - keep])
                self._held = buffer[len(buffer) - keep:]
                if final:
                    self._close(events)
                return events
            # _BETWEEN: after a message, up to the next <|start|> (or a header begun without one)
            p, tag = _earliest(buffer, (START, CHANNEL))
            if p >= 0:
                self._stray(events, buffer[:p])
                self._state = _HEADER
                buffer = buffer[p + len(START):] if tag == START else buffer[p:]
                continue
            keep = 0 if final else _held_back(buffer, MARKERS)
            self._stray(events, buffer[:len(buffer) - keep])
            self._held = buffer[len(buffer) - keep:]
            return events

    def _open(self, events: list[Event], header: Header) -> None:
        name = header.function
        if name is not None and self.parse_calls:
            self._kind, self._args_sent = "args", False
            events.append(("call", self._num_calls, new_call_id(), name))
        elif header.recipient or header.channel == "analysis":
            self._kind = "reasoning_content"
        else:
            self._kind = "content"

    def _body(self, events: list[Event], text: str) -> None:
        text = strip_markers(text)  # a header marker inside a body (<|start|>, <|channel|>) is not text either
        if not text:
            return
        if self._kind == "args":
            if not self._args_sent:
                text = text.lstrip()
                if not text:
                    return
            self._args_sent = True
            events.append(("args", self._num_calls, text))
        else:
            events.append((self._kind, text))

    def _close(self, events: list[Event]) -> None:
        if self._kind == "args":
            if not self._args_sent:
                events.append(("args", self._num_calls, "{}"))
            self._num_calls += 1
        self._kind = ""

    def _stray(self, events: list[Event], text: str) -> None:
        """Text between messages that is not whitespace: shown, since dropping what a model wrote hides a fault."""
        text = strip_markers(text)
        if text.strip():
            events.append(("content", text))

    def _emit_plain(self, events: list[Event], final: bool) -> None:
        buffer = self._held
        keep = 0 if final else _held_back(buffer, MARKERS)
        text = strip_markers(buffer[:len(buffer) - keep])
        self._held = buffer[len(buffer) - keep:]
        if text:
            events.append(("content", text))
