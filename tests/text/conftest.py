"""Session-scoped real tokenizers from ../shared/fixtures (each loads once; they skip when absent)."""
from __future__ import annotations

import pytest

from rawserve.text.tokenizer import Tokenizer
from tests.conftest import fixture_path


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(fixture_path("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def llama3_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(fixture_path("llama3-tokenizer"))


@pytest.fixture(scope="session")
def stories_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(fixture_path("stories260k"))
