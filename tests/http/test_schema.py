"""schema.parse: decoded JSON → dataclasses, with 400s that name the param path."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from rawserve.errors import APIError
from rawserve.http.schema import parse


@dataclass
class TextPart:
    type: Literal["text"]
    text: str


@dataclass
class ImagePart:
    type: Literal["image_url"]
    image_url: dict[str, str]


@dataclass
class Message:
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None


@dataclass
class Chat:
    model: str
    messages: list[Message]
    temperature: float = 1.0
    max_tokens: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] = field(default_factory=dict)
    extra: Any = None


@dataclass
class Tree:
    value: int
    children: list[Tree] = field(default_factory=list)


@dataclass
class Range:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low must not exceed high")


def error_of(cls: type, obj: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse(cls, obj)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def test_valid_body_builds_nested_dataclasses_with_defaults():
    chat = parse(Chat, {"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "image_url", "image_url": {"url": "http://x"}}]},
    ], "stop": ["a", "b"], "logit_bias": {"12": -1}})
    assert chat.model == "m" and chat.temperature == 1.0 and chat.max_tokens is None
    assert chat.messages[0] == Message("user", "hi")
    assert chat.messages[1].content == [TextPart("text", "a"), ImagePart("image_url", {"url": "http://x"})]
    assert chat.stop == ["a", "b"]
    assert chat.logit_bias == {"12": -1.0} and type(chat.logit_bias["12"]) is float


def test_unknown_fields_are_ignored():
    chat = parse(Chat, {"model": "m", "messages": [], "frobnicate": [1, 2], "user": "x"})
    assert chat == Chat("m", [])


def test_missing_required_field_names_its_path():
    error = error_of(Chat, {"model": "m", "messages": [{"content": "x"}]})
    assert error.param == "messages.0.role"
    assert "messages.0.role" in error.message
    assert error_of(Chat, {"messages": []}).param == "model"


def test_wrong_type_deep_in_a_list_names_the_index():
    error = error_of(Chat, {"model": "m", "messages": [
        {"role": "user", "content": "ok"}, {"role": "user", "content": "ok"},
        {"role": "user", "content": 5}]})
    assert error.param == "messages.2.content"
    assert error.to_dict()["error"]["param"] == "messages.2.content"


def test_bool_is_not_accepted_as_int():
    assert error_of(Chat, {"model": "m", "messages": [], "max_tokens": True}).param == "max_tokens"


def test_float_is_not_accepted_as_int():
    assert error_of(Chat, {"model": "m", "messages": [], "max_tokens": 3.0}).param == "max_tokens"


def test_int_is_accepted_as_float():
    chat = parse(Chat, {"model": "m", "messages": [], "temperature": 0})
    assert chat.temperature == 0.0 and type(chat.temperature) is float


def test_bool_is_not_accepted_as_float():
    assert error_of(Chat, {"model": "m", "messages": [], "temperature": False}).param == "temperature"


def test_null_needs_an_optional_type():
    assert parse(Chat, {"model": "m", "messages": [], "max_tokens": None}).max_tokens is None
    assert error_of(Chat, {"model": "m", "messages": [], "temperature": None}).param == "temperature"


def test_literal_rejects_other_values_and_names_them():
    error = error_of(Chat, {"model": "m", "messages": [{"role": "bot"}]})
    assert error.param == "messages.0.role"
    assert "'bot'" in error.message and "'user'" in error.message


def test_literal_does_not_confuse_true_with_one():
    @dataclass
    class One:
        x: Literal[1]
    # Defined in a function: annotations are resolved from the module, where Literal is known.
    assert parse(One, {"x": 1}).x == 1
    assert error_of(One, {"x": True}).param == "x"


def test_union_reports_the_member_that_got_furthest():
    error = error_of(Chat, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]})
    assert error.param == "messages.0.content.0.image_url.url"


def test_union_with_no_matching_kind_lists_the_options():
    error = error_of(Chat, {"model": "m", "messages": [], "stop": 7})
    assert error.param == "stop"
    assert "a string or an array or null" in error.message


def test_dict_values_are_checked_with_the_key_in_the_path():
    assert error_of(Chat, {"model": "m", "messages": [], "logit_bias": {"5": "x"}}).param == "logit_bias.5"


def test_list_field_rejects_an_object():
    assert error_of(Chat, {"model": "m", "messages": {"role": "user"}}).param == "messages"


def test_any_field_takes_anything():
    assert parse(Chat, {"model": "m", "messages": [], "extra": {"a": [1, None]}}).extra == {"a": [1, None]}


def test_recursive_dataclass_parses_and_names_deep_paths():
    tree = parse(Tree, {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]})
    assert tree.children[0].children[0].value == 3
    assert error_of(Tree, {"value": 1, "children": [{"value": 2, "children": [{"value": "x"}]}]}).param == \
        "children.0.children.0.value"


def test_post_init_value_error_becomes_a_400():
    error = error_of(Range, {"low": 3, "high": 1})
    assert "low must not exceed high" in error.message
    assert parse(Range, {"low": 1, "high": 3}) == Range(1, 3)


def test_body_that_is_not_an_object_is_a_400():
    error = error_of(Chat, [1, 2])
    assert error.param is None and "JSON object" in error.message


def test_unsupported_annotation_is_a_programming_error_not_a_400():
    @dataclass
    class Bad:
        x: tuple[int, int]
    with pytest.raises(TypeError):
        parse(Bad, {"x": [1, 2]})


@dataclass
class Ids:
    tokens: list[int]
    flags: list[bool] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)


def test_scalar_lists_are_checked_whole_and_a_misfit_is_named_by_its_index():
    ids = list(range(10_000))
    assert parse(Ids, {"tokens": ids}).tokens == ids
    assert parse(Ids, {"tokens": []}).tokens == []
    # True is a bool, not an int, even inside a long list; 2.0 is a number, not an integer.
    for bad in (True, 2.0, "3", None):
        error = error_of(Ids, {"tokens": ids[:7_000] + [bad] + ids[7_000:]})
        assert error.param == "tokens.7000", bad
    assert error_of(Ids, {"tokens": [1], "flags": [True, 0]}).param == "flags.1"
    assert error_of(Ids, {"tokens": [1], "prompts": [[1, 2], [3, False]]}).param == "prompts.1.1"
    assert error_of(Chat, {"model": "m", "messages": [], "stop": ["a", "b", 3]}).param == "stop.2"  # inside a union
