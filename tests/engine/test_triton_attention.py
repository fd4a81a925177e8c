"""The triton attention backend: its kernel and engine cases (tests/engine/triton/) run in a subprocess (one for
every case file of the session, tests/conftest.py triton_case_result), on a CPU under TRITON_INTERPRET=1 (it must
be set before triton is imported, and must not leak into this process), on CUDA tensors when a GPU is present.
Here too: the backend refuses what it cannot run, with the flag named.
"""
from __future__ import annotations

import pytest
import torch

from rawserve.config import EngineConfig


@pytest.mark.triton_cases("kernel_cases.py")
def test_kernels_match_their_torch_references(triton_case_result):
    assert triton_case_result.passed and not triton_case_result.problems, "\n".join(triton_case_result.problems)


@pytest.mark.triton_cases("backend_cases.py")
def test_engine_on_triton_gives_the_torch_backends_greedy_ids(triton_case_result):
    assert triton_case_result.passed and not triton_case_result.problems, "\n".join(triton_case_result.problems)


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
