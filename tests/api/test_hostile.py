"""The hostile run's inputs (issue 33, bench/hostile.py's catalog) against a real server with a spawned core: each
gets its 4xx in OpenAI's shape or a clean answer, never a 5xx, and the engine answers an ordinary request after
every one of them."""
from __future__ import annotations

import asyncio

from bench import hostile
from bench.client import get_json
from bench.soak import Child
from tests.api.demo_server import demo_dir


def test_every_hostile_input_is_answered_and_the_engine_survives():
    child = Child(str(demo_dir()))
    try:
        async def run() -> list[dict]:
            _, models = await get_json("127.0.0.1", child.port, "/v1/models")
            return await hostile.run_catalog("127.0.0.1", child.port, models["data"][0]["id"])

        failures = asyncio.run(run())
    finally:
        status = child.stop()
    assert failures == []
    assert status == 0
