"""`parse(Type, obj)`: decoded JSON → an instance of a hand-written dataclass, or APIError 400.

The error names the failing path (`messages.2.content`) in `param`. Strict on types (a bool is
not an int; an int is accepted as a float), lenient on shape (unknown fields are ignored).
It knows no OpenAI field; the API layer writes the dataclasses.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Callable, TypeVar

from rawserve.errors import APIError

T = TypeVar("T")
Converter = Callable[[Any, str], Any]

_CONVERTERS: dict[Any, Converter] = {}
_NONE = type(None)
# JSON kinds as orjson decodes them.
_KIND_NAMES = {_NONE: "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


class FieldError(ValueError):
    """Raised by a schema dataclass's __post_init__ about one of its own fields: parse() answers 400 with
    `param` the field's whole path (`messages.2.content`), which `message` may show as `{param}`."""

    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


def parse(cls: type[T], obj: Any) -> T:
    """Build `cls` (a dataclass) from decoded JSON `obj`; APIError 400 naming the param on a mismatch."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"parse() needs a dataclass, got {cls!r}")
    if not isinstance(obj, dict):
        raise APIError(400, f"The request body must be a JSON object, but got {_kind(obj)} instead.")
    return converter(cls)(obj, "")


def converter(tp: Any) -> Converter:
    """The (cached) function that checks and converts a value of annotation `tp`."""
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _CONVERTERS[tp] = _build(tp)
    return conv


def _kind(value: Any) -> str:
    return _KIND_NAMES.get(type(value), type(value).__name__)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _past_int64(value: Any) -> bool:
    """orjson decodes an integer outside [-2**63, 2**64) as a float: such a value was an integer, out of range."""
    return type(value) is float and value.is_integer() and not -(1 << 63) < value < (1 << 64)  # (-2**63 - 1 rounds)


def _out_of_range(path: str, value: float) -> APIError:
    return APIError(400, f"Invalid value for '{path}': {value:.0f} is out of range for a 64-bit integer.",
                    param=path or None, code="invalid_value")


def _type_error(path: str, expected: str, value: Any) -> APIError:
    return APIError(400, f"Invalid type for '{path}': expected {expected}, but got {_kind(value)} instead.",
                    param=path or None, code="invalid_type")


def _describe(tp: Any) -> str:
    if tp is typing.Any:
        return "any value"
    if dataclasses.is_dataclass(tp):
        return "an object"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(dict.fromkeys(_describe(a) for a in typing.get_args(tp)))  # list[str] | list[int]: once
    return _KIND_NAMES.get(origin or tp, getattr(tp, "__name__", str(tp)))


def _is_union(tp: Any) -> bool:
    return isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union


# Element types whose every valid value has exactly this Python type after orjson decodes it
# (float is absent: an int is accepted as a float and converted).
_EXACT_SCALARS: dict[Any, set[type]] = {int: {int}, str: {str}, bool: {bool}}


def _build(tp: Any) -> Converter:
    if tp is typing.Any or tp is object:
        return lambda value, path: value
    if tp is _NONE or tp is None:
        def none(value: Any, path: str) -> None:
            if value is not None:
                raise _type_error(path, "null", value)
        return none
    if tp is str:
        def string(value: Any, path: str) -> str:
            if type(value) is not str:
                raise _type_error(path, "a string", value)
            return value
        return string
    if tp is bool:
        def boolean(value: Any, path: str) -> bool:
            if type(value) is not bool:
                raise _type_error(path, "a boolean", value)
            return value
        return boolean
    if tp is int:
        def integer(value: Any, path: str) -> int:
            if type(value) is not int:  # `type is`, so True and 1.0 are refused
                if _past_int64(value):
                    raise _out_of_range(path, value)
                raise _type_error(path, "an integer", value)
            return value
        return integer
    if tp is float:
        def number(value: Any, path: str) -> float:
            kind = type(value)
            if kind is float:
                return value
            if kind is int:
                return float(value)
            raise _type_error(path, "a number", value)
        return number
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build_dataclass(tp)
    if _is_union(tp):
        return _build_union(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return _build_literal(args)
    if tp is list or origin is list:
        item = converter(args[0]) if args else converter(typing.Any)
        exact = _EXACT_SCALARS.get(args[0]) if args else None

        def array(value: Any, path: str) -> list:
            if type(value) is not list:
                raise _type_error(path, "an array", value)
            # A list of one JSON scalar type (token ids, stop strings) is checked in one C-level
            # pass: a request of millions of ids must not hold the event loop for each one's path.
            if exact is not None:
                if value and set(map(type, value)) != exact:
                    for i, v in enumerate(value):  # find the first misfit; only its path is built
                        if type(v) not in exact:
                            item(v, _join(path, i))  # raises that element's error
                return value
            return [item(v, _join(path, i)) for i, v in enumerate(value)]
        return array
    if tp is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"dict keys must be str in a JSON schema, got {tp!r}")
        item = converter(args[1]) if args else converter(typing.Any)

        def mapping(value: Any, path: str) -> dict:
            if type(value) is not dict:
                raise _type_error(path, "an object", value)
            return {k: item(v, _join(path, k)) for k, v in value.items()}
        return mapping
    raise TypeError(f"unsupported annotation in a schema: {tp!r}")


def _build_literal(options: tuple) -> Converter:
    allowed = frozenset((type(o), o) for o in options)
    shown = ", ".join(repr(o) for o in options)

    def literal(value: Any, path: str) -> Any:
        # Pair with the type so that True never matches Literal[1] (True == 1 in Python).
        try:
            ok = (type(value), value) in allowed
        except TypeError:  # unhashable: a list or an object
            ok = False
        if not ok:
            got = repr(value) if type(value) in (str, int, float, bool) else _kind(value)
            raise APIError(400, f"Invalid value for '{path}': expected one of {shown}, but got {got} instead.",
                           param=path or None, code="invalid_value")
        return value
    return literal


def _accepts(tp: Any) -> frozenset:
    """The JSON kinds (Python types of decoded JSON) a member of a union can take."""
    if tp is typing.Any or tp is object:
        return frozenset(_KIND_NAMES)
    if tp is None or tp is _NONE:
        return frozenset({_NONE})
    if tp is float:
        return frozenset({float, int})
    if dataclasses.is_dataclass(tp):
        return frozenset({dict})
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return frozenset(type(v) for v in typing.get_args(tp))
    if _is_union(tp):
        return frozenset().union(*(_accepts(a) for a in typing.get_args(tp)))
    return frozenset({origin or tp})


def _build_union(tp: Any) -> Converter:
    members = typing.get_args(tp)
    by_kind: dict[type, list[Converter]] = {}
    for member in members:
        conv = converter(member)
        for kind in _accepts(member):
            by_kind.setdefault(kind, []).append(conv)
    expected = _describe(tp)

    def union(value: Any, path: str) -> Any:
        candidates = by_kind.get(type(value))
        if not candidates:
            if int in by_kind and _past_int64(value):
                raise _out_of_range(path, value)
            raise _type_error(path, expected, value)
        if len(candidates) == 1:
            return candidates[0](value, path)
        best: APIError | None = None
        for conv in candidates:
            try:
                return conv(value, path)
            except APIError as error:
                # Report the member that got furthest: its error names the deepest param.
                if best is None or len(error.param or "") > len(best.param or ""):
                    best = error
        assert best is not None
        raise best
    return union


def _build_dataclass(cls: type) -> Converter:
    plan: list[tuple[str, Converter, bool]] | None = None

    def make_plan() -> list[tuple[str, Converter, bool]]:
        try:
            hints = typing.get_type_hints(cls)
        except NameError as error:
            raise TypeError(f"cannot resolve the annotations of {cls.__qualname__}: {error}; "
                            "define schema dataclasses at module level") from None
        out = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            out.append((f.name, converter(hints[f.name]), required))
        return out

    def build(value: Any, path: str) -> Any:
        nonlocal plan
        if type(value) is not dict:
            raise _type_error(path, "an object", value)
        if plan is None:  # built on first use, so that a dataclass may refer to itself
            plan = make_plan()
        kwargs = {}
        for name, conv, required in plan:
            if name in value:
                kwargs[name] = conv(value[name], _join(path, name))
            elif required:
                where = _join(path, name)
                raise APIError(400, f"Missing required parameter: '{where}'.", param=where,
                               code="missing_required_parameter")
        try:
            return cls(**kwargs)
        except FieldError as error:
            where = _join(path, error.field)
            raise APIError(400, error.message.replace("{param}", where), param=where, code=error.code) from None
        except ValueError as error:  # a cross-field check in __post_init__
            raise APIError(400, str(error), param=path or None) from None
    return build
