"""Counted repeats on the cold path: the NFA's repeat runs, and masks shared along a run (shifted walks, long
plain runs, plain steps made by shifting) against the brute-force reference."""
from __future__ import annotations

import gc
import pickle
import random

import pytest
import torch

from rawserve.engine.guided.automaton import DEAD
from rawserve.engine.guided.grammar import Grammar, Repeat, Token, alt, lit, seq
from rawserve.engine.guided.json_schema import schema_to_grammar
from rawserve.engine.guided.matcher import GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar, gc_paused
from rawserve.engine.guided.nfa_rows import has_edges
from rawserve.engine.guided.vocab import VocabIndex
from tests.guided.test_matcher import STRING_CHAR, brute_mask, plain_vocab


def test_repeat_runs_are_recorded_for_counted_strings_and_not_for_empty_items():
    compiled = compile_grammar(schema_to_grammar({"type": "string", "minLength": 2, "maxLength": 30}), "s")
    assert [count for _, _, count in compiled.repeats] == [28]  # maxLength - minLength optional copies
    first, stride, count = compiled.repeats[0]
    # copy i is copy 0 moved on by i strides, the same edges renumbered, but for the end of the last copy,
    # which takes no byte (the copies' starts are their predecessors' ends)
    for i in range(1, count):
        for s in range(first + (i == count - 1), first + stride):
            moved = tuple((lo, hi, t + i * stride) for lo, hi, t in compiled.byte_edges[s])
            assert compiled.byte_edges[s + i * stride] == moved, (i, s)
    assert compiled.byte_edges[first + (count - 1) * stride] == ()
    empty_item = Grammar({"root": Repeat(alt(lit("a"), lit("")), 0, 10)})
    assert compile_grammar(empty_item, "e").repeats == []  # a copy could be skipped without a byte
    assert pickle.loads(pickle.dumps(compiled)).repeats == compiled.repeats


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 2, "maxLength": 30},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 9}, "b": {"type": "integer"},
                                      "c": {"type": "array", "maxItems": 3, "items": {"type": "string",
                                                                                      "maxLength": 40}}},
     "required": ["a", "c"], "additionalProperties": False},
    # runs in runs, and several spans: the pickle writes nothing for any virtual state and repeats their offsets
    {"type": "object", "properties": {"a": {"type": "array", "maxItems": 12, "items": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 20}}, "required": ["s"]}},
        "b": {"type": "string", "maxLength": 15}}, "required": ["a", "b"], "additionalProperties": False},
])
def test_a_long_runs_virtual_copies_read_as_the_built_ones(monkeypatch, schema):
    """A run's middle copies are left virtual (nfa_rows): every state's edges read as a fully built NFA's, in
    the compiling process and after the pickle to the core, and the run's bookkeeping is the same."""
    from rawserve.engine.guided import nfa

    grammar = schema_to_grammar(schema)
    virtual = compile_grammar(grammar, "v")
    monkeypatch.setattr(nfa, "VIRTUAL_MIN_COPIES", 1 << 30)
    built = compile_grammar(grammar, "b")
    assert virtual.virtual and not built.virtual
    assert virtual.num_states == built.num_states and virtual.repeats == built.repeats
    # what a virtual copy spares: nothing of it is pickled
    assert len(pickle.dumps(virtual)) < 0.6 * len(pickle.dumps(built))
    for compiled in (virtual, pickle.loads(pickle.dumps(virtual))):
        for name in ("eps", "byte_edges", "token_edges", "call_edges"):
            rows, expected = getattr(compiled, name), getattr(built, name)
            assert [rows[s] for s in range(built.num_states)] == list(expected), name
        assert has_edges(compiled.byte_edges, compiled.token_edges) == has_edges(built.byte_edges, built.token_edges)


def test_a_grammar_is_packed_as_built_and_pickles_as_its_built_states_alone():
    """compile_grammar packs its NFA as the core reads it (int arrays, no list per state for the collector), and
    what crosses the pipe to the core is the rows of the states outside the virtual spans, as 16-bit ints under
    65,536 states, and nothing for an edge list with no edge: 2.5 KB for a maxLength 1000 string's 41,004 states,
    where one offset per state and edge list came to over 640 KB."""
    compiled = compile_grammar(schema_to_grammar({"type": "string", "maxLength": 1000}), "long")
    assert compiled.num_states > 40_000
    assert isinstance(compiled.is_final, bytes) and compiled.byte_edges.flat.typecode == "H"
    assert len(pickle.dumps(compiled)) < 4_000
    # past 65,536 states the ints are 32-bit, and a list with edges has its offsets
    big = compile_grammar(schema_to_grammar({"type": "object", "properties": {
        name: {"type": "string", "maxLength": 2000} for name in "ab"}}), "big")
    assert big.num_states > 1 << 16 and big.byte_edges.flat.typecode == "i"
    for grammar in (compiled, big):
        loaded = pickle.loads(pickle.dumps(grammar))
        for name in ("eps", "byte_edges", "token_edges", "call_edges"):
            rows = getattr(grammar, name)
            assert [getattr(loaded, name)[s] for s in range(len(rows))] == list(rows), name
        assert loaded.is_final == grammar.is_final and loaded.virtual == grammar.virtual


@pytest.mark.parametrize("grammar", [
    schema_to_grammar({"type": "object", "properties": {"a": {"type": "string", "maxLength": 30}}}),
    Grammar({"root": seq(Repeat(alt(lit("ab"), Token(7)), 0, 20), Token(5), Repeat(lit("c"), 0, 12))}),
])
def test_has_edges_reads_the_byte_and_token_edges_the_rows_have(grammar):
    """has_edges (the automaton's consuming states) from a packed grammar's offsets, virtual states and all, with
    token edges and without."""
    compiled = compile_grammar(grammar, "edges")
    assert compiled.virtual
    rows_b, rows_t = compiled.byte_edges, compiled.token_edges
    expected = [bool(rows_b[s] or rows_t[s]) for s in range(compiled.num_states)]
    assert has_edges(rows_b, rows_t) == expected and True in expected and False in expected


def _run_vocab() -> tuple[list[bytes], set[int]]:
    """plain_vocab plus long plain runs (more than PLAIN_MAX_CHARS characters, up to past the string's
    bound), runs of escapes, and long runs that end in a quote or a partial character, or go on wrongly after
    one (`"x`, an escape `\\q` that JSON has not)."""
    tokens, specials = plain_vocab()
    extra = [b" " * n for n in (17, 24, 33, 41, 47, 58, 70)] + [b"-" * 40, "é".encode() * 25, "中".encode() * 19]
    extra += [b" " * 30 + b'"]', b" " * 20 + b"\\n" + b" " * 10, b"\\n" * 12, b"\\u00e9" * 5,
              b"a" * 18 + "中".encode()[:2], b"-" * 17 + b'"', b"=" * 64, b"-" * 17 + b'"x', b" " * 18 + b"\\q"]
    base = len(tokens) - len(specials)
    tokens = tokens[:base] + extra + tokens[base:]
    return tokens, {i + len(extra) for i in specials}


@pytest.mark.parametrize("order", ["forward", "backward", "shuffled"])
def test_masks_along_a_counted_string_equal_brute_force_at_every_place(order):
    """Every place of a maxLength 50 string, its end included, in decode order (kept walks made at the first
    place, reused near the end), backwards (made near the end first) and shuffled."""
    tokens, specials = _run_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens) + 2)
    grammar = Grammar({"root": seq(lit('["'), Repeat(STRING_CHAR, 0, 50), lit('"]'))})
    runtime = GrammarRuntime(compile_grammar(grammar, "s50"), vocab)
    a = runtime.automaton
    text = ("a é中😀\\n" * 10).encode()
    places, cid = [], a.step_bytes(a.start, b'["')
    for ch in text.decode().replace("\\n", "\n"):  # a place per character, the escape as one
        places.append(cid)
        cid = a.step_bytes(cid, b"\\n" if ch == "\n" else ch.encode())
        if cid == DEAD or len(places) > 51:
            break
    assert len(places) == 51  # 50 characters then the place where only `"` may follow
    if order == "backward":
        places.reverse()
    elif order == "shuffled":
        random.Random(5).shuffle(places)
    for cid in places:
        assert torch.equal(runtime.mask(cid).allowed(vocab.vocab_size), brute_mask(a, vocab, cid)), cid
    assert runtime.num_walks["plain"] > 0


def test_masks_in_an_array_of_counted_strings_equal_brute_force():
    """Runs reached through several items and nesting (stacks differ, the same run's states recur)."""
    tokens, specials = _run_vocab()
    vocab = VocabIndex(tokens, specials, len(tokens) + 2)
    grammar = schema_to_grammar({"type": "array", "maxItems": 4,
                                 "items": {"type": "object", "properties": {"s": {"type": "string", "maxLength": 20}},
                                           "required": ["s"], "additionalProperties": False}})
    runtime = GrammarRuntime(compile_grammar(grammar, "arr"), vocab)
    a = runtime.automaton
    rng = random.Random(11)
    seen, frontier, checked = {a.start}, [a.start], 0
    while frontier and checked < 90:
        cid = frontier.pop(rng.randrange(len(frontier)))
        mask = runtime.mask(cid).allowed(vocab.vocab_size)
        assert torch.equal(mask, brute_mask(a, vocab, cid)), cid
        checked += 1
        for t in mask.nonzero().squeeze(1).tolist():
            nxt = runtime.advance(cid, t)
            if nxt != DEAD and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert checked == 90


def test_gc_paused_nests_and_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_a_tail_stepped_by_its_kept_plain_step_stops_at_a_quote_or_an_escape():
    """Long tails whose walk goes on from a place made by shifting (never expanded): a `"` or `\\` there
    is not a plain character, whatever the kept plain step says (nothing else here expands that place)."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += [b"-" * 17 + b'"x', b"-" * 17 + b'"]', b"-" * 18 + b"\\q", b"-" * 18 + b"\\n", b"-" * 19]
    vocab = VocabIndex(tokens, set(), len(tokens))
    grammar = Grammar({"root": seq(lit('["'), Repeat(STRING_CHAR, 0, 40), lit('"]'))})
    runtime = GrammarRuntime(compile_grammar(grammar, "s40"), vocab)
    a = runtime.automaton
    cid = a.step_bytes(a.start, b'["')
    for _ in range(25):
        assert torch.equal(runtime.mask(cid).allowed(vocab.vocab_size), brute_mask(a, vocab, cid)), cid
        cid = a.step_bytes(cid, b"a")
