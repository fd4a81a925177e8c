"""What a cold pass leaves for the garbage collector: the automaton's byte rows and a packed grammar's edge rows
are tuples it untracks, so collections during a new schema's first masks do not walk them again and again."""
from __future__ import annotations

import gc
import pickle

import pytest

from rawserve.engine.guided.automaton import UNEXPANDED
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
    edge_rows = [compiled.eps, compiled.byte_edges, compiled.token_edges, compiled.call_edges]
    assert all(isinstance(rows, PackedRows) for rows in edge_rows)
    # the flat ints stay arrays, whose traversal visits no item, not 10k-item lists
    assert all(len(gc.get_referents(ints)) <= 1 for rows in edge_rows for ints in (rows.offsets, rows.flat))
    read = [rows[s] for rows in edge_rows for s in rows._tuples]
    assert len(read) > 100
    assert not any(gc.is_tracked(row) for row in read)


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
    a._edge_lists.clear()  # kept per configuration: read the rows again
    edges = {cid: a._edges(cid) for cid in configs}
    for cid in configs:
        a.next_token[cid] = None  # worked out again
        a.allowed_tokens(cid)
    assert reads == []
    monkeypatch.undo()
    assert sum(map(len, edges.values())) > 100
