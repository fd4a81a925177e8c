"""A wave of prompts in one step, as many new requests reach the engine at once: the prefill conv in blocks of rows
(the same values as one pass, each sequence from its own saved inputs), the scale fold that reads no fresh slot, a
prefill group on a run of slots scanned in the pool's own rows, and a step of one group's rows read back whole.
float64 against the token-by-token rule, stale values in every slot the step must not read."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rawserve.engine.models import gated_delta
from rawserve.engine.models.gated_delta import StateBatch, causal_conv, fold_scales, gated_delta_rule, \
    l2_normalize, plan_delta_step
from tests.engine.test_gated_delta import DK, DV, HEADS, reference, step_inputs

K, CHANNELS = 4, 10
LAYOUTS = {"run": [2, 3, 4, 5], "gathered": [6, 1, 4, 0]}


def starts_of(lengths: list[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


@pytest.mark.parametrize("layout", [[2, 3, 4, 5, 6], [6, 1, 4, 0, 7]], ids=["run", "gathered"])
def test_prefill_conv_in_blocks_of_rows_is_each_sequences_windowed_sum(monkeypatch, layout):
    """Prompts of 7, 2, 12, 1 and 3 tokens (fewer, as many and more than the K - 1 saved inputs; the first fresh,
    zeroed as the layer zeroes it) in blocks of 5 rows, so blocks end inside sequences and between them: each
    output is silu of the taps times its window of (saved inputs, new inputs) in float32 (as the rule reads it),
    what one whole-step pass gives, and each state its last K - 1 inputs."""
    gen = torch.Generator().manual_seed(11)
    lengths = [7, 2, 12, 1, 3]
    starts = starts_of(lengths)
    wide = torch.randn(starts[-1], CHANNELS + 3, generator=gen, dtype=torch.float64)
    x = wide[:, :CHANNELS]  # a column slice, as in_proj's output hands it over
    taps = torch.randn(K, CHANNELS, generator=gen, dtype=torch.float64)
    pool = torch.randn(8, K - 1, CHANNELS, generator=gen, dtype=torch.float64)
    plan = plan_delta_step(StateBatch(layout, [True] + [False] * 4), starts, K, torch.device("cpu"))
    pool.index_fill_(0, plan.fresh_slots, 0)  # what GatedDeltaNetLayer.forward does for fresh slots
    before = pool.clone()
    results = {}
    for block_rows in (5, 1 << 20):
        monkeypatch.setattr(gated_delta, "CONV_BLOCK_ROWS", block_rows)
        state = before.clone()
        results[block_rows] = causal_conv(x, taps, state, plan), state
    (out, state), (whole, whole_state) = results[5], results[1 << 20]
    assert out.dtype == torch.float32 and torch.equal(state, whole_state)
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    for slot, start, end in zip(layout, starts, starts[1:]):
        history = torch.cat((before[slot], x[start:end]))  # [K - 1 + n, C], oldest first
        want = F.silu(torch.stack([(history[t:t + K] * taps).sum(0) for t in range(end - start)]))
        torch.testing.assert_close(out[start:end].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(state[slot], history[-(K - 1):])
    others = [s for s in range(8) if s not in layout]
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_fold_reads_only_carried_states_and_resets_every_scale(layout):
    """Slots with scales below 1: a carried prefill, a fresh prefill, a carried decode and a fresh one-token
    prompt. fold_scales folds the carried ones, leaves the fresh prefill's stale state as it was (the rule writes
    it whole) and sets every scale to 1; the rule then follows the token-by-token rule from the true states."""
    gen = torch.Generator().manual_seed(12)
    pool = torch.randn(8, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    scale = torch.rand(8, HEADS, 1, 1, generator=gen, dtype=torch.float64) * 0.5 + 0.01
    fresh = [False, True, False, True]
    lengths = [5, 6, 1, 1]
    starts = starts_of(lengths)
    truth = [torch.zeros(HEADS, DK, DV, dtype=torch.float64) if is_fresh else pool[slot] * scale[slot]
             for slot, is_fresh in zip(layout, fresh)]
    plan = plan_delta_step(StateBatch(layout, fresh), starts, K, torch.device("cpu"), chunk_size=4)
    pool.index_fill_(0, plan.fresh_recurrent, 0)  # what GatedDeltaNetLayer.forward does for a fresh decode row
    before, scale_before = pool.clone(), scale.clone()
    fold_scales(pool, scale, plan)
    assert bool((scale[layout] == 1).all())
    untouched = [s for s in range(8) if s not in layout]
    assert torch.equal(scale[untouched], scale_before[untouched]) and torch.equal(pool[untouched], before[untouched])
    assert torch.equal(pool[layout[1]], before[layout[1]])  # the fresh prefill's state: not read, not written
    for slot in (layout[0], layout[2]):
        assert torch.equal(pool[slot], before[slot] * scale_before[slot])
    q, k, v, g, beta = step_inputs(starts[-1], seed=13)
    out = gated_delta_rule(q, k, v, g, beta, pool, plan)
    for i, slot in enumerate(layout):
        rows = slice(starts[i], starts[i + 1])
        want = reference(truth[i], q[rows], k[rows], v[rows], g[rows], beta[rows])
        torch.testing.assert_close(out[rows], want, rtol=0, atol=1e-10)
        torch.testing.assert_close(pool[slot], truth[i], rtol=0, atol=1e-10)


# batch order of four slots -> the slot run of the fresh step's group and of the carried step's
WAVES = {"run": ([2, 3, 4, 5], 2, 2), "reversed": ([5, 4, 3, 2], 2, None), "gathered": ([6, 1, 4, 0], None, None)}


@pytest.mark.parametrize("layout, fresh_run, carried_run", WAVES.values(), ids=WAVES.keys())
def test_a_wave_on_a_run_of_slots_is_scanned_in_place_and_read_back_whole(layout, fresh_run, carried_run):
    """Four fresh prompts of 9 tokens in one step (one group, nothing else in the step: its read-back is the
    step's output), then each carried by 6, 5, 5 and 5 tokens beside a decode row of another slot. A group whose
    slots make a run, in any batch order when their lengths are equal, scans the pool's rows in place; anywhere,
    every output and state follows the token-by-token rule, and no other slot changes."""
    gen = torch.Generator().manual_seed(14)
    pool = torch.randn(8, HEADS, DK, DV, generator=gen, dtype=torch.float64) * 100  # stale: a read shows
    expected = pool.clone()
    for slot in layout:
        expected[slot].zero_()
    decode_slot = 7
    steps = [(list(layout), [9, 9, 9, 9], True, fresh_run),
             (list(layout) + [decode_slot], [6, 5, 5, 5, 1], False, carried_run)]
    for seed, (slots, lengths, is_fresh, run) in enumerate(steps):
        starts = starts_of(lengths)
        plan = plan_delta_step(StateBatch(slots, [is_fresh] * len(slots)), starts, K, torch.device("cpu"), 4)
        assert len(plan.groups) == 1
        group = plan.groups[0]
        assert group.slot_run == run
        assert (group.tokens.numel() == plan.num_tokens) == is_fresh  # the decode row: not read back whole
        q, k, v, g, beta = step_inputs(starts[-1], seed=20 + seed)
        out = gated_delta_rule(q, k, v, g, beta, pool, plan)
        for slot, start, end in zip(slots, starts, starts[1:]):
            want = reference(expected[slot], q[start:end], k[start:end], v[start:end], g[start:end],
                             beta[start:end])
            torch.testing.assert_close(out[start:end], want, rtol=0, atol=1e-10)
        torch.testing.assert_close(pool, expected, rtol=0, atol=1e-10)


def test_l2_normalize_divides_by_the_root_of_the_sum_of_squares_plus_eps():
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (a zero row stays zero), times a factor per head when given,
    in place when asked."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(5, HEADS, DK, generator=gen, dtype=torch.float64)
    x[1, 2] = 0
    want = x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(l2_normalize(x), want, rtol=1e-14, atol=0)
    factor = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64).view(HEADS, 1)
    got = l2_normalize(x, factor, inplace=True)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(got, want * factor, rtol=1e-14, atol=0)
