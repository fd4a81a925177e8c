"""Tests for rawserve.demo_model: deterministic bytes, tokenizer ids, a checkpoint transformers loads,
the chat template, and the user cache. Builds take about a second, so most tests share one build."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jinja2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors import safe_open
from tokenizers import Tokenizer

from rawserve import demo_model

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> pathlib.Path:
    return demo_model.build_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def tokenizer(demo_dir) -> Tokenizer:
    return Tokenizer.from_file(str(demo_dir / "tokenizer.json"))


def read_json(path: pathlib.Path):
    return json.loads(path.read_text(encoding="utf-8"))


# ---- determinism ---------------------------------------------------------------------------------

def test_building_twice_gives_byte_identical_files(demo_dir, tmp_path):
    again = demo_model.build_demo_model(tmp_path / "again")
    for name in demo_model.DEMO_FILES:
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert demo_model.tree_sha256(again) == demo_model.tree_sha256(demo_dir)


# A fresh interpreter, one thread, and torch's scalar kernels instead of this CPU's vector ones:
# none of them may change a byte (BPE training order, RNG, int->float and float rounding).
PORTABILITY_ENV = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}


def test_cli_build_in_a_single_threaded_scalar_kernel_process_matches_in_process_build(demo_dir, tmp_path):
    env = {**os.environ, **PORTABILITY_ENV}
    out = subprocess.run([sys.executable, "-m", "rawserve.demo_model", str(tmp_path / "cli")], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out == [str((tmp_path / "cli").resolve()), f"sha256 {demo_model.tree_sha256(demo_dir)}"]


def test_random_weights_in_every_dtype_do_not_depend_on_the_cpu_kernels(tmp_path):
    # float32 gets a tensor that spans two generation chunks; the half types only add a rounding.
    specs = {"float32": [("a", (1, 4_200_000)), ("norm", (9,))], "bfloat16": [("b", (50, 70)), ("norm", (9,))],
             "float16": [("b", (50, 70)), ("norm", (9,))]}
    script = ("import sys; from rawserve import demo_model\n"
              f"for dtype, specs in {specs!r}.items():\n"
              "    demo_model.write_random_safetensors(sys.argv[1] + '/' + dtype, specs, seed=5, dtype=dtype)\n")
    (tmp_path / "scalar").mkdir()
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "scalar")], env={**os.environ, **PORTABILITY_ENV},
                   timeout=120, check=True)
    for dtype in specs:
        here = demo_model.write_random_safetensors(tmp_path / dtype, specs[dtype], seed=5, dtype=dtype)
        assert here.read_bytes() == (tmp_path / "scalar" / dtype).read_bytes(), dtype


def test_random_safetensors_equal_what_the_safetensors_library_writes(demo_dir, tmp_path):
    from safetensors.torch import save_file

    with safe_open(demo_dir / "model.safetensors", "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ref.safetensors").read_bytes() == (demo_dir / "model.safetensors").read_bytes()


# ---- tokenizer -----------------------------------------------------------------------------------

ROUND_TRIP_SAMPLES = [
    "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n", "",
    "Crème brûlée à São Paulo, Zürich, Kraków", "今天天气很好", "東京の朝", "감사합니다", "Ελλάδα Москва",
    "emoji 👍🚀 family 👨‍👩‍👧‍👦 flag 🇫🇷", "e\u0301 (combining accent stays as typed)", "\x00\x7f\u200b",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', "def f(x):\n    return x ** 2\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_SAMPLES)
def test_tokenizer_round_trips_text_including_non_ascii(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_tokenizer_round_trips_any_unicode_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_vocabulary_has_about_two_thousand_tokens_and_every_byte(tokenizer):
    assert 1000 <= tokenizer.get_vocab_size() <= 4000
    # All 256 byte symbols are in the base vocabulary, so no text ever needs an unknown token.
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    from tokenizers.pre_tokenizers import ByteLevel
    assert all(symbol in vocab for symbol in ByteLevel.alphabet())


def test_special_tokens_have_fixed_ids(tokenizer):
    expected = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<think>": 3, "</think>": 4,
                "<tool_call>": 5, "</tool_call>": 6}
    assert {token: tokenizer.token_to_id(token) for token in expected} == expected


def test_think_and_tool_call_tags_are_single_tokens_that_survive_skip_special(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n<think>hm</think><tool_call>{}</tool_call><|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    for tag_id in (3, 4, 5, 6):
        assert ids.count(tag_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>hm</think><tool_call>{}</tool_call>"


def test_tokenizer_config_is_qwen_like(demo_dir):
    config = read_json(demo_dir / "tokenizer_config.json")
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert config["model_max_length"] == 4096
    specials = {int(i): (t["content"], t["special"]) for i, t in config["added_tokens_decoder"].items()}
    assert specials == {0: ("<|endoftext|>", True), 1: ("<|im_start|>", True), 2: ("<|im_end|>", True),
                        3: ("<think>", False), 4: ("</think>", False), 5: ("<tool_call>", False),
                        6: ("</tool_call>", False)}
    assert config["chat_template"] == demo_model.chat_template()


# ---- checkpoint ----------------------------------------------------------------------------------

def test_config_and_generation_config_have_the_specified_values(demo_dir, tokenizer):
    config = read_json(demo_dir / "config.json")
    num_tokens = tokenizer.get_vocab_size()
    assert config["vocab_size"] % 64 == 0 and num_tokens <= config["vocab_size"] < num_tokens + 64
    expected = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
                "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
                "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                "torch_dtype": "float32", "bos_token_id": None, "eos_token_id": 2}
    assert {key: config[key] for key in expected} == expected
    generation = read_json(demo_dir / "generation_config.json")
    assert (generation["eos_token_id"], generation["temperature"], generation["top_p"]) == ([2, 0], 0.7, 0.9)


def test_weights_have_hf_qwen3_names_and_the_stated_init(demo_dir):
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{part}.weight" for i in range(4) for part in per_layer}
    with safe_open(demo_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == expected  # no lm_head.weight: tied
        for name in f.keys():
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.float32
            if tensor.dim() == 1:
                assert torch.equal(tensor, torch.ones_like(tensor)), name
            else:  # near-normal, std 0.02, bounded at sqrt(12) std (a sum of 4 uniforms)
                assert abs(tensor.std().item() - 0.02) < 0.002 and abs(tensor.mean().item()) < 0.002, name
                assert tensor.abs().max().item() <= 0.02 * 12 ** 0.5, name
        assert list(f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape()) == [64, 128]


def test_checkpoint_loads_in_transformers_with_no_missing_weights_and_runs_forward(demo_dir):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[1, 100, 200, 300, 2]])).logits  # [1, 5, vocab]
    assert logits.shape == (1, 5, 2048) and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_random_weights_depend_only_on_seed_and_name_in_every_dtype(tmp_path):
    shape = demo_model.Qwen3Shape(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=128, tie_word_embeddings=False)
    tensors = {}
    for dtype in ("float32", "bfloat16"):
        directory = demo_model.write_qwen3_checkpoint(tmp_path / dtype, shape, seed=7, dtype=dtype,
                                                      bos_token_id=None, eos_token_id=1, generation_config={})
        assert read_json(directory / "config.json")["torch_dtype"] == dtype
        with safe_open(directory / "model.safetensors", "pt") as f:
            tensors[dtype] = {name: f.get_tensor(name) for name in f.keys()}
    assert "lm_head.weight" in tensors["float32"]  # untied shapes get their own head
    for name, value in tensors["float32"].items():
        assert tensors["bfloat16"][name].dtype == torch.bfloat16
        assert torch.equal(tensors["bfloat16"][name], value.to(torch.bfloat16)), name
    assert not torch.equal(tensors["float32"]["lm_head.weight"], tensors["float32"]["model.embed_tokens.weight"])


@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("num_hidden_layers", -1), ("head_dim", 8.0)])
def test_bad_shape_field_raises_value_error_naming_it(field, value):
    fields = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128)
    with pytest.raises(ValueError, match=field):
        demo_model.Qwen3Shape(**{**fields, field: value})


def test_heads_not_divisible_by_kv_heads_is_rejected():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        demo_model.Qwen3Shape(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=3, num_key_value_heads=2, head_dim=8,
                              max_position_embeddings=128)


def test_unknown_dtype_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        demo_model.write_random_safetensors(tmp_path / "x.safetensors", [("w", (2, 2))], seed=0, dtype="int8")


# ---- chat template -------------------------------------------------------------------------------

def render(**variables) -> str:
    """Render the demo template the way a server must (see shared/fixtures/README.md)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def tojson(value, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(demo_model.chat_template()).render(**variables)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city, °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich and Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "\nTwo cities, two calls.\n",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 12}'},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 18}'},
    {"role": "assistant", "content": "Zürich 12 °C, Paris 18 °C."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
]
TOOLS_CONVERSATION_RENDERED = (
    "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call the functions below to help with the "
    "user's request. Each function's JSON signature is listed inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city, °C.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments between "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Zürich and Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    '<|im_start|>user\n<tool_response>\n{"temp_c": 12}\n</tool_response>\n'
    '<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nZürich 12 °C, Paris 18 °C.<|im_end|>\n"
    "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_renders_a_tools_conversation():
    rendered = render(messages=TOOLS_CONVERSATION, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert rendered == TOOLS_CONVERSATION_RENDERED


def test_chat_template_renders_the_same_through_transformers(demo_dir):
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(demo_dir)
    rendered = hf_tokenizer.apply_chat_template(TOOLS_CONVERSATION, tools=[WEATHER_TOOL], tokenize=False,
                                                add_generation_prompt=True)
    assert rendered == TOOLS_CONVERSATION_RENDERED
    no_think = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
    assert no_think == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_enable_thinking_false_closes_an_empty_think_block_in_the_generation_prompt():
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    head = "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(messages=messages, add_generation_prompt=True, enable_thinking=False) == \
        head + "<think>\n\n</think>\n\n"
    assert render(messages=messages, add_generation_prompt=True, enable_thinking=True) == head
    assert render(messages=messages, add_generation_prompt=True) == head
    assert render(messages=messages, add_generation_prompt=False, enable_thinking=False) == \
        head[: -len("<|im_start|>assistant\n")]


def test_assistant_text_before_a_tool_call_is_separated_by_a_newline():
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": {}}}]}]
    assert render(messages=messages).endswith(
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


def test_chat_template_rejects_an_unknown_role():
    with pytest.raises(jinja2.TemplateError, match="Unsupported message role: narrator"):
        render(messages=[{"role": "narrator", "content": "Once"}])


def test_rendered_prompt_tokenizes_with_chatml_ids(tokenizer):
    ids = tokenizer.encode(render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  enable_thinking=False)).ids
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert ids.index(3) < ids.index(4)  # <think> then </think>, each one token


# ---- cache ---------------------------------------------------------------------------------------

def test_ensure_demo_model_builds_once_and_reuses_the_cache(tmp_path, monkeypatch, demo_dir):
    builds = []
    real_build = demo_model.build_demo_model

    def recording_build(directory):
        builds.append(directory)
        return real_build(directory)

    monkeypatch.setattr(demo_model, "build_demo_model", recording_build)
    first = demo_model.ensure_demo_model(tmp_path)
    assert first.parent == tmp_path and first.name == f"demo-{demo_model.builder_inputs_hash()}"
    assert demo_model.tree_sha256(first) == demo_model.tree_sha256(demo_dir)
    stamps = {p.name: p.stat().st_mtime_ns for p in [first, *first.iterdir()]}
    second = demo_model.ensure_demo_model(tmp_path)
    assert second == first
    assert len(builds) == 1  # a rebuild would lose the rename harmlessly, so count it directly
    assert {p.name: p.stat().st_mtime_ns for p in [second, *second.iterdir()]} == stamps
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind


def test_ensure_demo_model_keeps_the_first_published_copy_when_another_builder_wins(tmp_path, monkeypatch,
                                                                                     demo_dir):
    final = tmp_path / f"demo-{demo_model.builder_inputs_hash()}"
    real_build = demo_model.build_demo_model

    def build_while_a_competitor_publishes(directory):
        real_build(final)  # the other process finishes first
        return real_build(directory)

    monkeypatch.setattr(demo_model, "build_demo_model", build_while_a_competitor_publishes)
    assert demo_model.ensure_demo_model(tmp_path) == final
    assert demo_model.tree_sha256(final) == demo_model.tree_sha256(demo_dir)
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_cli_without_a_directory_uses_the_xdg_cache(tmp_path, monkeypatch, capsys, demo_dir):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_model.main([]) == 0
    path, digest = capsys.readouterr().out.splitlines()
    assert pathlib.Path(path).parent == tmp_path / "xdg" / "rawserve"
    assert digest == f"sha256 {demo_model.tree_sha256(demo_dir)}"


def test_default_cache_dir_is_under_home_without_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_model.default_cache_dir() == tmp_path / "home" / ".cache" / "rawserve"
