"""Chat templates: find a checkpoint's template and render it in a jinja2 sandbox, HF-compatible.

A template is untrusted code (it ships with a checkpoint): it renders in ImmutableSandboxedEnvironment,
sees only plain JSON data, and its output is size-bounded. This module must not import tokenizers.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_MAX_RENDERED_CHARS = 8 * 1024 * 1024
# Names the renderer itself provides; a caller's chat_template_kwargs may not replace them.
RESERVED_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "strftime_now", "raise_exception",
                            "namespace", "dict", "range", "cycler", "joiner", "lipsum"})
# What a request's chat_template_kwargs may not name: the names above, render_chat's own arguments
# (its size cap and clock are the server's limits) and the special tokens the server passes.
RESERVED_KWARGS = RESERVED_NAMES | {"template", "now", "max_rendered_chars", "bos_token", "eos_token"}
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")


def _check_format_widths(fmt: str) -> None:
    """A width or precision in a %- or {}-format string must not build a huge string."""
    numbers = [n for pair in _PERCENT_WIDTH.findall(fmt) for n in pair if n]
    numbers += [n for spec in _BRACE_SPEC.findall(fmt) for n in _DIGITS.findall(spec)]
    if any(int(n) > DEFAULT_MAX_RENDERED_CHARS for n in numbers):
        raise ChatTemplateError("format width too large")


def _checked_filter(name: str, width_arg: int) -> Any:
    """jinja2's filter `name`, refusing a width argument above the size limit."""
    original = jinja2.filters.FILTERS[name]

    def checked(*args: Any, **kwargs: Any) -> Any:
        width = kwargs.get("width", args[width_arg] if len(args) > width_arg else None)
        if isinstance(width, int) and width > DEFAULT_MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"{name} width too large")
        return original(*args, **kwargs)

    return checked


def _checked_format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_format_widths(str(value))
    return jinja2.filters.FILTERS["format"](value, *args, **kwargs)


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed; the API turns it into a 400."""


def _raise_exception(message: object) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Sequence[str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and '; HF templates expect json.dumps output.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=tuple(separators) if separators is not None else None, sort_keys=sort_keys)


class _DictFactory:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore names and oversized values (loop accumulation)."""

    max_chars = DEFAULT_MAX_RENDERED_CHARS

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's signature trick: `self` may be a kwarg)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _Namespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")
        if isinstance(value, (str, list, tuple, dict)) and len(value) > _Namespace.max_chars:
            raise ChatTemplateError(f"namespace value {name!r} exceeds {_Namespace.max_chars} items")


class _GenerationBlock(jinja2.ext.Extension):
    """HF's `{% generation %}…{% endgeneration %}` marks assistant text for training masks; for
    serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox plus guards on operators that can build huge values from small templates."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # jinja2 would return an Undefined that renders as "": refuse loudly instead, so a probe for
        # internals (__class__, __globals__, list.append) is an error, not silently empty output.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        limit = DEFAULT_MAX_RENDERED_CHARS
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > limit:
                    raise ChatTemplateError(f"repetition would exceed {limit} items")
        elif operator == "**":
            if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 \
                    and left.bit_length() * right > 100_000:
                raise ChatTemplateError("power too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > limit:
                raise ChatTemplateError(f"concatenation would exceed {limit} items")
        elif operator == "%" and isinstance(left, str):
            _check_format_widths(left)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # "...".format / format_map: check the format string's widths
            _check_format_widths(value.__self__)
        return wrapped


def _new_environment() -> _Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True,
                       extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.filters["format"] = _checked_format
    env.filters["center"] = _checked_filter("center", 1)
    env.filters["indent"] = _checked_filter("indent", 1)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _DictFactory()
    return env


_ENV = _new_environment()


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Parse once per distinct template text; a syntax error is a ChatTemplateError."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat template must be a string, got {type(template).__name__}")
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template syntax error at line {error.lineno}: {error.message}") from None


def _plain(value: Any, where: str) -> Any:
    """A copy made of JSON types only, so a template never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ChatTemplateError(f"{where}: keys must be strings, got {key!r}")
            out[str(key)] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, (str, int, float)):  # subclasses (enums, numpy scalars): back to the base type
        return str(value) if isinstance(value, str) else (float(value) if isinstance(value, float) else int(value))
    raise ChatTemplateError(f"{where}: unsupported value of type {type(value).__name__}")


@functools.lru_cache(maxsize=32)
def knows_role(template: str, role: str) -> bool:
    """Whether a template names `role` as a string literal: the test for a role it may handle itself."""
    return f'"{role}"' in template or f"'{role}'" in template


def _role(role: Any, template: str) -> Any:
    """OpenAI's newer and older role names as templates know them: developer is the system role unless the
    template handles it itself; function (the legacy tool result) is tool. Any other role goes to the template
    unchanged (vLLM's behaviour): the template decides."""
    if role == "developer" and not knows_role(template, "developer"):
        return "system"
    if role == "function":
        return "tool"
    return role


def _call_with_mapping(call: Any) -> Any:
    """An assistant tool call with its arguments parsed: OpenAI sends them as a JSON string, and templates iterate
    them as a mapping (Qwen3.5's `arguments|items` writes each as a <parameter=KEY>; Llama 3's and Hermes' dump
    the object), as transformers' callers and vLLM hand them over. Text that is no JSON stays a string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"] else {}
    except (ValueError, RecursionError):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _prepare_messages(messages: Any, template: str) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError("messages must be a list of objects")
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        # As HF's apply_chat_template: a None field is dropped (templates test presence, and OpenAI
        # clients send content=None beside tool_calls), and reasoning is offered under every name.
        message = {k: v for k, v in _plain(message, f"messages[{i}]").items() if v is not None}
        if "role" in message:
            message["role"] = _role(message["role"], template)
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_call_with_mapping(call) for call in message["tool_calls"]]
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    now: datetime.datetime | None = None,
    max_rendered_chars: int = DEFAULT_MAX_RENDERED_CHARS,
    **kwargs: Any,
) -> str:
    """Render a conversation to prompt text as transformers' apply_chat_template does.

    kwargs become template variables (bos_token, eos_token, chat_template_kwargs such as
    enable_thinking). `now` pins strftime_now (tests); the output is capped at max_rendered_chars.
    Any failure, including the template's raise_exception, is a ChatTemplateError (a ValueError). Roles are
    mapped first: developer to system unless the template knows it, function to tool.
    """
    compiled = compile_template(template)
    clash = RESERVED_NAMES.intersection(kwargs)
    if clash:
        raise ChatTemplateError(f"chat template variable {sorted(clash)[0]!r} is reserved")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list of objects")
    context = {
        "documents": None,
        **_plain(kwargs, "chat_template_kwargs"),
        "messages": _prepare_messages(messages, template),
        "tools": _plain(tools, "tools") if tools is not None else None,
        "add_generation_prompt": bool(add_generation_prompt),
        "strftime_now": lambda fmt: (now or datetime.datetime.now()).strftime(fmt),
    }
    pieces: list[str] = []
    size = 0
    try:
        # generate() rather than render(): a runaway loop is stopped as soon as it passes the cap.
        for piece in compiled.generate(**context):
            size += len(piece)
            if size > max_rendered_chars:
                raise ChatTemplateError(f"rendered prompt exceeds {max_rendered_chars} characters")
            pieces.append(piece)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(error.message or type(error).__name__) from None
    except Exception as error:  # template code can raise anything (TypeError on None, KeyError...); the API sends a 400
        raise ChatTemplateError(f"{type(error).__name__}: {error}") from None
    return "".join(pieces)


# ----- finding the template


def _named_template(value: Any, source: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        if len(named) == 1:
            return next(iter(named.values()))
        raise ChatTemplateError(f"{source}: several chat templates {sorted(map(str, named))} and none is named "
                                "'default'; pass --chat-template")
    raise ChatTemplateError(f"{source}: chat_template must be a string or a list of named templates")


def checkpoint_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The checkpoint's own template: chat_template.jinja, else chat_template.json (a vision checkpoint's
    processor template, which renders its image placeholders, as transformers' processors load it), else
    tokenizer_config.json; None if none."""
    model_dir = os.fspath(model_dir)
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        return _read_text(path)
    for name in ("chat_template.json", "tokenizer_config.json"):  # the processor's first, as transformers reads
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            config = json.loads(_read_text(path))
        except ValueError as error:
            raise ChatTemplateError(f"{path}: {error}") from None
        if isinstance(config, dict) and config.get("chat_template") is not None:
            return _named_template(config["chat_template"], path)
    return None


def load_chat_template(model_dir: str | os.PathLike | None,
                       override_path: str | os.PathLike | None = None) -> str | None:
    """The template to serve with: --chat-template FILE, else chat_template.jinja, else
    tokenizer_config.json. It is compiled here so a broken template fails at startup."""
    if override_path is not None:
        path = os.fspath(override_path)
        if not os.path.isfile(path):
            raise ChatTemplateError(f"--chat-template: no such file {path!r}")
        template, source = _read_text(path), path
    elif model_dir is not None:
        template, source = checkpoint_chat_template(model_dir), os.fspath(model_dir)
    else:
        return None
    if template is not None:
        try:
            compile_template(template)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{source}: {error}") from None
    return template


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"cannot read {path!r}: {error}") from None
