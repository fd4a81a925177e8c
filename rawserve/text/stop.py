"""Stop strings over streamed text: hold back what could still become a stop string, cut at a match.

The core sees only token ids, so the frontend checks stop strings here. Pure string logic; it must
not import engine, http or api.
"""
from __future__ import annotations

from collections.abc import Iterable


def normalize_stop(stop: Iterable[str] | str | None) -> tuple[str, ...]:
    """A request's stop field (None, one string, or several) as a tuple of non-empty strings.

    The one owner of that rule: SamplingParams and StopChecker both call it.
    """
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop: each stop string must be a non-empty string, got {s!r}")
    return stops


class StopChecker:
    """Feed text deltas, get the part that is safe to show.

    The match is the stop string that completes first in the text (the earliest end; among those
    ending at the same place, the longest). That is what a character-by-character stream would
    find, so the result does not depend on how the text is split into deltas. Text that is a
    prefix of some stop string is held back, so nothing shown is ever taken back.
    """

    __slots__ = ("_stops", "_include", "_held", "_chars", "stopped")

    def __init__(self, stop: Iterable[str] | str | None = None, include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(normalize_stop(stop)))
        self._include = include_stop_str_in_output
        self._held = ""
        # A cheap first test: held text can only end in a character some stop string contains.
        self._chars = frozenset("".join(self._stops))
        self.stopped: str | None = None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def add(self, text: str) -> str:
        """The visible part of held text + text. After a match, the rest is dropped for good."""
        if self.stopped is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text if self._held else text
        if not buffer:
            return ""
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.stopped = stop
            self._held = ""
            return buffer[:start + len(stop)] if self._include else buffer[:start]
        hold = self._hold_length(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def finish(self) -> str:
        """At the end of the stream (no stop string matched): release the held text."""
        held, self._held = self._held, ""
        return "" if self.stopped is not None else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        return None if best is None else (best[0] + best[1], best[2])

    def _hold_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        if buffer[-1] not in self._chars:
            return 0
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[-k:]):
                    longest = k
                    break
        return longest
