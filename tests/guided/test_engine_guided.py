"""Guided decoding through EngineCore on a random-weight model with a Qwen3-shaped 151,669-token tokenizer (built
in tests/conftest.py, so it runs without ../shared/fixtures): every output of many seeds matches its regex /
validates against its schema; forced tool calls parse; unconstrained rows in the same batch are untouched;
preemption changes nothing."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.grammar import Grammar, Token, lit
from rawserve.engine.guided.regex import parse_regex
from rawserve.engine.types import SamplingParams
from rawserve.text.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

TOOL_CALL, TOOL_CALL_END = 151657, 151658
WEATHER = {"type": "object", "properties": {"location": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["location"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": -5, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b\"c", "é"]}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "admin": {"type": "boolean"}},
              "required": ["name", "admin"], "additionalProperties": False},
    "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
    "required": ["id", "owner", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def core(large_vocab_model_dir):
    # closed at the module's end: a core left open kept its guided helper thread alive into the interpreter's
    # teardown, and running this module alone then aborted at exit about one time in two
    core = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=512,
                                   max_model_len=1024))
    yield core
    core.close()


@pytest.fixture(scope="module")
def tok(large_vocab_model_dir):
    return Tokenizer.from_dir(large_vocab_model_dir)


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    for rid, (ids, params) in requests.items():
        core.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    for _ in range(5000):
        if not core.has_unfinished:
            break
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert not core.has_unfinished and core.blocks.num_free_blocks == core.blocks.num_blocks
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def text_of(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i not in (151645, 151643)])


def test_regex_outputs_fully_match_across_seeds(core, tok):
    pattern = r"(\d{3}-\d{4}|[α-ω]{2,4}|(cat|category|cattle)!?)"
    compiled = compile_grammar(Grammar({"root": parse_regex(pattern)}), "re1")
    prompt = tok.encode("Say something:")
    outs = run(core, {f"r{s}": (prompt, SamplingParams(max_tokens=40, temperature=1.5, seed=s, guided=compiled))
                      for s in range(24)})
    for rid, (ids, reason) in outs.items():
        assert reason == "stop", rid
        assert re.fullmatch(pattern, text_of(tok, ids)), (rid, text_of(tok, ids))


@pytest.mark.parametrize("schema", [WEATHER, NESTED], ids=["weather", "nested"])
def test_schema_outputs_validate_across_seeds(core, tok, schema):
    from rawserve.engine.guided.json_schema import schema_to_grammar

    compiled = compile_grammar(schema_to_grammar(schema), json.dumps(schema))
    prompt = tok.encode("JSON please:")
    outs = run(core, {f"s{s}": (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=s, guided=compiled))
                      for s in range(16)})
    for rid, (ids, reason) in outs.items():
        assert reason == "stop", (rid, text_of(tok, ids))
        jsonschema.validate(json.loads(text_of(tok, ids)), schema)


def test_required_tool_calls_parse_and_single_call_when_not_parallel(core, tok):
    from rawserve.engine.guided.tool_calls import tool_call_grammar
    from rawserve.text.parsers.hermes import HermesToolParser

    tools = [("get_weather", WEATHER), ("no_args", None)]
    prompt = tok.encode("Call a tool:")
    for parallel in (True, False):
        grammar = tool_call_grammar(tools, style="hermes", parallel=parallel, open_tag=Token(TOOL_CALL),
                                    close_tag=Token(TOOL_CALL_END))
        compiled = compile_grammar(grammar, f"tools-{parallel}")
        outs = run(core, {f"t{parallel}{s}": (prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=s,
                                                                      guided=compiled)) for s in range(12)})
        num_stopped = 0
        for rid, (ids, reason) in outs.items():
            # A random model may go on adding parallel calls until max_tokens; one call always ends.
            assert reason == "stop" or (parallel and reason == "length"), rid
            num_stopped += reason == "stop"
            closed = ids.count(TOOL_CALL_END)
            assert closed >= 1 and ids.count(TOOL_CALL) - closed == (reason == "length")
            if not parallel:
                assert closed == 1
            events = HermesToolParser().feed(text_of(tok, ids), final=True)
            calls = [e for e in events if e[0] != "content"]
            assert calls, text_of(tok, ids)
            for block in text_of(tok, ids).split("<tool_call>")[1:1 + closed]:
                call = json.loads(block.split("</tool_call>")[0])
                assert call["name"] in ("get_weather", "no_args")
                if call["name"] == "get_weather":
                    jsonschema.validate(call["arguments"], WEATHER)
                else:
                    assert call["arguments"] == {}
        assert num_stopped >= len(outs) // 2


def test_unconstrained_rows_in_a_constrained_batch_are_untouched(core, tok):
    compiled = compile_grammar(Grammar({"root": parse_regex(r"[0-9]{5}")}), "digits")
    prompt = tok.encode("Numbers and words")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(core, {"free": (prompt, free)})["free"][0]
    mixed = run(core, {"free": (prompt, free),
                       **{f"g{s}": (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=s, guided=compiled))
                          for s in range(6)}})
    assert mixed["free"][0] == alone
    for s in range(6):
        assert re.fullmatch(r"[0-9]{5}", text_of(tok, mixed[f"g{s}"][0]))


def test_greedy_guided_output_survives_preemption(large_vocab_model_dir, tok):
    compiled = compile_grammar(Grammar({"root": parse_regex(r"[a-z ]{100,120}\.")}), "words")
    prompt = tok.encode("Once upon a time there was a")

    def go(num_blocks: int) -> dict:
        small = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", block_size=4,
                                        num_kv_blocks=num_blocks, max_model_len=256))
        try:
            outs = run(small, {f"p{i}": (prompt + [i + 100], SamplingParams(max_tokens=50, temperature=0,
                                                                             guided=compiled)) for i in range(6)})
            return outs, small.scheduler.num_preemptions
        finally:
            small.close()

    big, _ = go(256)
    tight, preemptions = go(16)
    assert preemptions > 0
    assert tight == big


def test_max_tokens_cuts_a_constrained_output_with_length(core, tok):
    compiled = compile_grammar(Grammar({"root": lit("x" * 50)}), "long")
    outs = run(core, {"cut": (tok.encode("go"), SamplingParams(max_tokens=3, temperature=0, guided=compiled))})
    ids, reason = outs["cut"]
    assert reason == "length" and len(ids) == 3 and ("x" * 50).startswith(text_of(tok, ids))


def test_the_vocabulary_index_is_read_at_the_first_guided_request_once_cached(large_vocab_model_dir, tok,
                                                                              tmp_path, monkeypatch):
    """A core whose tokenizer's index is on disk does not hold it (~35 MiB) until a guided request needs it; one
    with nowhere to cache it builds it at start and keeps it, so no step ever waits seconds for the build."""
    from rawserve.engine.guided import vocab
    from rawserve.engine.loader import read_model_config

    compiled = compile_grammar(Grammar({"root": parse_regex(r"[0-9]{3}")}), "three")
    config = EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=64,
                          max_model_len=256)
    vocab_size = read_model_config(large_vocab_model_dir).vocab_size
    vocab.load_vocab_index(large_vocab_model_dir, vocab_size)  # the cache exists now
    lazy = EngineCore(config)
    try:
        assert lazy._guided is None
        outs = run(lazy, {"g": (tok.encode("Count:"), SamplingParams(max_tokens=8, temperature=0, guided=compiled))})
        assert re.fullmatch(r"[0-9]{3}", text_of(tok, outs["g"][0])) and lazy._guided is not None
    finally:
        lazy.close()
    # No cache file can be written (and none is there): built at start, kept.
    (tmp_path / "a-file").write_text("")  # a file where the cache's folder would be: nothing can be written
    monkeypatch.setattr(vocab, "_cache_path", lambda model_dir, key: [tmp_path / "a-file" / key])
    eager = EngineCore(config)
    try:
        assert eager._guided is not None
    finally:
        eager.close()


def test_a_helper_yielding_to_the_steps_host_code_keeps_cold_outputs_valid_and_free_rows_alone(
        large_vocab_model_dir, tok, monkeypatch):
    """The helper as it runs on a GPU (GuidedRegistry.YIELD_TO_STEP), on the CPU: it builds only while the forward
    runs and while the step waits. Eight rows, each with a schema no row had before, still validate, and a free row
    in their batch samples what it samples alone."""
    from rawserve.engine.guided.json_schema import schema_to_grammar
    from rawserve.engine.guided.matcher import GuidedRegistry

    monkeypatch.setattr(GuidedRegistry, "YIELD_TO_STEP", True)
    yielding = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", num_kv_blocks=512,
                                       max_model_len=1024))
    schemas = [{**WEATHER, "properties": {f"place_{i}": WEATHER["properties"]["location"],
                                          "unit": WEATHER["properties"]["unit"]}, "required": [f"place_{i}"]}
               for i in range(8)]
    prompt = tok.encode("JSON please:")
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        assert yielding.guided_registry().yields_to_step
        alone = run(yielding, {"free": (prompt, free)})["free"][0]
        outs = run(yielding, {"free": (prompt, free), **{
            f"g{i}": (prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=i, guided=compile_grammar(
                schema_to_grammar(schema), json.dumps(schema)))) for i, schema in enumerate(schemas)}})
        # between steps the floor is the helper's: a new request's first mask builds with no step running
        late = {**schemas[0], "properties": {"late": WEATHER["properties"]["location"]}, "required": ["late"]}
        yielding.add_request("late", prompt, SamplingParams(max_tokens=60, guided=compile_grammar(
            schema_to_grammar(late), json.dumps(late))))
        registry = yielding.guided_registry()
        deadline = time.monotonic() + 10
        while registry.has_work and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not registry.has_work
        for _ in range(500):
            if not yielding.has_unfinished:
                break
            yielding.step()
        assert not yielding.has_unfinished
    finally:
        yielding.close()
    assert outs["free"][0] == alone
    for i, schema in enumerate(schemas):
        ids, reason = outs[f"g{i}"]
        assert reason == "stop", text_of(tok, ids)
        jsonschema.validate(json.loads(text_of(tok, ids)), schema)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_guided_rows_on_cuda_validate_and_leave_unconstrained_rows_alone(large_vocab_model_dir, tok):
    """On a GPU the step masks its constrained rows all at once (token_mask.apply_rows, from ROWS_AT_ONCE_MIN rows;
    row by row once fewer are left): every constrained output validates, and an unconstrained row in the batch
    samples what it samples alone."""
    from rawserve.engine.guided.json_schema import schema_to_grammar

    gpu = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cuda", dtype="float32",
                                  num_kv_blocks=256, max_model_len=512))
    compiled = compile_grammar(schema_to_grammar(WEATHER), json.dumps(WEATHER))
    prompt = tok.encode("JSON please:")
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        alone = run(gpu, {"free": (prompt, free)})["free"][0]
        outs = run(gpu, {"free": (prompt, free),
                         **{f"g{s}": (prompt, SamplingParams(max_tokens=60, temperature=1.0, seed=s, guided=compiled))
                            for s in range(8)}})
    finally:
        gpu.close()
    assert outs["free"][0] == alone
    for s in range(8):
        ids, reason = outs[f"g{s}"]
        assert reason == "stop", text_of(tok, ids)
        jsonschema.validate(json.loads(text_of(tok, ids)), WEATHER)
