"""Chat templates: byte-exact goldens of 16 real templates, the sandbox, limits and template sources."""
from __future__ import annotations

import copy
import datetime
import json

import pytest

from rawserve.text.chat_template import ChatTemplateError, load_chat_template, render_chat
from tests.conftest import FIXTURES, fixture_path

PINNED = datetime.datetime(2024, 7, 26)
TEMPLATES = FIXTURES / "chat_templates"
CASE_NAMES = ("simple", "no_system", "multi_turn", "tools", "tool_round_trip", "thinking_off", "reasoning_history")
TEMPLATE_NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja")) if TEMPLATES.is_dir() else []


def _specials(meta: dict, template_name: str) -> dict:
    """bos/eos the goldens were rendered with: the longest family prefix of the template's name."""
    families = [k for k in meta["specials"] if k != "default" and template_name.startswith(k)]
    return dict(meta["specials"][max(families, key=len) if families else "default"])


@pytest.fixture(scope="module")
def golden_meta() -> dict:
    return json.loads(fixture_path("chat_templates", "goldens", "cases.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("template_name", TEMPLATE_NAMES)
def test_every_fixture_template_reproduces_its_goldens_byte_for_byte(template_name, golden_meta):
    assert golden_meta["fixed_date"] == PINNED.strftime("%Y-%m-%d")
    template = fixture_path("chat_templates", f"{template_name}.jinja").read_text(encoding="utf-8")
    assert set(golden_meta["cases"]) == set(CASE_NAMES)
    for case_name, case in golden_meta["cases"].items():
        kwargs = {**_specials(golden_meta, template_name), **case.get("kwargs", {}), "date_string": "26 Jul 2024"}
        messages = copy.deepcopy(case["messages"])
        golden = TEMPLATES / "goldens" / template_name / f"{case_name}.txt"
        refusal = TEMPLATES / "goldens" / template_name / f"{case_name}.error.txt"
        if golden.exists():
            text = render_chat(template, messages, tools=case.get("tools"),
                               add_generation_prompt=case["add_generation_prompt"], now=PINNED, **kwargs)
            assert text == golden.read_bytes().decode("utf-8"), case_name
        else:
            expected = refusal.read_text(encoding="utf-8").split(": ", 1)[1].strip()
            with pytest.raises(ChatTemplateError) as info:
                render_chat(template, messages, tools=case.get("tools"),
                            add_generation_prompt=case["add_generation_prompt"], now=PINNED, **kwargs)
            assert expected in str(info.value), case_name
        assert messages == case["messages"], "the caller's messages must not be modified"


def test_qwen3_template_gives_the_published_thinking_off_prompt(qwen3_tokenizer):
    text = render_chat(qwen3_tokenizer.chat_template, [{"role": "user", "content": "你好"}], enable_thinking=False)
    assert qwen3_tokenizer.encode(text) == [151644, 872, 198, 108386, 151645, 198, 151644, 77091, 198, 151667,
                                            271, 151668, 271]


SANDBOX_ESCAPES = [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{{ strftime_now.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ range.__globals__ }}",
    "{{ dict.__call__.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ ''.format.__globals__ }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ messages|attr('__class__') }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages['__class__'] }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns._private = 1 %}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% extends '/etc/hostname' %}",
]


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_sandbox_escape_attempts_fail_with_a_template_error(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        render_chat(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_callables_and_objects_never_reach_the_template():
    with pytest.raises(ChatTemplateError, match="unsupported value of type function"):
        render_chat("{{ helper }}", [], helper=test_callables_and_objects_never_reach_the_template)
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].content: unsupported value of type object"):
        render_chat("{{ messages }}", [{"role": "user", "content": object()}])
    with pytest.raises(ChatTemplateError, match="reserved"):
        render_chat("{{ x }}", [], strftime_now="not a function")


@pytest.mark.parametrize("template, limit", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}", None),
    ("{{ 'x' * 10**10 }}", None),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", None),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", None),
    ("{{ '%999999999d' % 1 }}", None),
    ("{{ '%999999999d' | format(1) }}", None),
    ("{{ '{:>999999999}'.format('x') | length }}", None),
    ("{{ 'x' | center(999999999) | length }}", None),
    ("{{ 'a\nb' | indent(width=999999999) | length }}", None),
    ("{{ ((10 ** 1000) ** 1000) ** 1000 }}", None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", 10),
])
def test_rendered_size_is_bounded(template, limit):
    kwargs = {"max_rendered_chars": limit} if limit else {}
    with pytest.raises(ChatTemplateError, match="exceed|too large"):
        render_chat(template, [{"role": "user", "content": "a" * 11}], **kwargs)


def test_tojson_matches_json_dumps_and_does_not_html_escape():
    value = {"b": "<tag> & 'quote' é", "a": [1, 2.5, None, True]}
    template = ("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}|"
                "{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(ensure_ascii=true) }}")
    expected = "|".join([json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2),
                         json.dumps(value, ensure_ascii=False, sort_keys=True),
                         json.dumps(value, ensure_ascii=False, separators=(",", ":")), json.dumps(value)])
    assert render_chat(template, [], x=value) == expected


def test_raise_exception_becomes_a_value_error_with_the_templates_message():
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(ValueError) as info:
        render_chat(template, [{"role": "system", "content": "x"}])
    assert str(info.value) == "System role not supported"


def test_syntax_and_runtime_errors_are_template_errors():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat("ok\n{% if %}", [])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{% for t in tools %}{% endfor %}", [])  # tools is None, as in HF
    with pytest.raises(ChatTemplateError, match="must be an object"):
        render_chat("x", ["not a message"])


def test_template_sees_hf_variables_and_extensions():
    template = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools is none }}|"
                "{{ enable_thinking }}|{{ strftime_now('%d %b %Y') }}|"
                "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}"
                "{% endif %}{{ i }}{% endfor %}|{% generation %}kept{% endgeneration %}|{{ dict(a=1).a }}")
    text = render_chat(template, [], add_generation_prompt=False, now=PINNED, bos_token="<s>", eos_token="</s>",
                       enable_thinking=False)
    assert text == "<s>|</s>|False|True|False|26 Jul 2024|02|kept|1"


def test_guarded_filters_and_formats_still_work_at_normal_sizes():
    template = "{{ 'x' | center(5) }}|{{ 'a\nb' | indent(2) }}|{{ '%03d' | format(7) }}|{{ '{:>3}'.format('y') }}"
    assert render_chat(template, []) == "  x  |a\n  b|007|  y"


def test_trim_blocks_and_lstrip_blocks_are_on():
    template = "start\n    {% if true %}\n  body\n    {% endif %}\nend"
    assert render_chat(template, []) == "start\n  body\nend"


def test_none_fields_are_dropped_and_reasoning_is_aliased():
    template = ("{% for m in messages %}[{{ 'content' in m }}:{{ m.thinking }}:{{ m.reasoning_content }}]"
                "{% endfor %}")
    messages = [{"role": "assistant", "content": None, "reasoning": "hmm"}, {"role": "user", "content": "x"}]
    assert render_chat(template, messages) == "[False:hmm:hmm][True::]"


def test_template_sources_in_order(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"
    override = tmp_path / "override.jinja"
    override.write_text("O")
    assert load_chat_template(tmp_path, override) == "O"
    assert load_chat_template(None, override) == "O"
    assert load_chat_template(None) is None


def test_template_source_errors_are_clear(tmp_path):
    with pytest.raises(ChatTemplateError, match="--chat-template: no such file"):
        load_chat_template(tmp_path, tmp_path / "missing.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ChatTemplateError, match="bad.jinja: chat template syntax error"):
        load_chat_template(tmp_path, bad)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}))
    with pytest.raises(ChatTemplateError, match="none is named 'default'"):
        load_chat_template(tmp_path)


def test_qwen3_checkpoint_template_loads_from_tokenizer_config(qwen3_tokenizer):
    template = load_chat_template(fixture_path("qwen3-tokenizer"))
    assert template == qwen3_tokenizer.chat_template
    assert "<|im_start|>" in template
