"""Request fields -> one grammar: the reasoning block in front of a constrained answer, and the cache key."""
from __future__ import annotations

import pytest

from rawserve.api.guided import GuidedSpec, build_grammar, think_mode, vocabulary_of
from rawserve.engine.guided.automaton import Automaton
from rawserve.engine.guided.grammar import TOKEN_BASE, symbols
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.text.tokenizer import Tokenizer
from tests.conftest import fixture_path

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


# Qwen3's <think> and </think>: the tokenizer built in tests/conftest.py and, where present, the real one.
@pytest.fixture(scope="module", params=["large_vocab", "qwen3"])
def tok(request):
    if request.param == "qwen3":
        return Tokenizer.from_dir(fixture_path("qwen3-tokenizer"))
    return Tokenizer.from_dir(request.getfixturevalue("large_vocab_tokenizer_dir"))


def test_think_mode_follows_the_rendered_prompt():
    assert think_mode("<|im_start|>assistant\n", None) == ""
    assert think_mode("<|im_start|>assistant\n", "qwen3") == "may"  # Qwen3 thinking: the model opens it
    assert think_mode("<|im_start|>assistant\n<think>\n", "deepseek_r1") == "open"  # R1: the template opened it
    assert think_mode("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3") == ""  # enable_thinking=False


@pytest.mark.parametrize("think, answer_only, thought, continued", [
    ("", True, False, False), ("may", True, True, False), ("open", False, False, True)])
def test_reasoning_block_comes_before_the_constrained_answer(tok, think, answer_only, thought, continued):
    start, end = TOKEN_BASE + tok.token_to_id("<think>"), TOKEN_BASE + tok.token_to_id("</think>")
    spec = GuidedSpec("json", SCHEMA, "guided_json", think)
    a = Automaton(compile_grammar(build_grammar(spec, vocabulary_of(tok)), think))
    answer = symbols('{"a": 1}')
    assert a.matches(answer) == answer_only
    assert a.matches((start, *symbols("Let me think. {not json"), end, *symbols("\n\n"), *answer)) == thought
    assert a.matches((*symbols("still thinking"), end, *symbols("\n\n"), *answer)) == continued
    assert not a.matches((start, *symbols("x"), end, *symbols("\n\nno")))


def test_the_reasoning_mode_is_part_of_the_cache_key():
    assert GuidedSpec("json", SCHEMA, "p", "may").key != GuidedSpec("json", SCHEMA, "p").key


def test_a_grammar_that_spells_the_reasoning_block_is_taken_as_is(tok):
    start, end = TOKEN_BASE + tok.token_to_id("<think>"), TOKEN_BASE + tok.token_to_id("</think>")
    spec = GuidedSpec("grammar", 'root ::= <think> "plan" </think> "\\n\\n" ("yes" | "no")', "guided_grammar", "may")
    a = Automaton(compile_grammar(build_grammar(spec, vocabulary_of(tok)), "spelled"))
    assert a.matches((start, *symbols("plan"), end, *symbols("\n\nyes")))
    assert not a.matches((start, *symbols("x"), end, start, *symbols("plan"), end, *symbols("\n\nyes")))


async def test_the_compiled_grammar_cache_is_bounded_by_count_and_by_states(tok, monkeypatch):
    import rawserve.api.guided as guided

    cache = guided.GrammarCache(tok, capacity=3)
    try:
        specs = [GuidedSpec("regex", f"[ab]{{{n}}}", "guided_regex") for n in range(1, 6)]
        for spec in specs:
            await cache.get(spec)
        assert list(cache._compiled) == [s.key for s in specs[-3:]]  # the oldest went first
        monkeypatch.setattr(guided, "MAX_CACHED_STATES", 1)
        await cache.get(GuidedSpec("regex", "c", "guided_regex"))
        assert len(cache._compiled) == 1  # over the state bound: all but the newest dropped
        hit = await cache.get(GuidedSpec("regex", "c", "guided_regex"))
        assert cache.hits == 1 and hit is cache._compiled[GuidedSpec("regex", "c", "guided_regex").key]
    finally:
        cache.close()
