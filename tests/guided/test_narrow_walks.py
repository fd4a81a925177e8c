"""A narrow configuration's mask (a key's, an enum's, a number's) without its row: its walk and its refusals read
the bytes its edges cover and step those alone, kept per configuration; a counted string's proven places matched
without theirs; closures of equal moved threads made once; special tokens worked out once; and the shared masks the
vocabulary owns (engine/guided/automaton.py, matcher.py, lexemes.py, vocab.py). Masks stay equal to brute force."""
from __future__ import annotations

import pickle

import pytest
import torch

from rawserve.engine.guided.automaton import DEAD, Automaton
from rawserve.engine.guided.grammar import Grammar, Token, alt, lit, seq
from rawserve.engine.guided.json_schema import schema_to_grammar
from rawserve.engine.guided.lexemes import MAX_KEPT_COVERS, SHIFT_SPARE, string_lexer
from rawserve.engine.guided.matcher import DENSE_WALK_FIRST_BYTES, GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.shared_masks import SharedMasks
from rawserve.engine.guided.vocab import VocabIndex
from tests.guided.test_lexemes import GRAMMARS, TEXTS, check_every_place, lexeme_vocab
from tests.guided.test_matcher import brute_mask

# keys, an enum, integers, a boolean and strings: most places are narrow
SCHEMA = {"type": "object", "properties": {
    "order": {"type": "string", "pattern": "^ORD-[0-9]{3}$"},
    "status": {"enum": ["paid", "shipped", "pending"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 250},
    "gift": {"type": "boolean"},
    "note": {"type": "string"},
}, "required": ["order", "status", "count", "gift", "note"], "additionalProperties": False}
TEXT = '{"order": "ORD-042", "status": "shipped", "count": 117, "gift": false, "note": "a\\"b"}'


@pytest.fixture(scope="module")
def vocab() -> VocabIndex:
    tokens, specials = lexeme_vocab()
    return VocabIndex(tokens, specials, len(tokens) + 3)


def _cold_runtime(vocab: VocabIndex, grammar: Grammar, key: str) -> GrammarRuntime:
    # through pickle, as the core gets its grammars (PackedRows); the vocabulary's shared masks emptied, so every
    # mask is made here
    vocab.shared_masks.clear()
    return GrammarRuntime(pickle.loads(pickle.dumps(compile_grammar(grammar, key))), vocab)


def test_narrow_configurations_are_masked_without_building_their_rows(vocab):
    """Masks equal brute force at every place, and the narrow configurations masked (whose edges cover few bytes)
    mostly have no row: their walk, the string lexeme's refusal and a counted place's refusal read their edges."""
    runtime = _cold_runtime(vocab, schema_to_grammar(SCHEMA), "narrow")
    assert check_every_place(runtime, vocab, TEXT) > 40
    a = runtime.automaton
    narrow = [c for c in runtime._masks if c != DEAD and a.edge_bytes(c).bit_count() <= DENSE_WALK_FIRST_BYTES]
    unbuilt = [c for c in narrow if a.next_byte[c][0] < 0]
    assert runtime.num_walks["python"] >= 20
    assert len(unbuilt) >= 0.8 * len(narrow) and len(unbuilt) >= 20, (len(unbuilt), len(narrow))


@pytest.mark.parametrize("name", ["json_object", "schema"])
def test_bytes_stepped_without_a_row_lead_where_the_row_does(vocab, name):
    """Every configuration stepped a few bytes at a time (step_some: a narrow walk's wide trie nodes read in its
    edges' runs, the bytes no edge takes answered DEAD unstepped) leads where its row, built after, does."""
    runtime = _cold_runtime(vocab, GRAMMARS[name], f"steps_{name}")
    check_every_place(runtime, vocab, TEXTS[name])
    a = runtime.automaton
    stepped = {c: dict(known) for c, known in a._partial.items() if a.next_byte[c][0] < 0}
    assert len(stepped) >= 20
    num_dead = 0
    for c, known in stepped.items():
        row = a.expand(c)
        assert all(row[b] == nxt for b, nxt in known.items()), c
        num_dead += sum(nxt == DEAD for nxt in known.values())
        assert set(a.edge_runs(c)) == set(_runs(a, c)), c
    assert num_dead >= 20


def _runs(a: Automaton, cid: int) -> list[tuple[int, int]]:
    """The maximal runs [begin, end) of bytes some edge of cid's threads takes, byte by byte."""
    covered = [any(lo <= b <= hi for lo, hi, _, _ in a._edges(cid)) for b in range(256)]
    runs = []
    for b in range(256):
        if covered[b] and (b == 0 or not covered[b - 1]):
            runs.append([b, b + 1])
        elif covered[b]:
            runs[-1][1] = b + 1
    return [tuple(r) for r in runs]


def test_equal_moved_threads_are_closed_once(vocab, monkeypatch):
    """A byte of one configuration and a byte of another that move the same threads share one closure (Automaton's
    _moved), where each configuration's steps made their own: a cold pass closes no set of threads twice but for
    a few met in another order."""
    calls: list[frozenset] = []
    closure = Automaton._closure
    monkeypatch.setattr(Automaton, "_closure", lambda self, threads: calls.append(frozenset(threads))
                        or closure(self, threads))
    runtime = _cold_runtime(vocab, GRAMMARS["json_object"], "closed_once")
    check_every_place(runtime, vocab, TEXTS["json_object"])
    assert len(calls) > 100
    assert len(calls) <= 1.05 * len(set(calls)), (len(calls), len(set(calls)))


def test_a_configurations_special_tokens_are_worked_out_once(vocab, monkeypatch):
    """allowed_tokens reads a configuration's token edges once, also when it takes none (most configurations: a
    mask and an advance ask it each)."""
    grammar = Grammar({"root": seq(lit("a"), alt(Token(len(vocab.token_bytes) - 1), lit("b")))})
    a = Automaton(compile_grammar(grammar, "tokens_once"))
    after_a = a.step_bytes(a.start, b"a")
    reads: list[int] = []
    read = a._read_tokens
    monkeypatch.setattr(a, "_read_tokens", lambda s: reads.append(s) or read(s))
    for _ in range(3):
        assert a.allowed_tokens(a.start) == {}
        assert list(a.allowed_tokens(after_a)) == [len(vocab.token_bytes) - 1]
    assert len(reads) == len(a.configs[a.start]) + len(a.configs[after_a])


def test_may_pair_answers_as_the_alive_sets_do_and_keeps_a_bounded_few():
    lexer = string_lexer()
    lexer._may_pair.clear()
    start = lexer.start_alive
    assert lexer.may_pair(start) and lexer.may_pair((1 << 256) - 1)
    assert not lexer.may_pair(1 << ord("a"))
    for covered in range(MAX_KEPT_COVERS + 10):  # small sets: none covers a lexer state's alive bytes
        assert lexer.may_pair(covered) == any(m & ~covered == 0 for m in lexer.alive_masks)
        assert len(lexer._may_pair) <= MAX_KEPT_COVERS


def test_a_vocabulary_read_from_its_disk_cache_owns_its_shared_masks(vocab):
    """Made with the index, built or read back (load_vocab_index's cache), never hung on it by the first mask."""
    loaded = VocabIndex.from_state_dict(vocab.state_dict())
    assert isinstance(vocab.shared_masks, SharedMasks) and isinstance(loaded.shared_masks, SharedMasks)
    assert loaded.shared_masks is not vocab.shared_masks and len(loaded.shared_masks) == 0
    runtime = GrammarRuntime(compile_grammar(schema_to_grammar(SCHEMA), "loaded"), loaded)
    check_every_place(runtime, loaded, TEXT)
    assert len(loaded.shared_masks) > 10 and runtime._shared_masks is loaded.shared_masks


def test_a_counted_strings_places_are_matched_without_their_rows(vocab):
    """A maxLength string's place with room that a kept pairing proves (LexemeWalk._match_counted, a copy apart) is
    matched without building its row; its mask is exact, and a token inside the string advances from it to where
    its bytes step."""
    room = SHIFT_SPARE + max(map(len, vocab.token_bytes))
    runtime = _cold_runtime(vocab, schema_to_grammar({"type": "string", "maxLength": 4 * room}), "counted_rowless")
    check_every_place(runtime, vocab, '"abc de"')  # proves the run's places on the way
    a, lexeme = runtime.automaton, runtime._lexeme
    run = a.shift_key(a.step_bytes(a.start, b'"ab'))[1]
    reached = max(lexeme._counted_run, key=a.shift_low)
    fresh = [a.shift_by(reached, run, k) for k in (3, 5, 8, room)]  # places no text reached
    assert len(set(fresh)) == 4 and all(c is not None and a.next_byte[c][0] < 0 for c in fresh)
    close = lexeme.match(reached)[1]
    for cid in fresh:
        assert lexeme.match(cid) == (string_lexer().start, close)
        assert a.next_byte[cid][0] < 0, cid  # matched without its row
        assert torch.equal(runtime.mask(cid).allowed(vocab.vocab_size), brute_mask(a, vocab, cid)), cid
        for t, data in enumerate(vocab.token_bytes):
            shifted = lexeme.advance_counted(cid, data) if data and t not in vocab.special_set else None
            if shifted is not None:
                assert shifted == a.step_bytes(cid, data), (cid, data)
