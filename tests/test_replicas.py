"""bench.replicas, short: three real replicas behind a real smg router on loopback.

cache_aware routing keeps each user's later turns on the replica holding its system prompt (they are served from
its prefix cache); a SIGKILLed replica is routed around; a SIGTERMed one loses none of its in-flight requests.
"""
from __future__ import annotations

import argparse
import shutil

import pytest

if shutil.which("smg") is None:
    pytest.skip("smg (the router, a test extra) is not installed", allow_module_level=True)

from bench import replicas as bench  # noqa: E402


def test_cache_aware_routing_and_failover_through_smg(capsys):
    args = argparse.Namespace(replicas=3, users=3, turns=2, system_words=80, max_tokens=4, concurrency=3,
                              kv_blocks=256, engine_mode="thread")  # thread: a quicker start on 2 cores
    servers = bench.start_replicas(3, args)
    try:
        router = bench.Router(servers, "cache_aware")
        try:
            results, wall_s = bench.run_workload(router.port, "ci", args)
        finally:
            router.stop()
        assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
        by_user = {}
        for r in sorted(results, key=lambda r: r["turn"]):
            by_user.setdefault(r["user"], []).append(r)
        for turns in by_user.values():
            first, second = turns
            # the whole first turn's prompt (in full blocks) comes from the prefix cache of the replica it went to
            assert second["cached_tokens"] >= (first["prompt_tokens"] // 16) * 16 - 16, (first, second)
        line = bench.failover(servers, args)
    finally:
        for server in servers:
            server.stop()
    killed, sigterm = line["killed"], line["sigterm"]
    assert killed["failed_sent_after_kill"] <= 1 and killed["requests"] > killed["failed"]
    assert sigterm["in_flight_at_signal"] > 0 and sigterm["exit_status"] == 0
    assert sigterm["lost"] == 0 and sigterm["requests_during_drain"] > 0
    assert '"phase": "failover"' in capsys.readouterr().out
