"""Logging for every rawserve process: one format (set up once per process, the spawned core included) and
progress reports on long work (a bar on a terminal, periodic log lines otherwise).

Standard library only, so the core process, the server and the build scripts can all use it.
"""
from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import TextIO

FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(level: str | int = "info", stream: TextIO | None = None) -> None:
    """Send rawserve's records (and warnings from libraries) to stderr in FORMAT.

    Replaces handlers installed by an earlier call, so a second call changes the level rather than
    doubling every line. Called by the CLI in the server process and by launch.run_core_loop in a
    spawned core, whose records would otherwise be lost: a spawned child starts with no handlers.
    """
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_rawserve", False)]:
        root.removeHandler(old)
    handler._rawserve = True  # type: ignore[attr-defined]  # ours to replace on the next call
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries: warnings only
    logging.getLogger("rawserve").setLevel(level)


def ignore_torch_numpy_warning() -> None:
    """Silence torch's "Failed to initialize NumPy" UserWarning, and only it; call before a process first
    imports torch.

    torch prints it on import wherever numpy is absent, which a base install is: numpy is not a dependency
    and rawserve never hands torch a numpy array, so the line would be noise on every clean start.
    """
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning, module=r"torch\.")


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Progress of one long job, in bytes: `update(n)` as work completes, `close()` at the end.

    On a terminal it redraws one bar line on stderr (at most 10 times a second); otherwise (a log file,
    a container) it logs a line every `log_interval_s`, so the operator still sees it move. The last
    line always gives the total, the time and the rate.
    """

    def __init__(self, label: str, total_bytes: int, logger: logging.Logger, *, stream: TextIO | None = None,
                 log_interval_s: float = 5.0, clock=time.monotonic) -> None:
        self.label = label
        self.total_bytes = max(int(total_bytes), 0)
        self.done_bytes = 0
        self._log = logger
        self._stream = stream if stream is not None else sys.stderr
        self._is_tty = bool(getattr(self._stream, "isatty", lambda: False)()) and logger.isEnabledFor(logging.INFO)
        self._interval_s = 0.1 if self._is_tty else log_interval_s
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self._is_closed = False

    def update(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        now = self._clock()
        if now - self._last >= self._interval_s:
            self._last = now
            self._report(now, final=False)

    def close(self) -> None:
        if not self._is_closed:
            self._is_closed = True
            self._report(self._clock(), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = format_bytes(self.done_bytes / elapsed) + "/s"
        if self.total_bytes:
            pct = 100.0 * self.done_bytes / self.total_bytes
            return (f"{self.label}: {format_bytes(self.done_bytes)} / {format_bytes(self.total_bytes)} "
                    f"({pct:.0f}%) in {elapsed:.1f} s, {rate}")
        return f"{self.label}: {format_bytes(self.done_bytes)} in {elapsed:.1f} s, {rate}"

    def _report(self, now: float, final: bool) -> None:
        text = self.line(now)
        if self._is_tty:
            if final:  # the bar gives way to the log line that records the outcome
                self._stream.write("\r\x1b[K")
            else:
                width = 30
                filled = width if not self.total_bytes else min(width, width * self.done_bytes // self.total_bytes)
                self._stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            self._stream.flush()
            if not final:
                return
        self._log.info("%s", text)
