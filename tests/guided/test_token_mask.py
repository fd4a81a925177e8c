"""TokenMask.apply: a short allow list written through the row's memory (no torch op) masks a row exactly as the
torch ops do, touches no other row, and leaves rows it cannot write that way to the torch ops."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rawserve.engine.guided.grammar import Grammar, lit
from rawserve.engine.guided.matcher import GrammarRuntime, GuidedState, apply_masks
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.token_mask import SHORT_MAX_IDS, TokenMask, apply_rows, id_tensor
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


def test_masking_many_rows_at_once_masks_each_as_its_own_apply_does():
    """apply_rows (a GPU step's masks in a fixed number of ops) against each mask's apply() and the element-by-element
    expectation: allow and ban lists, accepting or not, one that allows nothing, end ids inside a ban list and
    among an allow list's ids, rows left unconstrained between them."""
    gen = torch.Generator().manual_seed(7)
    banned = (2, 3, 40, 41)
    masks = [  # (mask, end ids, the ids it leaves as they are)
        (TokenMask(True, id_tensor([1, 9, 500]), 3, False), [3], [1, 9, 500]),
        (TokenMask(True, id_tensor([1, 9, 500]), 3, True), [3, 998], [1, 9, 500, 3, 998]),
        (TokenMask(True, id_tensor([3, 4]), 2, True), [3], [3, 4]),  # an end id among the allowed ones
        (TokenMask(True, id_tensor([]), 0, False), [7], [7]),  # allows nothing: the end id stays
        (TokenMask(False, id_tensor(banned), V - 4, False), [3], [i for i in range(V) if i not in banned]),
        # accepting: the end id 3, banned by the grammar's list, stays
        (TokenMask(False, id_tensor(banned), V - 4, True), [3], [i for i in range(V) if i not in banned or i == 3]),
        (TokenMask.short([5, 6], True), [8], [5, 6, 8]),
    ]
    logits = torch.randn(10, V, generator=gen)
    rows = [(row, m, eos) for row, (m, eos, _) in zip((0, 2, 3, 5, 7, 8, 9), masks)]
    one_by_one, at_once = logits.clone(), logits.clone()
    for row, mask, eos in rows:
        mask.apply(one_by_one[row], eos)
    apply_rows(at_once, rows)
    assert torch.equal(at_once, one_by_one)
    for (row, _, _), (_, _, kept) in zip(rows, masks):
        assert torch.equal(at_once[row], expected(logits[row], kept, []))
    assert torch.equal(at_once[[1, 4, 6]], logits[[1, 4, 6]])


def test_masking_no_rows_at_once_changes_nothing():
    logits = torch.randn(2, V)
    before = logits.clone()
    apply_rows(logits, [])
    assert torch.equal(logits, before)


class CountOps(TorchDispatchMode):
    """Counts the torch ops that run (views left out): on a GPU each is a kernel launch the host pays for."""

    VIEWS = {"select", "slice", "view", "alias", "_unsafe_view", "lift_fresh", "detach", "as_strided"}

    def __init__(self) -> None:
        super().__init__()
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in self.VIEWS:
            self.num_ops += 1
        return func(*args, **(kwargs or {}))


def test_masking_many_rows_at_once_takes_a_fixed_number_of_torch_ops():
    rows = []
    for i in range(32):  # allow lists, accepting or not, and ban lists, as a GPU step's rows hold them
        if i % 3 == 2:
            rows.append((i, TokenMask(False, id_tensor(range(i, V, 7)), V - len(range(i, V, 7)), i % 2 == 0), [3]))
        else:
            rows.append((i, TokenMask(True, id_tensor([i, 100 + i, 900]), 3, i % 2 == 0), [3]))
    logits = torch.randn(32, V)
    apply_rows(logits, rows)  # the end ids' tensor made once
    with CountOps() as at_once:
        apply_rows(logits, rows)
    with CountOps() as eight:
        apply_rows(logits, rows[:8])
    with CountOps() as row_by_row:
        for i, mask, eos in rows:
            mask.apply(logits[i], eos)
    assert at_once.num_ops == eight.num_ops <= 20
    assert row_by_row.num_ops >= 3 * 32
