"""A gpt-oss-shaped tokenizer built here (o200k_harmony cannot be downloaded): byte-level BPE, gpt-oss's special
tokens at their real ids, 201,088 ids in all, and the fixture's harmony chat template. Its ids for text are not
o200k's; its ids for the harmony markers are."""
from __future__ import annotations

import json
import pathlib

from tests.checkpoints import added_tokens_decoder, qwen_like_vocab, write_bpe_tokenizer_json

HARMONY_REGULAR_TOKENS = 199998  # o200k: ids below this are byte-level BPE tokens
HARMONY_VOCAB_SIZE = 201088  # gpt-oss's config.json vocab_size: the added tokens run up to it
# gpt-oss's named added tokens (tokenizer_config.json added_tokens_decoder); every other id from 199998 to 201087 is
# <|reserved_ID|>.
HARMONY_SPECIAL_IDS = {
    "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
    "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012,
    "<|endofprompt|>": 200018,
}
# generation_config.json of gpt-oss-20b: <|return|>, <|endoftext|>, <|call|>.
HARMONY_EOS_IDS = [200002, 199999, 200012]
# o200k's pre-tokenizer split (tiktoken's o200k_base pattern), before the byte-level mapping.
_O200K_SPLIT = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def harmony_template() -> str:
    """gpt-oss's chat template (the fixture when present, as the checkpoint ships it)."""
    from tests.conftest import fixture_path

    return fixture_path("chat_templates", "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")


def harmony_added_tokens() -> list[tuple[int, str]]:
    """(id, text) of every added token, 199998..201087."""
    names = {i: text for text, i in HARMONY_SPECIAL_IDS.items()}
    return [(i, names.get(i, f"<|reserved_{i}|>")) for i in range(HARMONY_REGULAR_TOKENS, HARMONY_VOCAB_SIZE)]


def write_harmony_tokenizer(directory: str | pathlib.Path, chat_template: str | None = None) -> pathlib.Path:
    """tokenizer.json and tokenizer_config.json as gpt-oss ships them (bos <|startoftext|>, eos <|return|>, pad
    <|endoftext|>, every added token special), with `chat_template` or the fixture's harmony template."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = qwen_like_vocab(HARMONY_REGULAR_TOKENS - 256)
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in harmony_added_tokens()]
    write_bpe_tokenizer_json(directory, vocab, merges, added, _O200K_SPLIT, None)
    decoder = added_tokens_decoder(added)
    config = {"added_tokens_decoder": decoder, "bos_token": "<|startoftext|>",
              "chat_template": harmony_template() if chat_template is None else chat_template,
              "clean_up_tokenization_spaces": False, "eos_token": "<|return|>", "extra_special_tokens": {},
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 1000000000000000019884624838656,
              "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                     encoding="utf-8")
    return directory
