"""A short soak in CI (issue 13) after the hostile run's catalog (issue 33), against one real server with a spawned
core: first every catalog input of bench/hostile.py once, each answered with its 4xx in OpenAI's shape or a clean
answer, never a 5xx, and the engine answering an ordinary request after every one of them; then bench/soak.py's
mixed traffic (clients leaving mid-stream, slow readers, malformed and oversized requests, readers that never read)
for 8 s. Every check of the full soak must hold at the end, and the server exits with status 0."""
from __future__ import annotations

import os

import pytest


def test_the_hostile_catalog_then_a_short_soak_leave_nothing_behind():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("the soak reads the server's RSS from /proc")
    from bench.soak import run

    # 8 s gave 367 normal completions on a 2-core box
    result = run(seconds=8, concurrency=48, seed=1, catalog_first=True)
    assert result["catalog_failures"] == [], result["catalog_failures"]
    assert result["checks"]["hostile_catalog_held"]
    assert result["exit_status"] == 0, result
    assert result["passed"], result
    kinds = result["clients"]
    assert {"normal", "leave_mid_stream", "malformed"} <= set(kinds)  # the mix really ran
    assert result["normal_ok"] >= 20
