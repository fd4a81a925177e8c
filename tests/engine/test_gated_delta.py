"""gated_delta's batched layouts against the delta rule written one token at a time: prefill rows gathered into
padded chunks straight from strided column slices (pads holding other tokens' values), decode rows beside them,
states carried across steps; and the chunk's triangular inverse. float64, so any slip shows far above rounding."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.models.gated_delta import StateBatch, gated_delta_rule, l2_normalize, plan_delta_step, \
    unit_lower_inverse

HEADS, DK, DV = 3, 8, 6


def reference(state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """transformers' recurrent form over one sequence's tokens, in place on state [H, dk, dv] -> [T, H, dv]."""
    out = []
    for t in range(q.shape[0]):
        state.mul_(g[t].exp()[:, None, None])
        kv_mem = (state * k[t][:, :, None]).sum(1)  # [H, dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(out)


def step_inputs(num_tokens: int, seed: int):
    """q, k, v as the layer hands them over: column slices of one wide [T, ...] row per token (strided views),
    with log decays strong enough that a chunk's exp(G) spans many orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, 2 * HEADS * DK + HEADS * DV + 5, generator=gen, dtype=torch.float64)
    qk = l2_normalize(wide[:, :2 * HEADS * DK].view(num_tokens, 2 * HEADS, DK))
    q, k = qk.split(HEADS, dim=1)
    q = q * DK ** -0.5
    v = wide[:, 2 * HEADS * DK:2 * HEADS * DK + HEADS * DV].view(num_tokens, HEADS, DV)
    g = -torch.rand(num_tokens, HEADS, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(num_tokens, HEADS, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_prefills_and_decodes_in_one_step_follow_the_token_by_token_rule(chunk_size):
    """Three steps over five slots: prompts of 11, 3 and 6 tokens (pads in their last chunks), then those
    continuing by 5 tokens beside decode rows of other slots, then every slot decoding out of slot order."""
    slots = [4, 0, 2, 1, 3]
    pool = torch.randn(5, HEADS, DK, DV, dtype=torch.float64)  # stale values: fresh slots must start from zeros
    expected = torch.zeros(5, HEADS, DK, DV, dtype=torch.float64)
    steps = [
        ([(4, 11), (0, 3), (2, 6)], {4, 0, 2}),
        ([(0, 5), (1, 1), (4, 1), (3, 1), (2, 5)], {1, 3}),
        ([(3, 1), (4, 1), (0, 1), (2, 1), (1, 1)], set()),
    ]
    seen: list[int] = []
    for seed, (rows, fresh) in enumerate(steps):
        lengths = [n for _, n in rows]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        q, k, v, g, beta = step_inputs(starts[-1], seed)
        step_slots = [slot for slot, _ in rows]
        for slot in fresh:
            pool[slot].zero_()  # what GatedDeltaNetLayer does for StateBatch.fresh
        plan = plan_delta_step(StateBatch(step_slots, [s in fresh for s in step_slots]), starts, 4,
                               torch.device("cpu"), chunk_size)
        assert any(group.chunk_pads is not None for group in plan.groups) == (seed < 2)
        out = gated_delta_rule(q, k, v, g, beta, pool, plan)
        for (slot, _), start, end in zip(rows, starts, starts[1:]):
            want = reference(expected[slot], q[start:end], k[start:end], v[start:end], g[start:end],
                             beta[start:end])
            torch.testing.assert_close(out[start:end], want, rtol=0, atol=1e-10)
        seen = sorted(set(seen) | set(step_slots))
        torch.testing.assert_close(pool[seen], expected[seen], rtol=0, atol=1e-10)
    assert seen == sorted(slots)


@pytest.mark.parametrize("size", [5, 16, 32, 64, 128])
def test_unit_lower_inverse_by_rows_and_by_halves(size):
    """The row-by-row substitution (small sizes) and the split in halves (from BLOCKED_INVERSE_SIZE on, twice
    at 128) both give (I + L)^-1, reading only L's strict lower triangle."""
    gen = torch.Generator().manual_seed(size)
    lower = torch.randn(3, 2, size, size, generator=gen, dtype=torch.float64) * 0.3
    expected = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + lower.tril(-1))
    torch.testing.assert_close(unit_lower_inverse(lower), expected, rtol=0, atol=1e-10)
