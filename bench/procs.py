"""Servers the side-by-side benchmarks start: a free loopback port, and the wait until one answers its health path."""
from __future__ import annotations

import http.client
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, name: str = "the server", path: str = "/health",
                 timeout_s: float = 600) -> None:
    """Until `path` answers 200 (rawserve's /health does while the model loads, its /ready once it serves;
    llama-server's /health once its model is in); RuntimeError if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was healthy")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{name} was not healthy within {timeout_s:.0f} s")
