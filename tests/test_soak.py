"""A short soak in CI (issue 13): bench/soak.py's mixed traffic (clients leaving mid-stream, slow readers, malformed
and oversized requests, readers that never read) for 8 s against a real server with a spawned core; every check
of the full soak must hold at the end."""
from __future__ import annotations

import os

import pytest


def test_a_short_soak_leaves_nothing_behind():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("the soak reads the server's RSS from /proc")
    from bench.soak import run

    result = run(seconds=8, concurrency=48, seed=1)  # 8 s gave 367 normal completions on a 2-core box
    assert result["passed"], result
    kinds = result["clients"]
    assert {"normal", "leave_mid_stream", "malformed"} <= set(kinds)  # the mix really ran
    assert result["normal_ok"] >= 20
