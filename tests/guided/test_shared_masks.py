"""Masks shared across grammars on one vocabulary (engine/guided/shared_masks.py): a grammar compiled with the cache
cold and one compiled after it, sharing its lexemes, both mask as brute force does; the cache's bound and its one
object per key under threads."""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from rawserve.engine.guided.grammar import Grammar, Repeat, alt, lit, seq
from rawserve.engine.guided.json_schema import schema_to_grammar
from rawserve.engine.guided.matcher import GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.shared_masks import ENTRY_OVERHEAD_BYTES, SharedMasks
from rawserve.engine.guided.token_mask import TokenMask
from rawserve.engine.guided.vocab import VocabIndex
from tests.guided.test_lexemes import check_every_place, lexeme_vocab


@pytest.fixture()
def vocab() -> VocabIndex:
    tokens, specials = lexeme_vocab()
    return VocabIndex(tokens, specials, len(tokens) + 3)


def _schema(suffix: str, max_length: int) -> dict:
    """Plain strings, a counted one (its places take the lexeme's tokens by count), an enum, an integer and an array
    of strings: the lexemes a schema shares with any other, under keys named by `suffix`."""
    props = {f"name{suffix}": {"type": "string"},
             f"code{suffix}": {"type": "string", "maxLength": max_length},
             f"kind{suffix}": {"enum": ["a", "b\"c"]},
             f"n{suffix}": {"type": "integer"},
             f"tags{suffix}": {"type": "array", "items": {"type": "string"}}}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def _text(suffix: str, code: str) -> str:
    return (f'{{"name{suffix}": "v\\"é中", "code{suffix}": "{code}", "kind{suffix}": "b\\"c", "n{suffix}": -12, '
            f'"tags{suffix}": ["x", "\\u00e9"]}}')


def test_a_grammar_after_another_that_shares_its_lexemes_masks_as_brute_force(vocab):
    """The first grammar fills the vocabulary's shared masks from nothing; the second (its keys renamed, its counted
    string a bound apart, so some counted places meet masks the first made at another place) takes many of its
    masks from there. Both equal brute force at every place, and the second really took shared ones."""
    shared = vocab.shared_masks
    shared.clear()
    first = GrammarRuntime(compile_grammar(schema_to_grammar(_schema("", 5)), "first"), vocab)
    check_every_place(first, vocab, _text("", "ab\\né"))
    assert shared.num_hits > 0  # within one grammar: a string's places and its strings share close sets
    kept, hits = len(shared), shared.num_hits
    second = GrammarRuntime(compile_grammar(schema_to_grammar(_schema("_2", 6)), "second"), vocab)
    check_every_place(second, vocab, _text("_2", "a\\u00e9中b!"))
    assert shared.num_hits - hits > 20, (shared.num_hits, hits)
    assert len(shared) > kept  # and made those the first never needed
    # one object per allowed set: the second grammar's masks that the first made are the first's
    firsts = {id(m) for m in first._masks.values()}
    assert sum(id(m) in firsts for m in second._masks.values()) > 10


def test_a_shared_mask_keeps_whether_its_configuration_accepts(vocab):
    """After `x` and after `y` the grammar allows the same tokens (runs of `a`), but only after `y` may it end there
    (EOS): the shared mask of one is not the other's."""
    vocab.shared_masks.clear()
    grammar = Grammar({"root": alt(seq(lit("x"), Repeat(lit("a"), 1, None)), seq(lit("y"), Repeat(lit("a"), 0, None)))})
    runtime = GrammarRuntime(compile_grammar(grammar, "accepting"), vocab)
    a = runtime.automaton
    after_x, after_y = (a.step_bytes(a.start, byte) for byte in (b"x", b"y"))
    assert not a.is_accepting[after_x] and a.is_accepting[after_y]
    masks = [runtime.mask(cid) for cid in (after_x, after_y)]
    assert torch.equal(masks[0].allowed(vocab.vocab_size), masks[1].allowed(vocab.vocab_size))
    assert [m.accepting for m in masks] == [False, True]


def test_a_mask_is_found_by_its_allowed_set_whatever_order_the_walk_gave_its_ids(vocab):
    """_list_mask and _lexeme_mask key a mask by the walked ids as a set: the same ids in another order, repeated, or
    split between the walk's and the ones checked one by one, find the one mask; one id more is another mask, which
    allows it."""
    from rawserve.engine.guided.lexemes import string_lexeme

    vocab.shared_masks.clear()
    runtime = GrammarRuntime(compile_grammar(schema_to_grammar(_schema("", 5)), "by_set"), vocab)
    ids = [7, 3, 11, 5]
    made = runtime._list_mask(ids, [], False)
    assert runtime._list_mask([11, 5, 3, 7, 3], [], False) is made
    assert runtime._list_mask([5, 11], [7, 3], False) is made
    more = runtime._list_mask(ids, [13], False)
    assert more is not made and more.allowed(vocab.vocab_size)[13] and not made.allowed(vocab.vocab_size)[13]
    assert made.ids.tolist() == sorted(ids)  # a narrow mask's ids stay sorted
    # a set takes more than 8 bytes an id: the shared masks' bound counts what the key really holds
    vocab.shared_masks.clear()
    wide = list(range(3, 603, 2))
    kept = runtime._list_mask(wide, [], True)
    assert vocab.shared_masks.nbytes == kept.ids.nbytes + sys.getsizeof(frozenset(wide)) + ENTRY_OVERHEAD_BYTES
    assert sys.getsizeof(frozenset(wide)) > 16 * len(wide)
    lexeme = string_lexeme(vocab)
    inside = runtime._lexeme_mask(lexeme, ids, [], False)
    assert runtime._lexeme_mask(lexeme, [11, 5, 3, 7, 7], [], False) is inside
    assert runtime._lexeme_mask(lexeme, [5, 11], [3, 7], False) is inside
    assert lexeme.is_ban_list  # from a character boundary most tokens stay inside
    banned = next(t for t in lexeme.ids.tolist() if t not in ids)
    wider = runtime._lexeme_mask(lexeme, ids, [banned], False)  # a banned token the walk allows: its own mask
    assert wider is not inside
    assert wider.allowed(vocab.vocab_size)[banned] and not inside.allowed(vocab.vocab_size)[banned]


def _mask(num_ids: int) -> TokenMask:
    return TokenMask(True, torch.arange(num_ids, dtype=torch.int64), num_ids, False)


def test_shared_masks_past_their_byte_bound_drop_the_least_recently_used():
    entry = 8 * 100 + 16 + ENTRY_OVERHEAD_BYTES  # a mask of 100 ids under a key whose ids take 16 bytes
    shared = SharedMasks(max_bytes=3 * entry)
    for i in range(3):
        shared.put(("ids", i), _mask(100), 16)
    assert shared.get(("ids", 0)) is not None  # now the most recently used
    shared.put(("ids", 3), _mask(100), 16)
    assert shared.get(("ids", 1)) is None and shared.get(("ids", 0)) is not None and len(shared) == 3
    assert shared.nbytes == 3 * entry
    big = _mask(10_000)
    assert shared.put(("ids", "big"), big, 16) is big and shared.get(("ids", "big")) is None  # over the bound alone


def test_threads_putting_one_key_keep_one_mask():
    """The mask worker and the step's thread may make the same mask at once: every put of a key returns the first
    kept, so equal masks stay one object, and the byte count stays exact."""
    shared = SharedMasks()
    kept: list[list[TokenMask]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def put_all(i: int) -> None:
        barrier.wait()
        for k in range(300):
            kept[i].append(shared.put(("ids", k), _mask(4), 8))

    threads = [threading.Thread(target=put_all, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(300):
        assert len({id(kept[i][k]) for i in range(4)}) == 1
    assert len(shared) == 300 and shared.nbytes == 300 * (8 * 4 + 8 + ENTRY_OVERHEAD_BYTES)
