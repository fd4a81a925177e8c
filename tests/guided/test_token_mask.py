"""TokenMask.apply: a short allow list written through the row's memory (no torch op) masks a row exactly as the
torch ops do, touches no other row, and leaves rows it cannot write that way to the torch ops."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.guided.grammar import Grammar, lit
from rawserve.engine.guided.matcher import GrammarRuntime, GuidedState, apply_masks
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.token_mask import SHORT_MAX_IDS, TokenMask, id_tensor
from rawserve.engine.guided.vocab import VocabIndex

V = 1000
NEG_INF = float("-inf")


def expected(row: torch.Tensor, allowed: list[int], keep: list[int]) -> torch.Tensor:
    """The row with every id outside `allowed` and `keep` set to -inf, made element by element."""
    out = torch.full_like(row, NEG_INF)
    for i in (*allowed, *keep):
        out[i] = row[i]
    return out


CASES = [  # (allowed ids, accepting, EOS ids)
    ([0, 5, 17, V - 1], False, [3]),
    ([0, 5, 17, V - 1], True, [3, 998]),
    (list(range(40, 40 + SHORT_MAX_IDS)), True, [2]),
    ([], False, [7]),  # allows nothing: EOS stays, so the request can end
    ([12], True, []),
]


@pytest.mark.parametrize("allowed, accepting, eos", CASES)
def test_a_short_mask_masks_a_row_as_the_torch_ops_do(allowed, accepting, eos):
    short = TokenMask.short(allowed, accepting)
    assert short.id_list == tuple(allowed)
    plain = TokenMask(True, id_tensor(allowed), len(allowed), accepting)
    logits = torch.randn(3, V)
    logits[1, 5] = NEG_INF  # an id already banned by an earlier processor stays banned
    before = logits.clone()
    keep = eos if (accepting or not allowed) else []
    short.apply(logits[1], eos)
    assert torch.equal(logits[1], expected(before[1], allowed, keep))
    # the rows either side are untouched: the write starts at the row's own offset and stops at its end
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    row = before[1].clone()
    plain.apply(row, eos)
    assert torch.equal(logits[1], row)
    assert torch.equal(short.ids, id_tensor(allowed)) and short.nbytes == 8 * len(allowed)


@pytest.mark.parametrize("make_row", [
    lambda: torch.randn(V, 2)[:, 0],  # not contiguous
    lambda: torch.randn(V, dtype=torch.bfloat16),  # not float32
    lambda: torch.randn(V, dtype=torch.float64),
])
def test_rows_the_memory_path_cannot_write_go_through_the_torch_ops(make_row):
    allowed = [1, 2, 900]
    row = make_row()
    before = row.clone()
    TokenMask.short(allowed, True).apply(row, [4])
    assert torch.equal(row, expected(before, allowed, [4]))


def test_an_id_past_the_row_raises_and_writes_nothing():
    row = torch.randn(V)
    before = row.clone()
    with pytest.raises((IndexError, RuntimeError)):
        TokenMask.short([3, V + 5], False).apply(row, [])
    assert torch.equal(row, before)
    with pytest.raises((IndexError, RuntimeError)):
        TokenMask.short([3], True).apply(row, [V])  # an EOS id past the row
    assert torch.equal(row, before)


def test_a_grammar_s_narrow_masks_are_short_and_mask_the_engine_s_rows():
    tokens = [bytes([b]) for b in range(256)] + [b"ab", b"abc", b"bc", b"c}"]
    vocab = VocabIndex(tokens, set(), len(tokens))
    runtime = GrammarRuntime(compile_grammar(Grammar({"root": lit("abc}")}), "abc"), vocab)
    state = GuidedState(runtime)
    mask = state.mask()
    assert mask.id_list == (ord("a"), 256, 257)  # `a`, `ab`, `abc`: kept as ints, no tensor made yet
    logits = torch.randn(2, len(tokens))
    before = logits.clone()
    apply_masks(logits, [(1, state, [0])])
    assert torch.equal(logits[0], before[0])
    assert torch.equal(logits[1], expected(before[1], [ord("a"), 256, 257], []))
    assert torch.equal(mask.allowed(len(tokens)).nonzero().squeeze(1), torch.tensor([ord("a"), 256, 257]))


def test_a_short_mask_on_a_float32_cpu_row_runs_no_torch_op(monkeypatch):
    """What it is for: after a forward each torch op's first call costs several times its warm cost, and a key's
    mask would be three of them."""
    def refuse(*args, **kwargs):
        raise AssertionError("a torch op ran")

    for name in ("fill_", "index_select", "index_copy_", "index_fill_", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    row = torch.randn(V)
    before = row.clone()
    TokenMask.short([0, 9, V - 1], True).apply(row, [4])
    monkeypatch.undo()
    assert torch.equal(row, expected(before, [0, 9, V - 1], [4]))
