"""Processes that built an engine end quietly: EngineCore's gc.freeze() is undone when the core's loop ends and
when the test run ends, so triton's bindings find nothing to report as leaked at interpreter exit (their
`nanobind: leaked ...` lines would otherwise follow a server's last log line, and pytest's summary)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# triton is loaded first, as the triton attention backend (or transformers, in a test run) loads it.
SERVER = """
import asyncio
import triton
from rawserve.api.app import OpenAIServer
from rawserve.config import EngineConfig, ServerConfig

async def main():
    server = OpenAIServer(EngineConfig(model_dir={model_dir!r}, num_kv_blocks=16, max_model_len=128),
                          ServerConfig(port=0, engine_mode="thread"))
    await server.start()
    await server.stop()
    print("stopped")

asyncio.run(main())
"""

ENGINE_TEST = """
import triton
from rawserve.config import EngineConfig
from rawserve.engine.core import make_engine_core

def test_build_an_engine():
    make_engine_core(EngineConfig(model_dir={model_dir!r}, num_kv_blocks=16, max_model_len=128))
"""


@pytest.fixture(scope="module")
def model_dir() -> str:
    pytest.importorskip("triton")
    from rawserve.demo_model import ensure_demo_model

    return str(ensure_demo_model())


def test_a_server_whose_core_loaded_triton_exits_without_leak_reports(model_dir):
    out = subprocess.run([sys.executable, "-c", SERVER.format(model_dir=model_dir)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.split() == ["stopped"], out.stderr
    assert "nanobind" not in out.stderr, out.stderr[-2000:]


def test_the_pytest_summary_is_the_last_line_after_tests_that_build_engines(model_dir, tmp_path):
    (tmp_path / "test_engine.py").write_text(ENGINE_TEST.format(model_dir=model_dir))
    # This project's pytest settings and conftest (whose exit hook is under test), on a test file of its own.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pyproject.toml",
                          "-p", "tests.conftest", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "nanobind" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == "" and " passed" in out.stdout.strip().splitlines()[-1], out.stdout + out.stderr
