"""One `python -m rawserve serve` child process on loopback: start it, wait for its port, talk HTTP, stop it.

Shared by bench.replicas and the tests that need a real spawned server (readiness, SIGTERM, metrics).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

_SERVING = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)/v1")


class Replica:
    """A rawserve server in its own process. `args` are `rawserve serve` flags (the port is always 0)."""

    def __init__(self, args: list[str], start_timeout_s: float = 180.0, name: str = "rawserve") -> None:
        self.name = name
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "rawserve", "serve", *args, "--port", "0"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.log: deque[str] = deque(maxlen=400)
        self.port: int | None = None
        self._port_seen = threading.Event()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        if not self._port_seen.wait(start_timeout_s) or self.port is None:
            self.kill()
            raise RuntimeError(f"{name} did not start:\n" + "".join(self.log))

    def _read_stderr(self) -> None:
        # Read to the end: a full stderr pipe would block the server's logging.
        for line in self.proc.stderr:
            self.log.append(line)
            match = _SERVING.search(line)
            if match and self.port is None:
                self.port = int(match.group(1))
                self._port_seen.set()
        self._port_seen.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        """-> (status, lower-cased headers, body), on a fresh connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, payload, {"content-type": "application/json"} if payload else {})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def metrics(self) -> str:
        return self.request("GET", "/metrics")[2].decode()

    def terminate(self) -> None:
        """SIGTERM: the server drains and exits on its own."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        status = self.proc.wait(timeout)
        self._reader.join(5)
        return status

    def kill(self) -> None:
        """SIGKILL (no drain): what a crash or an OOM kill looks like to a router."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status of the SIGTERM."""
        self.terminate()
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
