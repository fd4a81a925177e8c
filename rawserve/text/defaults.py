"""Generation defaults: generation_config.json's sampling fields and end-of-sequence ids; the tool-call parser
a chat template implies.

A request that leaves a sampling field unset gets the checkpoint authors' value (e.g. Qwen3's
temperature 0.6), not OpenAI's. Reads files only; it must not import engine, http or api.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rawserve.text.tokenizer import read_json_object

if TYPE_CHECKING:
    from rawserve.text.tokenizer import Tokenizer

# field -> (type accepted, lowest value, lowest is exclusive)
_FIELDS: dict[str, tuple[type, float, bool]] = {
    "temperature": (float, 0.0, False),
    "top_p": (float, 0.0, True),
    "top_k": (int, -1, False),
    "min_p": (float, 0.0, False),
    "repetition_penalty": (float, 0.0, True),
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults (None: the checkpoint does not set it) and the default stop token ids.

    `do_sample` is deliberately not interpreted, as in vLLM: only the listed values are used.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike, tokenizer: Tokenizer | None = None) -> GenerationDefaults:
        """Read generation_config.json. eos_token_ids fall back to config.json, then to the
        tokenizer's eos (the tokenizer is loaded from model_dir if not given and needed)."""
        model_dir = os.fspath(model_dir)
        gen_path = os.path.join(model_dir, "generation_config.json")
        gen = read_json_object(gen_path)
        values: dict[str, Any] = {name: _field(gen, name, gen_path) for name in _FIELDS}
        eos = _eos_ids(gen, gen_path)
        if not eos:
            config_path = os.path.join(model_dir, "config.json")
            config = read_json_object(config_path)
            eos = _eos_ids(config, config_path)
            text_config = config.get("text_config")
            if not eos and isinstance(text_config, dict):
                eos = _eos_ids(text_config, config_path + " text_config")
        if not eos:
            if tokenizer is None and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
                from rawserve.text.tokenizer import Tokenizer

                tokenizer = Tokenizer.from_dir(model_dir)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos = (tokenizer.eos_token_id,)
        if tokenizer is not None:
            eos = harmony_stop_ids(eos, tokenizer)
        return cls(eos_token_ids=eos, **values)

    def as_dict(self) -> dict[str, Any]:
        """The sampling fields that are set, by SamplingParams' names."""
        return {name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None}


def _field(data: dict, name: str, source: str) -> float | int | None:
    value = data.get(name)
    if value is None:
        return None
    kind, low, exclusive = _FIELDS[name]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (kind is int and not float(value).is_integer()):
        raise ValueError(f"{source}: {name} must be a number, got {value!r}")
    if value < low or (exclusive and value == low):
        raise ValueError(f"{source}: {name} must be {'>' if exclusive else '>='} {low}, got {value!r}")
    if name == "top_p" and value > 1 or name == "min_p" and value > 1:
        raise ValueError(f"{source}: {name} must be <= 1, got {value!r}")
    return int(value) if kind is int else float(value)


def _eos_ids(data: dict, source: str) -> tuple[int, ...]:
    value = data.get("eos_token_id")
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{source}: eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return tuple(dict.fromkeys(items))  # ordered, without repeats


def harmony_stop_ids(eos: tuple[int, ...], tokenizer: Tokenizer) -> tuple[int, ...]:
    """A harmony model (gpt-oss) ends its answer with <|return|> and a tool call with <|call|>: where <|return|>
    is an eos id, <|call|> is one too (vLLM's harmony stop tokens), since a checkpoint whose generation_config
    lists only <|return|> (config.json's eos) would otherwise run on past every call it makes."""
    returns, call = tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")
    if returns is None or call is None or returns not in eos or call in eos:
        return eos
    return (*eos, call)


def tool_call_parser_for(name: str, chat_template: str | None) -> str:
    """--tool-call-parser as served: a parser's name is kept; "auto" is the form the chat template teaches the
    model to write. Qwen3.5's and Qwen3-Coder's templates spell out `<function=NAME>` and `<parameter=KEY>`
    (the XML form, qwen3_coder); gpt-oss's writes harmony messages (`<|channel|>…<|message|>`, a call is a
    message `to=functions.NAME`: openai); any other template, or none, gets hermes (JSON inside <tool_call>)."""
    if name != "auto":
        return name
    if chat_template is not None and "<|channel|>" in chat_template and "<|message|>" in chat_template:
        return "openai"
    if chat_template is not None and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    return "hermes"
