"""The triton attention backend: its kernel and engine cases (tests/engine/triton/) run in a subprocess, on a CPU
under TRITON_INTERPRET=1 (it must be set before triton is imported, and must not leak into this process), on
CUDA tensors when a GPU is present. Here too: the backend refuses what it cannot run, with the flag named.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rawserve.config import EngineConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
CASES = pathlib.Path(__file__).resolve().parent / "triton"


def run_cases(name: str) -> None:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(CASES / name)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # triton's bindings print reference-leak notes at interpreter exit: noise, kept out of the report
    def clean(text: str) -> list[str]:
        return [line for line in text.splitlines() if "leaked" not in line and not line.startswith(" - ")]

    out = clean(proc.stdout)
    report = "\n".join(out[-40:] + clean(proc.stderr)[-20:])
    assert proc.returncode == 0, report
    summary = out[-1] if out else ""
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, report

def test_kernels_match_their_torch_references():
    run_cases("kernel_cases.py")


def test_engine_on_triton_gives_the_torch_backends_greedy_ids():
    run_cases("backend_cases.py")


def test_triton_on_cpu_without_the_interpreter_is_refused_before_loading(tiny_qwen3_dir):
    from rawserve.engine.attention import triton_kernels
    from rawserve.engine.model_runner import ModelRunner

    if triton_kernels.interpreted() or torch.cuda.is_available():
        pytest.skip("this process runs triton kernels on CPU tensors here")
    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", attention_backend="triton", num_kv_blocks=8)
    with pytest.raises(ValueError, match="--attention-backend: triton on a CPU runs only under TRITON_INTERPRET=1"):
        ModelRunner(config)


def test_triton_refuses_a_head_dim_its_kernels_cannot_tile(tmp_path):
    from rawserve.engine.model_runner import ModelRunner
    from tests.checkpoints import make_hf_checkpoint

    model_dir = make_hf_checkpoint(tmp_path, "qwen3", head_dim=24)
    config = EngineConfig(model_dir=str(model_dir), device="cpu", attention_backend="triton", num_kv_blocks=8)
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 24"):
        ModelRunner(config)
