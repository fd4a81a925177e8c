"""A `python -m rawserve` started by a test: the port it announces on stderr."""
from __future__ import annotations

import re
import subprocess
import time

# The startup summary's "... listening on http://127.0.0.1:PORT/v1, ...", the last of the start-up lines (the http
# layer's own "listening on" line, without /v1, comes just before it).
_LISTENING = re.compile(r"listening on https?://127\.0\.0\.1:(\d+)/v1")


def listening_port(proc: subprocess.Popen, lines: list[str] | None = None, timeout_s: float = 120) -> int:
    """Read the server's stderr (text mode) up to its startup summary and return the port; every line read is
    appended to `lines`. Fails, with what it wrote, if the server exits or says nothing of the kind in time."""
    lines = [] if lines is None else lines
    deadline = time.monotonic() + timeout_s
    while True:
        line = proc.stderr.readline()
        assert line and time.monotonic() < deadline, "server exited before serving:\n" + "".join(lines)
        lines.append(line)
        match = _LISTENING.search(line)
        if match:
            return int(match.group(1))
