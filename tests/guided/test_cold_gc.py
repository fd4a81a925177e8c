"""What a cold pass leaves for the garbage collector: the automaton's byte rows and a packed grammar's edge rows
are tuples it untracks, so collections during a new schema's first masks do not walk them again and again."""
from __future__ import annotations

import gc
import pickle
from array import array

import pytest
import torch

from rawserve.engine.guided.automaton import UNEXPANDED, Automaton
from rawserve.engine.guided.json_schema import schema_to_grammar
from rawserve.engine.guided.matcher import GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.nfa_rows import PackedRows
from rawserve.engine.guided.vocab import VocabIndex
from tests.guided.test_lexemes import GRAMMARS, TEXTS, check_every_place, lexeme_vocab


@pytest.fixture(scope="module")
def vocab() -> VocabIndex:
    tokens, specials = lexeme_vocab()
    return VocabIndex(tokens, specials, len(tokens) + 3)


@pytest.mark.parametrize("name", ["json_object", "schema"])
def test_a_cold_pass_leaves_no_rows_for_the_collector(vocab, name):
    # through pickle, as the core gets its grammars from the compile workers (PackedRows)
    compiled = pickle.loads(pickle.dumps(compile_grammar(GRAMMARS[name], name)))
    runtime = GrammarRuntime(compiled, vocab)
    assert check_every_place(runtime, vocab, TEXTS[name]) > 30  # the masks stay exact
    # a collection untracks the tuples of ints it meets; one of edge tuples met before its edges, at the next
    gc.collect()
    gc.collect()
    a = runtime.automaton
    expanded = [row for row in a.next_byte if row is not UNEXPANDED]
    assert len(expanded) > 30 and len(expanded) < a.num_configs  # unexpanded ones share one row
    assert not any(gc.is_tracked(row) for row in a.next_byte)
    # per NFA state (12k for nested20): bytes, where lists of bools were walked item by item
    assert not gc.is_tracked(compiled.is_final) and not gc.is_tracked(a.consuming)
    # a move of one thread is keyed by that thread: no 1-tuple around it is kept for the young collections to walk
    keys = list(a._moved)
    assert any(len(key) == 2 and isinstance(key[0], int) for key in keys)
    assert not any(len(key) == 1 for key in keys)
    # a token's step and a cut are kept under an int, not a (configuration, token or depth) tuple per entry
    assert len(runtime._token_next) > 30 and all(isinstance(key, int) for key in runtime._token_next)
    assert len(a._truncated) > 10 and all(isinstance(key, int) for key in a._truncated)
    # a walk's ids, and a string's kept close sets, are int64 arrays (or a tensor), which no collection tracks; most
    # masks are shared under an int
    walks = list(runtime._walks.values())
    assert sum(isinstance(walked[1], array) for walked in walks) > 10
    assert all(isinstance(walked[1], (array, torch.Tensor)) and isinstance(walked[2], array) for walked in walks)
    closes = list(runtime._lexeme._closes.values())
    assert len(closes) > 3 and all(isinstance(ids, array) for kept in closes for ids in kept)
    assert sum(isinstance(key, int) for key in runtime._shared) > len(runtime._shared) // 2
    edge_rows = [compiled.eps, compiled.byte_edges, compiled.token_edges, compiled.call_edges]
    assert all(isinstance(rows, PackedRows) for rows in edge_rows)
    # the flat ints stay arrays, whose traversal visits no item, not 10k-item lists
    assert all(len(gc.get_referents(ints)) <= 1 for rows in edge_rows for ints in (rows.offsets, rows.flat))
    read = [rows[s] for rows in edge_rows for s in rows._tuples]
    assert len(read) > 100
    assert not any(gc.is_tracked(row) for row in read)


def test_a_configurations_edges_are_its_states_rows(vocab):
    """Automaton._edges pairs each thread's stack with its state's byte row, the packed grammar's own tuple (MARK's
    one row for every MARK thread), so a new configuration makes a pair per thread and no tuple per edge for the
    young collections to walk (json_object's first pass: ~1,500 fewer, a fifth of its young objects)."""
    compiled = pickle.loads(pickle.dumps(compile_grammar(GRAMMARS["json_object"], "shared_rows")))
    runtime = GrammarRuntime(compiled, vocab)
    check_every_place(runtime, vocab, TEXTS["json_object"])
    a = runtime.automaton
    num_edges = num_shared = 0
    for cid in range(1, a.num_configs):
        for row, sid in a._edges(cid):
            states = [s for s, stack in a.configs[cid] if stack == sid]
            assert any(row is (a._any_byte if s == a.mark else compiled.byte_edges[s]) for s in states), cid
            num_edges += len(row)
        num_shared += len(a._edges(cid)) < sum(len(row) for row, _ in a._edges(cid))
    assert num_edges > 100 and num_shared > 10


def test_a_configurations_edges_die_with_their_read(vocab):
    """Automaton._edges' (row, stack) pairs are made at each read and kept by nothing: kept per configuration, ~1,000
    a json_object pass lived to its young collection, a quarter of the objects that one walked inside a mask."""
    compiled = pickle.loads(pickle.dumps(compile_grammar(GRAMMARS["json_object"], "edges_die")))
    runtime = GrammarRuntime(compiled, vocab)
    gc.collect()
    gc.disable()  # everything the pass leaves alive is young, and listed
    try:
        check_every_place(runtime, vocab, TEXTS["json_object"])
        pairs = [o for o in gc.get_objects(0) if type(o) is tuple and len(o) == 2 and type(o[1]) is int
                 and type(o[0]) is tuple and o[0] and type(o[0][0]) is tuple and len(o[0][0]) == 3]
    finally:
        gc.enable()
    a = runtime.automaton
    assert a.num_configs > 100 and sum(len(a._edges(cid)) for cid in range(1, a.num_configs)) > 100
    assert pairs == []


def test_rows_read_before_are_read_at_c_level_even_when_empty(vocab, monkeypatch):
    """Once a packed state's rows were read, the automaton reads them again through the C-level reader
    (PackedRows.reader), empty ones too: most states have no byte or token edges, and a falsy row sent every read
    of those to PackedRows.__getitem__."""
    compiled = pickle.loads(pickle.dumps(compile_grammar(GRAMMARS["schema"], "c_level_reads")))
    runtime = GrammarRuntime(compiled, vocab)
    check_every_place(runtime, vocab, TEXTS["schema"])
    a = runtime.automaton
    configs = range(1, a.num_configs)
    for cid in configs:  # every row these read is read once (and kept)
        a._edges(cid)
        a.next_token[cid] = None  # worked out again
        a.allowed_tokens(cid)
    assert any(not compiled.byte_edges[s] for cid in configs for s, _ in a.configs[cid] if s != a.mark)
    reads = []
    getitem = PackedRows.__getitem__
    monkeypatch.setattr(PackedRows, "__getitem__", lambda rows, s: reads.append(s) or getitem(rows, s))
    edges = {cid: a._edges(cid) for cid in configs}
    for cid in configs:
        a.next_token[cid] = None  # worked out again
        a.allowed_tokens(cid)
    assert reads == []
    monkeypatch.undo()
    assert sum(len(row) for groups in edges.values() for row, _ in groups) > 100


# a pattern (escaped into the string, json_strings.escape_content), nested objects and a long counted string (virtual
# copies), so every builder a schema's compile runs is met
CYCLE_SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "[a-z\\\\\"]{2,4}"},
    "inner": {"type": "object", "properties": {"note": {"type": "string", "maxLength": 40}}, "required": ["note"]},
    "tags": {"type": "array", "items": {"type": "integer"}}}, "required": ["code", "inner"]}


def test_a_compile_leaves_nothing_only_the_collector_can_free():
    """A schema's grammar, its NFA and the pickle to the core leave no reference cycle: everything they drop is freed
    by its count. A recursive closure is a cycle through its own cell, and count_states' held the builder: nested20's
    whole unpacked NFA (12k states' lists) outlived the compile until a collection found it, walked meanwhile by the
    young and middle collections that followed."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage, to be read
    try:
        compiled = pickle.loads(pickle.dumps(compile_grammar(schema_to_grammar(CYCLE_SCHEMA), "cycles")))
        assert Automaton(compiled).matches(b'{"code": "a\\\\b", "inner": {"note": "x"}}')
        assert compiled.virtual  # the counted string's middle copies: the packed rows read them
        del compiled
        gc.collect()
        ours = [o for o in gc.garbage if getattr(o, "__module__", None) and o.__module__.startswith("rawserve")]
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_the_trie_arrays_a_narrow_walk_reads_are_compact(vocab):
    """VocabIndex.py_arrays: bytes and int32 arrays (1-4 bytes an item), not lists of Python ints: a walk
    reads a few scattered nodes per mask, and between masks the step's logits row evicts them; and they read as the
    level tensors they come from."""
    node_byte, first_child, num_children, node_token = vocab.py_arrays()
    assert isinstance(node_byte, bytes)
    assert all(isinstance(ints, array) and ints.itemsize == 4 for ints in (first_child, num_children, node_token))
    # a collection that meets them visits no item (a list of 333k ints: every one)
    assert all(len(gc.get_referents(ints)) <= 1 for ints in (node_byte, first_child, num_children, node_token))
    assert list(node_byte) == vocab.flat_byte.tolist() and list(node_token) == vocab.flat_token.tolist()
    assert len(first_child) == len(num_children) == len(node_byte) > 100
    # every node but the root is the child of exactly one node
    children = sorted(j for node in range(len(node_byte)) for j in range(first_child[node],
                                                                         first_child[node] + num_children[node]))
    assert children == list(range(1, len(node_byte)))
