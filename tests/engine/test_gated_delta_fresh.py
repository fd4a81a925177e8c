"""Fresh sequences' recurrent states: the chunked rule starts fresh prompts from zeros itself (their group's
zero_start, no gather or zeroing of their slots), carried prompts beside them in their own group from their
states, and the plan names the slots that must still be zeroed (fresh decode rows). Stale values sit in every slot, zeroed
only as the layer zeroes them (DeltaPlan.fresh_recurrent), so a slot the plan leaves out shows in the outputs."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.models.gated_delta import StateBatch, chunked_rule, exp_normal, gated_delta_rule, \
    plan_delta_step
from tests.engine.test_gated_delta import DK, DV, HEADS, reference, step_inputs


def run_steps(steps: list[tuple[list[tuple[int, int]], set[int]]], chunk_size: int
              ) -> list[list[tuple[int, bool, int]]]:
    """Each step: (slot, new tokens) rows and the fresh slots. Checks every output and state against the
    token-by-token rule -> each step's prefill groups as (sequences, zero_start, chunk size)."""
    pool = torch.randn(6, HEADS, DK, DV, dtype=torch.float64) * 100  # stale: a slot read unzeroed shows
    expected = torch.zeros(6, HEADS, DK, DV, dtype=torch.float64)
    kinds = []
    for seed, (rows, fresh) in enumerate(steps):
        starts = [0]
        for _, n in rows:
            starts.append(starts[-1] + n)
        q, k, v, g, beta = step_inputs(starts[-1], 100 + seed)
        step_slots = [slot for slot, _ in rows]
        plan = plan_delta_step(StateBatch(step_slots, [s in fresh for s in step_slots]), starts, 4,
                               torch.device("cpu"), chunk_size)
        if plan.fresh_recurrent is not None:  # what GatedDeltaNetLayer.forward does, and nothing more
            pool.index_fill_(0, plan.fresh_recurrent, 0)
        kinds.append([(group.slots.numel(), group.zero_start, group.chunk_size) for group in plan.groups])
        out = gated_delta_rule(q, k, v, g, beta, pool, plan)
        for (slot, _), start, end in zip(rows, starts, starts[1:]):
            if slot in fresh:
                expected[slot].zero_()
            want = reference(expected[slot], q[start:end], k[start:end], v[start:end], g[start:end],
                             beta[start:end])
            torch.testing.assert_close(out[start:end], want, rtol=0, atol=1e-10)
        torch.testing.assert_close(pool[step_slots], expected[step_slots], rtol=0, atol=1e-10)
    return kinds


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_fresh_prompts_start_from_zeros_without_their_slots_zeroed(chunk_size):
    """Fresh prompts of 11, 3 and 6 tokens beside a fresh one-token prompt (a decode row: zeroed by the plan),
    then more tokens and decodes carried from them."""
    kinds = run_steps([([(4, 11), (1, 1), (0, 3), (2, 6)], {4, 1, 0, 2}),
                       ([(0, 5), (1, 1), (4, 1), (2, 7)], set())], chunk_size)
    assert kinds == [[(3, True, chunk_size)], [(2, False, chunk_size)]]


def test_fresh_prompts_beside_carried_prompts_run_as_two_groups():
    """A step whose prefills are partly fresh (slots 3, 5) and partly carried (0, 2, which are longer and shorter
    than the fresh ones), beside a fresh decode row; then every slot continues."""
    kinds = run_steps([([(0, 6), (2, 9)], {0, 2}),
                       ([(3, 10), (0, 4), (5, 2), (2, 12), (1, 1)], {3, 5, 1}),
                       ([(3, 1), (0, 1), (5, 9), (2, 1), (1, 1)], set())], 4)
    assert kinds == [[(2, True, 4)], [(2, True, 4), (2, False, 4)], [(1, False, 4)]]


def test_prompt_lengths_run_in_size_classes_each_with_its_own_chunks():
    """At 64-token chunks: prompts of 70, 20 and 5 tokens in three groups (chunks of 64, 32 and 8), then fresh
    prompts of 17 and 9 tokens beside carried ones of 16, 40 and 3 (two carried groups: the 16 and 3 together)."""
    kinds = run_steps([([(0, 70), (3, 1), (1, 20), (2, 5)], {0, 1, 2, 3}),
                       ([(0, 16), (4, 17), (1, 40), (5, 9), (2, 3), (3, 1)], {4, 5})], 64)
    assert kinds == [[(1, True, 8), (1, True, 32), (1, True, 64)],
                     [(1, True, 16), (1, True, 32), (2, False, 16), (1, False, 64)]]


def test_zero_start_equals_a_zero_state_read():
    """chunked_rule's zero_start against the same rule reading a zeroed state: the same outputs and states (the
    skipped terms are exact zeros), over two rounds with fewer sequences in the second."""
    gen = torch.Generator().manual_seed(7)
    num_chunks, size = 5, 8
    q, k = (torch.nn.functional.normalize(torch.randn(num_chunks, HEADS, size, DK, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(num_chunks, HEADS, size, DV, generator=gen)
    g, beta = -torch.rand(num_chunks, HEADS, size, generator=gen), torch.rand(num_chunks, HEADS, size, generator=gen)
    rounds = [(0, 3), (3, 2)]
    read = torch.zeros(3, HEADS, DK, DV)
    written = torch.full((3, HEADS, DK, DV), float("nan"))  # never read under zero_start
    want = chunked_rule(read, q, k, v, g, beta, rounds)
    got = chunked_rule(written, q, k, v, g, beta, rounds, zero_start=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(written, read, rtol=0, atol=0)


def test_exp_normal_is_exp_in_the_normal_range_and_exactly_zero_below_it_or_where_not_kept():
    """float32: exp bit for bit down to -86, 0 (not a subnormal) under float32's normal range, 0 where `keep`
    is False (the chunk's upper triangle) whatever the value there."""
    x = torch.tensor([[0.0, -1.0, -50.0, -86.0], [-87.5, -100.0, -300.0, -5.0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    got = exp_normal(x, keep)
    torch.testing.assert_close(got[0], x[0].exp(), rtol=0, atol=0)
    assert got[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert exp_normal(torch.tensor([-5.0]))[0] == torch.tensor(-5.0).exp()
