"""delta_decode's one-token forms (a step of decodes only) against the plain rule in float64: the conv window and
its state rows, the delta rule on slots in a run, spread over a span (rows between left exactly as they were) and
far apart (gathered and written back), the per-head scaled l2 norm, and the state reads' bags at any batch size;
and the plan of a step of decodes only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rawserve.engine.models import delta_decode
from rawserve.engine.models.delta_decode import decode_conv, decode_rule_at, scaled_l2_normalize
from rawserve.engine.models.gated_delta import StateBatch, causal_conv, l2_normalize, plan_delta_step, \
    state_reads
from tests.engine.test_gated_delta import reference

HEADS, DK, DV, K, CHANNELS = 3, 8, 6, 4, 10
LAYOUTS = {"run": [2, 3, 4], "span": [7, 3, 5], "gathered": [0, 20, 40]}


def decode_plan(slots: list[int]):
    return plan_delta_step(StateBatch(slots, [False] * len(slots)), list(range(len(slots) + 1)), K,
                           torch.device("cpu"))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_decode_conv_is_the_windowed_sum_and_shifts_each_state_by_one(layout):
    """Each output is silu of the taps times (the K - 1 saved inputs, the new one), in float32 (as the rule reads
    it); each slot's state becomes its last K - 1 inputs; no other slot's row changes; causal_conv's history path
    (prefill rows) gives the same outputs and states. x comes as a column slice of a wider row, as in_proj's."""
    gen = torch.Generator().manual_seed(1)
    num_seqs = len(layout)
    wide = torch.randn(num_seqs, CHANNELS + 5, generator=gen)
    x = wide[:, :CHANNELS]
    taps = torch.randn(K, CHANNELS, generator=gen)
    state = torch.randn(48, K - 1, CHANNELS, generator=gen)
    before = state.clone()
    plan = decode_plan(layout)
    assert plan.all_decode and (plan.slot_run is not None) == (layout == LAYOUTS["run"])
    out = decode_conv(x, taps, state, plan)
    assert out.dtype == torch.float32
    for i, slot in enumerate(layout):
        window = torch.cat((before[slot], x[i:i + 1]))  # [K, C], oldest first
        want = F.silu((window.double() * taps.double()).sum(0))
        torch.testing.assert_close(out[i].double(), want, rtol=0, atol=1e-5)
        assert torch.equal(state[slot], window[1:])
    others = [s for s in range(48) if s not in layout]
    assert torch.equal(state[others], before[others])
    # the prefill path (a history of saved rows, then new ones) reads and writes the same layout: the same rows in
    # a step beside a two-token prompt (slot 47), which causal_conv takes (a step of decodes only plans no history)
    assert plan.conv_edge_rows is None
    history_state = before.clone()
    mixed = plan_delta_step(StateBatch(layout + [47], [False] * (num_seqs + 1)),
                            list(range(num_seqs + 1)) + [num_seqs + 2], K, torch.device("cpu"))
    prompt = torch.randn(2, CHANNELS, generator=gen)
    got = causal_conv(torch.cat((x, prompt)), taps, history_state, mixed)
    torch.testing.assert_close(got[:num_seqs], out, rtol=1e-6, atol=1e-6)
    assert torch.equal(history_state[:47], state[:47])


@pytest.fixture(params=["plain", "scaled"])
def form(request, monkeypatch):
    """Both forms of decode_rule: plain (every row folded each step, as a batch under SCALED_MIN_ROWS takes) and
    scaled (the decay kept in the scale, folds as the scale falls), whatever the test's batch size."""
    if request.param == "scaled":
        monkeypatch.setattr(delta_decode, "SCALED_MIN_ROWS", 1)
    return request.param


def unit_qk(num_seqs: int, gen: torch.Generator, dtype: torch.dtype = torch.float64):
    """[B, 2, H, dk] normalised q (scaled by dk^-0.5) and k, v [B, H, dv], as the layer hands them over."""
    wide = torch.randn(num_seqs, 2 * HEADS * DK + HEADS * DV + 3, generator=gen, dtype=torch.float64)
    qk = l2_normalize(wide[:, :2 * HEADS * DK].view(num_seqs, 2, HEADS, DK))
    qk[:, 0] *= DK ** -0.5
    v = wide[:, 2 * HEADS * DK:2 * HEADS * DK + HEADS * DV].view(num_seqs, HEADS, DV)
    return qk.to(dtype), v.to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_decode_rule_follows_the_token_by_token_rule_wherever_the_slots_lie(layout, form):
    """Two decode steps on the same slots: outputs and true states (scale * stored) equal transformers' recurrent
    form; a slot inside the span that is no decode of the step (a live state, and a free one holding NaN) is left
    exactly as it was, its scale too."""
    gen = torch.Generator().manual_seed(2)
    num_seqs = len(layout)
    pool = torch.randn(48, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    scale = torch.ones(48, HEADS, 1, 1, dtype=torch.float64)
    pool[6].fill_(float("nan"))  # inside the span's run (3..7), no decode's: must stay NaN and touch no one
    scale[4] = 0.5  # a live state in the span, no decode's: stored and scale left as they are
    expected = pool * scale
    for step in range(2):
        qk, v = unit_qk(num_seqs, gen)
        g = -torch.rand(num_seqs, HEADS, generator=gen, dtype=torch.float64) * 3
        beta = torch.rand(num_seqs, HEADS, generator=gen, dtype=torch.float64)
        out = decode_rule_at(qk.transpose(1, 2), v.unsqueeze(2), g.exp()[..., None, None], beta[..., None, None],
                             pool, scale, decode_plan(layout))
        assert out.shape == (num_seqs, HEADS, 1, DV)
        for i, slot in enumerate(layout):
            want = reference(expected[slot], qk[i:i + 1, 0], qk[i:i + 1, 1], v[i:i + 1], g[i:i + 1],
                             beta[i:i + 1])
            torch.testing.assert_close(out[i, :, 0], want[0], rtol=0, atol=1e-12)
        others = [s for s in range(48) if s not in layout and s != 6]
        torch.testing.assert_close(pool[layout] * scale[layout], expected[layout], rtol=0, atol=1e-12)
        # (slot 4's scale is a power of two: folded in by the plain form's pass over the span, still exact)
        assert torch.equal(pool[others] * scale[others], expected[others]) and bool(pool[6].isnan().all())
        assert (scale[layout] < 1).any() == (form == "scaled")


def test_scaled_l2_normalize_is_l2_normalize_times_each_heads_scale():
    """q's heads scaled by dk^-0.5 and k's by 1, as l2_normalize and the scale one after the other, from a strided
    column slice [B, 2, H, dk] (as the conv's rows give it) into a new contiguous [B, H, 2, dk] (as state_reads
    reads it in place), x untouched."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 2 * HEADS * DK + 7, generator=gen, dtype=torch.float64)
    x = wide[:, :2 * HEADS * DK].view(5, 2, HEADS, DK)
    x[0, 1, 2] = 0  # a zero head stays zero (the eps inside the root)
    kept = x.clone()
    inv_scale_sq = torch.tensor([float(DK), 1.0], dtype=torch.float64).view(2, 1).expand(2, HEADS)
    want = l2_normalize(x) * torch.tensor([DK ** -0.5, 1.0], dtype=torch.float64).view(2, 1, 1)
    got = scaled_l2_normalize(x, 1e-6 * inv_scale_sq, inv_scale_sq)
    assert got.shape == (5, HEADS, 2, DK) and got.is_contiguous() and torch.equal(x, kept)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-14, atol=0)


def test_state_reads_are_the_batched_product_at_every_batch_size_in_any_order():
    """q S and k S per (sequence, head) from the bags equal the batched product, for q and k as strided views (a
    mixed step's) and contiguous (a decode step's, read in place), batch after batch of other sizes (the bag index
    is grown to the largest and its cuts serve the smaller ones, a size seen before included), at head widths the
    index has not seen."""
    gen = torch.Generator().manual_seed(4)
    for batch, dk in ((3, DK), (1, DK), (6, DK), (2, DK), (3, DK), (6, 5), (4, DK)):
        qk = torch.randn(batch, 2, HEADS, dk + 1, generator=gen, dtype=torch.float64)[..., 1:].transpose(1, 2)
        states = torch.randn(batch, HEADS, dk, DV, generator=gen, dtype=torch.float64)
        for weights in (qk, qk.contiguous()):
            reads = state_reads(weights, states)
            assert reads.shape == (batch, HEADS, 2, DV)
            torch.testing.assert_close(reads, torch.matmul(qk, states), rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_decode_step_plans_the_layers_reads_and_no_conv_history(layout):
    """A step of decodes only: its slots, where the rule finds them (a run read as a view, a span, or gathered),
    fresh slots for both states, no conv history; and the same decode rows as a step that also holds a prompt."""
    fresh = [layout[1]]
    plan = plan_delta_step(StateBatch(layout, [s in fresh for s in layout]), list(range(len(layout) + 1)), K,
                           torch.device("cpu"))
    assert plan.all_decode and plan.num_tokens == len(layout) and not plan.groups
    assert plan.conv_edge_rows is None and plan.conv_head_index is None and plan.conv_state_index is None
    assert plan.slots.tolist() == layout == plan.decode_slots.tolist()
    assert plan.fresh_slots.tolist() == fresh == plan.fresh_recurrent.tolist()
    assert plan.carried_slots.tolist() == [s for s in layout if s not in fresh]
    assert plan.decode_tokens.tolist() == list(range(len(layout)))
    assert (plan.slot_run == 2) == (layout == LAYOUTS["run"])
    # beside a prompt, the decode rows' span (or none) is what the decode step takes where its slots do not run
    mixed = plan_delta_step(StateBatch(layout + [47], [False] * (len(layout) + 1)),
                            list(range(len(layout) + 1)) + [len(layout) + 2], K, torch.device("cpu"))
    if plan.slot_run is None:
        assert plan.decode_span == mixed.decode_span
        if plan.decode_span is not None:
            assert plan.decode_span_rows.tolist() == [r if r < len(layout) else len(layout)
                                                      for r in mixed.decode_span_rows.tolist()]
            assert plan.decode_place.tolist() == mixed.decode_place.tolist()
    else:
        assert plan.decode_span is None
