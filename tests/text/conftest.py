"""Session-scoped tokenizers: the real ones from ../shared/fixtures (each loads once; they skip when absent) and
the Qwen3-shaped one built in tests/conftest.py."""
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


@pytest.fixture(scope="session")
def large_vocab_tokenizer(large_vocab_tokenizer_dir) -> Tokenizer:
    """The Qwen3-shaped tokenizer built in tests/conftest.py: present in every clone."""
    return Tokenizer.from_dir(large_vocab_tokenizer_dir)
