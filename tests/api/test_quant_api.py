"""--quantization through the real command: a server whose spawned core quantizes the demo model serves a
completion, and a bad value is refused at start-up with the flag named."""
from __future__ import annotations

import subprocess
import sys

from tests.test_cli import ROOT, SMALL, Server, demo_dir, post  # noqa: F401 (demo_dir: a fixture)


def test_int8_server_from_the_environment_serves_through_a_spawned_core(demo_dir):
    # RAWSERVE_QUANTIZATION goes through the same flag machinery as --quantization.
    with Server([sys.executable, "-m", "rawserve", "serve", str(demo_dir), "--port", "0", "--engine-mode",
                 "process", "--dtype", "float32", *SMALL], {"RAWSERVE_QUANTIZATION": "int8"}) as server:
        r = post(server.port, "/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "temperature": 0})
        assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"
    log = server.stop()
    assert server.proc.returncode == 0
    summary = next(line for line in log.splitlines() if "serving" in line and "listening on" in line)
    assert "quantization int8 per-channel" in summary, summary
    # The core process quantized every decoder linear (4 per layer, 4 layers) and the LM head.
    assert "rawserve-core rawserve.engine: quantization: int8 per-channel" in log and "17 matrices quantized" in log


def test_an_unknown_quantization_is_a_clean_start_up_error(demo_dir):
    out = subprocess.run([sys.executable, "-m", "rawserve", "serve", str(demo_dir), "--quantization", "int3"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "argument --quantization: invalid choice: 'int3' (choose from 'none', 'int8', 'int4')" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
