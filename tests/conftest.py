"""Shared test fixtures: paths to ../shared/fixtures and tiny checkpoint builders."""
from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return FIXTURES


def fixture_path(*parts: str) -> pathlib.Path:
    """A path under ../shared/fixtures, or a clean skip when it is absent."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"fixture {path} is absent")
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """A 2-layer random Qwen3 checkpoint (vocab 256, hidden 64, 4 heads, 2 KV heads, head_dim 32)."""
    from tests.checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")
