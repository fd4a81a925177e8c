"""A live server on the demo checkpoint for the API contract tests: the model on disk, then a ServerThread."""
from __future__ import annotations

import pathlib
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
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", **(server or {})))
    try:
        yield srv
    finally:
        srv.stop()
