"""The recurrent state's scale (gated_delta's module docstring: true state = scale * stored) against the plain
two-pass rule in float64: long decode runs through tiny decays and decays of exactly 0 (folds), a prefill chunk
after scaled decodes (fold_scales before the chunked rule), and slot copies that carry the scale."""
from __future__ import annotations

import types

import pytest
import torch

from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.models.delta_decode import FOLD_BELOW, SCALED_MIN_ROWS, decode_rule_at
from rawserve.engine.models.gated_delta import StateBatch, fold_scales, gated_delta_rule, plan_delta_step
from tests.engine.test_gated_delta import reference, step_inputs
from tests.engine.test_gated_delta_decode import DK, DV, HEADS, K, unit_qk

ROWS = SCALED_MIN_ROWS  # the fewest rows that keep the decay in the scale


def decode_step(pool, scale, slots, gen, log_decay, dtype):
    """One scaled decode step on `slots` -> (out [B, H, dv], its inputs in float64 for the reference)."""
    num_seqs = len(slots)
    qk, v = unit_qk(num_seqs, gen)
    beta = torch.rand(num_seqs, HEADS, generator=gen, dtype=torch.float64)
    plan = plan_delta_step(StateBatch(slots, [False] * num_seqs), list(range(num_seqs + 1)), K, torch.device("cpu"))
    decay = log_decay.exp()
    out = decode_rule_at(qk.to(dtype).transpose(1, 2), v.to(dtype).unsqueeze(2), decay.to(dtype)[..., None, None],
                         beta.to(dtype)[..., None, None], pool, scale, plan)
    return out[:, :, 0], (qk[:, 0], qk[:, 1], v, log_decay, beta)


def check_against_reference(truth, slots, out, inputs, tol):
    """Step the float64 reference states `truth` [S, H, dk, dv] and compare the step's outputs."""
    q, k, v, g, beta = inputs
    for i, slot in enumerate(slots):
        want = reference(truth[slot], q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1])
        torch.testing.assert_close(out[i].double(), want[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_long_decode_runs_through_tiny_decays_and_zero_decays_follow_the_plain_rule(dtype):
    """400 scaled steps where some heads decay by e^-20 to e^-45 a token (their scale falls under FOLD_BELOW every
    few steps), some barely decay, and every 7th step some decays are exactly 0: outputs and true states follow the
    plain rule, every scale stays in [FOLD_BELOW, 1], and both folds and scaled steps happen (in float32 an
    unfolded scale would underflow to 0 within a few steps)."""
    gen = torch.Generator().manual_seed(5)
    slots = list(range(1, ROWS + 1))
    pool = torch.zeros(ROWS + 2, HEADS, DK, DV, dtype=dtype)
    scale = torch.ones(ROWS + 2, HEADS, 1, 1, dtype=dtype)
    truth = torch.zeros(ROWS + 2, HEADS, DK, DV, dtype=torch.float64)
    rate = torch.tensor([45.0, 0.01, 20.0], dtype=torch.float64)  # per head: fast, slow, fast
    seen_tiny = seen_fold = False
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for step in range(400):
        g = -rate * torch.rand(ROWS, HEADS, generator=gen, dtype=torch.float64).add_(0.5)
        if step % 7 == 3:
            g[::2, 0] = float("-inf")  # a decay of exactly 0: only this token's write is left
        before = scale[slots].clone()
        out, inputs = decode_step(pool, scale, slots, gen, g, dtype)
        check_against_reference(truth, slots, out, inputs, tol)
        assert bool(((scale >= FOLD_BELOW) & (scale <= 1)).all())
        seen_tiny |= bool((scale[slots] < 1e-15).any())
        seen_fold |= bool(((scale[slots] == 1) & (before < 1e-15)).any())
    assert seen_tiny and seen_fold
    torch.testing.assert_close((pool * scale).double(), truth, rtol=tol, atol=tol)


def test_a_zero_decay_leaves_only_the_tokens_write():
    """From states with scales far below 1, one step with every decay 0: the true state is k (beta v)^T, exactly
    as the plain rule's (0 S + k delta^T), and the output (q.k) beta v."""
    gen = torch.Generator().manual_seed(6)
    slots = list(range(ROWS))
    pool = torch.randn(ROWS, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    scale = torch.ones(ROWS, HEADS, 1, 1, dtype=torch.float64)
    for _ in range(3):
        decode_step(pool, scale, slots, gen, torch.full((ROWS, HEADS), -9.0, dtype=torch.float64), torch.float64)
    assert bool((scale < 1e-10).all())
    out, (q, k, v, _, beta) = decode_step(pool, scale, slots, gen, torch.full((ROWS, HEADS), float("-inf"),
                                                                               dtype=torch.float64), torch.float64)
    written = beta.unsqueeze(-1) * v  # [B, H, dv]
    torch.testing.assert_close(pool * scale, k.unsqueeze(-1) * written.unsqueeze(-2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, (q * k).sum(-1, keepdim=True) * written, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("slots", [list(range(2, 2 + ROWS)), [3 * i + 1 for i in range(ROWS)]],
                         ids=["run", "gathered"])
def test_a_prefill_chunk_after_scaled_decodes_reads_the_folded_states(slots):
    """Scaled decodes leave scales far below 1; then a step with one sequence's 5-token chunk beside the others'
    decode rows (the chunked rule and the mixed step's recurrent step, which read and write true states) after
    fold_scales; then scaled decodes again, from the scales fold_scales left. Every output and true state follows
    the plain rule."""
    gen = torch.Generator().manual_seed(7)
    size = 3 * ROWS + 2
    pool = torch.randn(size, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    scale = torch.ones(size, HEADS, 1, 1, dtype=torch.float64)
    truth = pool.clone()
    log_decay = torch.full((ROWS, HEADS), -7.0, dtype=torch.float64)
    for _ in range(2):
        out, inputs = decode_step(pool, scale, slots, gen, log_decay, torch.float64)
        check_against_reference(truth, slots, out, inputs, 1e-10)
    assert bool((scale[slots] < 1e-5).all())
    lengths = [1] * (ROWS - 1) + [5]  # the last sequence a prefill chunk, the others a decode each
    starts = [sum(lengths[:i]) for i in range(ROWS + 1)]
    q, k, v, g, beta = step_inputs(starts[-1], seed=8)
    plan = plan_delta_step(StateBatch(slots, [False] * ROWS), starts, K, torch.device("cpu"), chunk_size=4)
    fold_scales(pool, scale, plan)
    assert bool((scale[slots] == 1).all())
    out = gated_delta_rule(q, k, v, g, beta, pool, plan)
    for i, slot in enumerate(slots):
        rows = slice(starts[i], starts[i + 1])
        want = reference(truth[slot], q[rows], k[rows], v[rows], g[rows], beta[rows])
        torch.testing.assert_close(out[rows], want, rtol=1e-10, atol=1e-10)
    for _ in range(2):
        out, inputs = decode_step(pool, scale, slots, gen, log_decay, torch.float64)
        check_against_reference(truth, slots, out, inputs, 1e-10)
    torch.testing.assert_close(pool[slots] * scale[slots], truth[slots], rtol=1e-10, atol=1e-10)


def test_copied_slots_carry_their_scale():
    """ModelRunner.copy_states on slots whose scales are not 1 (a prefix-cache save and restore, speculative
    decoding's hold and rollback, an n > 1 fork): the copy holds the same true state, and decoding on from the
    copy gives what decoding on from the original gives."""
    gen = torch.Generator().manual_seed(9)
    slots = list(range(ROWS))
    pool = torch.randn(3 * ROWS, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    scale = torch.ones(3 * ROWS, HEADS, 1, 1, dtype=torch.float64)
    conv = torch.zeros(3 * ROWS, K - 1, 4, dtype=torch.float64)
    decode_step(pool, scale, slots, gen, torch.full((ROWS, HEADS), -5.0, dtype=torch.float64), torch.float64)
    assert bool((scale[slots] < 1e-2).all())
    copies = [(slot, 2 * ROWS + slot) for slot in slots]
    ModelRunner.copy_states(types.SimpleNamespace(states=[(conv, pool, scale)]), copies)
    copied = [dst for _, dst in copies]
    torch.testing.assert_close(pool[copied] * scale[copied], pool[slots] * scale[slots], rtol=0, atol=0)
    state = gen.get_state()
    outs = []
    for run in (slots, copied):
        gen.set_state(state)
        outs.append(decode_step(pool, scale, run, gen, torch.full((ROWS, HEADS), -5.0, dtype=torch.float64),
                                torch.float64)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
