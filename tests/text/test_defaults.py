"""Generation defaults: generation_config.json sampling fields and eos ids, with their fallbacks."""
from __future__ import annotations

import json
import shutil

import pytest

from rawserve.text.defaults import GenerationDefaults
from tests.conftest import fixture_path


def _write(directory, name, data) -> None:
    (directory / name).write_text(json.dumps(data))


def test_qwen3_style_generation_config_sets_sampling_defaults_and_eos_list(tmp_path):
    _write(tmp_path, "generation_config.json", {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                "eos_token_id": [151645, 151643], "bos_token_id": 151643})
    defaults = GenerationDefaults.from_dir(tmp_path)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, eos_token_ids=(151645, 151643))
    assert defaults.min_p is None and defaults.repetition_penalty is None
    assert defaults.as_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_all_sampling_fields_are_read_with_their_types(tmp_path):
    _write(tmp_path, "generation_config.json", {"temperature": 1, "top_p": 1, "top_k": 50.0, "min_p": 0.05,
                                                "repetition_penalty": 1.1, "eos_token_id": 7})
    defaults = GenerationDefaults.from_dir(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p, defaults.repetition_penalty) == \
        (1.0, 1.0, 50, 0.05, 1.1)
    assert isinstance(defaults.top_k, int) and isinstance(defaults.temperature, float)
    assert defaults.eos_token_ids == (7,)


def test_eos_falls_back_to_config_json_then_to_the_tokenizer(tmp_path, large_vocab_tokenizer_dir):
    _write(tmp_path, "generation_config.json", {"temperature": 0.7})
    _write(tmp_path, "config.json", {"eos_token_id": [2, 3, 2]})
    assert GenerationDefaults.from_dir(tmp_path).eos_token_ids == (2, 3)
    _write(tmp_path, "config.json", {"text_config": {"eos_token_id": 9}})
    assert GenerationDefaults.from_dir(tmp_path).eos_token_ids == (9,)
    _write(tmp_path, "config.json", {})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(large_vocab_tokenizer_dir / name, tmp_path / name)
    assert GenerationDefaults.from_dir(tmp_path).eos_token_ids == (151645,)


def test_given_tokenizer_is_used_for_the_eos_fallback(tmp_path, large_vocab_tokenizer):
    assert GenerationDefaults.from_dir(tmp_path, large_vocab_tokenizer) == GenerationDefaults(eos_token_ids=(151645,))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()  # nothing at all: no defaults


def test_stories260k_checkpoint_defaults():
    defaults = GenerationDefaults.from_dir(fixture_path("stories260k"))
    assert defaults == GenerationDefaults(eos_token_ids=(2,))


@pytest.mark.parametrize("data, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p must be > 0"),
    ({"top_p": 1.5}, "top_p must be <= 1"),
    ({"top_k": 2.5}, "top_k must be a number"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id must be"),
    ({"eos_token_id": -1}, "eos_token_id must be"),
])
def test_invalid_values_are_rejected_naming_file_and_field(tmp_path, data, message):
    _write(tmp_path, "generation_config.json", data)
    with pytest.raises(ValueError, match=message) as info:
        GenerationDefaults.from_dir(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_unreadable_generation_config_is_a_clear_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="cannot read"):
        GenerationDefaults.from_dir(tmp_path)
