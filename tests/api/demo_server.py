"""A live server on the demo checkpoint for the API contract tests: the model on disk, then a ServerThread."""
from __future__ import annotations

import json
import pathlib
import socket
from collections.abc import Iterator

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread

MODEL = "demo"


def demo_dir() -> pathlib.Path:
    from rawserve.demo_model import ensure_demo_model

    return ensure_demo_model()


def serve_demo(engine: dict, server: dict | None = None) -> Iterator[ServerThread]:
    """A fixture body: the demo model served as MODEL (engine in a thread, float32 unless told), stopped after."""
    srv = ServerThread(EngineConfig(model_dir=str(demo_dir()), device="cpu", **{"dtype": "float32", **engine}),
                       ServerConfig(port=0, served_model_name=MODEL, **{"engine_mode": "thread", **(server or {})}))
    try:
        yield srv
    finally:
        srv.stop()


def exchange(server: ServerThread, path: str, body: dict, headers: str = "") -> tuple[int, dict[str, str], bytes]:
    """POST `body` as JSON on a fresh connection -> (status, lowercased response headers, response body)."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(payload)}\r\n{headers}"
                     "connection: close\r\n\r\n".encode() + payload)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), dict(line.lower().split(": ", 1) for line in lines[1:]), rest


def dechunk(payload: bytes) -> bytes:
    """A chunked body (as `exchange` returns it) -> its bytes."""
    out = b""
    while True:
        size, _, rest = payload.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out += rest[:n]
        payload = rest[n + 2:]
