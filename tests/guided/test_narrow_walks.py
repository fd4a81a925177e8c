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
from tests.guided.test_matcher import brute_mask, reference_step

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
    covered = [any(lo <= b <= hi for row, _ in a._edges(cid) for lo, hi, _ in row) for b in range(256)]
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


# long keys: a walk from before one goes down its letters as a thread on a state that only consumes
LONG_KEYS = {"type": "object", "properties": {"a_long_property_name": {"type": "integer"},
                                              "another_long_name": {"enum": ["abc", "abd"]},
                                              "x": {"type": "string", "maxLength": 40}},
             "required": ["a_long_property_name", "another_long_name", "x"], "additionalProperties": False}
LONG_KEYS_TEXT = '{"a_long_property_name": 12, "another_long_name": "abd", "x": "v\\"w"}'


def _long_key_vocab() -> VocabIndex:
    """The lexeme vocabulary and tokens that run down the keys' letters, cross their closing quotes into what
    follows and open a string value inside one token."""
    tokens, specials = lexeme_vocab()
    extra = [b'{"a_long', b'_property', b'_name', b'_name": 1', b'another', b'_long_name": "a', b'ab', b'"x": "v',
             b'{"a_long_property_name": 12', b'{"alpha_property_one', b'{"beta_property_two": 3']
    base = len(tokens) - len(specials)
    tokens = tokens[:base] + extra + tokens[base:]
    return VocabIndex(tokens, {i + len(extra) for i in specials}, len(tokens) + 3)


def test_a_walk_down_a_keys_letters_interns_none_of_them():
    """A configuration of one thread on a state with lone_edges (a key's letter) is walked by that state's edges:
    masks equal the reference at every place, and a mask before a key interns a handful of configurations, not one
    per letter its tokens pass (the first mask's walk reaches 26 bytes into the first key)."""
    vocab = _long_key_vocab()
    runtime = _cold_runtime(vocab, schema_to_grammar(LONG_KEYS), "lone_walk")
    a = runtime.automaton
    assert torch.equal(runtime.mask(a.start).allowed(vocab.vocab_size), brute_mask(a, vocab, a.start))
    assert a.num_configs <= 6, a.num_configs  # 29 with a configuration per letter
    # before `"x": "v`: the walk crosses the key's closing quote as a thread (its edges cover no lexer state's alive
    # bytes: nothing interned there) and still takes the counted value's opening quote into the lexeme's sets
    before_x = a.step_bytes(a.start, LONG_KEYS_TEXT[:LONG_KEYS_TEXT.index('"x"')].encode())
    num_below = runtime._lexeme.num_below + runtime._tail.num_below
    assert torch.equal(runtime.mask(before_x).allowed(vocab.vocab_size), brute_mask(a, vocab, before_x))
    assert runtime._lexeme.num_below + runtime._tail.num_below == num_below + 1
    assert check_every_place(runtime, vocab, LONG_KEYS_TEXT) > 40


def test_a_walk_goes_on_as_one_thread_once_a_byte_tells_the_keys_apart():
    """Optional keys: the configuration after `{"` has a thread per key, and the one a key's first letter leads to
    is walked on as that key's thread, interning none of its letters; masks equal the reference."""
    vocab = _long_key_vocab()
    schema = {"type": "object", "properties": {"alpha_property_one": {"type": "integer"},
                                               "beta_property_two": {"type": "integer"}},
              "additionalProperties": False}
    runtime = _cold_runtime(vocab, schema_to_grammar(schema), "lone_after_many")
    a = runtime.automaton
    assert torch.equal(runtime.mask(a.start).allowed(vocab.vocab_size), brute_mask(a, vocab, a.start))
    assert a.num_configs <= 12, a.num_configs  # 43 with a configuration per letter
    assert check_every_place(runtime, vocab, '{"alpha_property_one": 12, "beta_property_two": 3}') > 30


def test_bytes_stepped_as_one_thread_lead_where_the_reference_does():
    """step_bytes walks a token's bytes as one thread where it can and interns only where it ends: from every
    configuration a pass reaches, every token lands on the threads the reference steps to (and each configuration's
    edge bytes are its edges')."""
    vocab = _long_key_vocab()
    runtime = _cold_runtime(vocab, schema_to_grammar(LONG_KEYS), "lone_steps")
    check_every_place(runtime, vocab, LONG_KEYS_TEXT)
    a = runtime.automaton
    num_lone = 0
    for cid in range(1, a.num_configs):
        num_lone += a.lone_thread(cid) is not None
        # one thread's configuration reads its edge bytes off its state (state_covers), not an edge list
        edges = a._edges(cid)
        assert a.edge_bytes(cid) == sum(1 << b for b in range(256)
                                        if any(lo <= b <= hi for row, _ in edges for lo, hi, _ in row))
        for data in vocab.token_bytes:
            threads = a.configs[cid]
            for byte in data:
                threads = reference_step(a, threads, byte)
            assert a.configs[a.step_bytes(cid, data)] == threads, (cid, data)
    assert num_lone >= 20


def test_a_grammar_without_special_tokens_reads_no_token_rows(vocab, monkeypatch):
    """Its configurations all answer allowed_tokens with one empty dict, no token row read; one with special
    tokens still works its out (test_a_configurations_special_tokens_are_worked_out_once)."""
    a = Automaton(compile_grammar(schema_to_grammar(SCHEMA), "no_tokens"))
    monkeypatch.setattr(a, "_read_tokens", lambda s: pytest.fail("a token row was read"))
    cid = a.step_bytes(a.start, b'{"order": "ORD-0')
    assert cid != DEAD and a.allowed_tokens(a.start) == {} and a.allowed_tokens(cid) == {}
