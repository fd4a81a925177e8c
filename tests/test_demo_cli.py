"""`rawserve demo` end to end: it builds nothing new (the demo model is cached), starts a real server with the
core in its own process, and prints JSON lines that parse and say what happened, and not one warning, on a base
install (no numpy)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_rawserve_demo_prints_parseable_json_lines_for_every_step(numpy_absent_env):
    from rawserve.demo_model import ensure_demo_model

    ensure_demo_model()  # built once per machine; the demo then only reads it
    out = subprocess.run([sys.executable, "-m", "rawserve", "demo", "--requests", "6", "--new-tokens", "8"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **numpy_absent_env})
    assert out.returncode == 0, out.stderr
    # Its stderr shows the server's warnings and errors: a normal run, stopped by the demo's SIGTERM, has none.
    assert not [line for line in out.stderr.splitlines() if " WARNING " in line or "Warning:" in line], out.stderr
    steps = {}
    for line in out.stdout.splitlines():
        obj = json.loads(line)  # stdout is JSON lines and nothing else
        steps[obj["step"]] = obj
    assert list(steps) == ["models", "tool_call", "stream", "concurrent", "metrics"]
    assert steps["models"]["models"] == ["rawserve-demo"]
    call = steps["tool_call"]
    assert [c["name"] for c in call["tool_calls"]] == ["get_weather"]
    assert isinstance(call["tool_calls"][0]["arguments"]["city"], str) and call["usage"]["completion_tokens"] > 0
    stream = steps["stream"]
    assert stream["ends_with_done"] and stream["num_events"] >= 3
    assert stream["first_event"]["object"] == "text_completion" and stream["last_event"]["usage"]["completion_tokens"] == 8
    concurrent = steps["concurrent"]
    assert concurrent["requests"] == 6 and concurrent["output_tokens"] == 6 * 8
    assert concurrent["output_tok_s"] > 0 and 0 < concurrent["ttft_p50_ms"] <= concurrent["ttft_max_ms"]
    metrics = "\n".join(steps["metrics"]["lines"])
    assert 'rawserve:request_success_total{model_name="rawserve-demo",finished_reason="length"}' in metrics
    assert "rawserve:generation_tokens_total" in metrics


def test_demo_flags_are_strict_and_checked_before_anything_starts(capsys):
    from rawserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--request", "3"])  # a prefix of --requests: refused, not guessed
    assert exit_info.value.code == 2
    assert "rawserve does not support --request (did you mean --requests?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--new-tokens", "0"])
    assert "--requests and --new-tokens must be >= 1" in capsys.readouterr().err
