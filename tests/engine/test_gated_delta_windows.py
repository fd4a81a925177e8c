"""The chunked rule over a prefill group a window of whole rounds at a time (gated_delta.RULE_WINDOW_TOKENS): the
same outputs and states as one call over the whole group and as the token-by-token rule, for fresh and carried
groups; each call sees only its window's chunks (what bounds a long prompt's intermediates)."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.models import gated_delta
from rawserve.engine.models.gated_delta import StateBatch, gated_delta_rule, plan_delta_step, rule_windows
from tests.engine.test_gated_delta import DK, DV, HEADS, reference, step_inputs
from tests.engine.test_gated_delta_fresh import run_steps


def test_rule_windows_cut_whole_rounds_and_cover_every_chunk():
    """Rounds of 3, 3, 2, 1 chunks (sequences of 4, 3 and 2 chunks, longest first) in windows of at least 16
    tokens at 4-token chunks: whole rounds, first chunks counted from the window's, every chunk once."""
    rounds = [(0, 3), (3, 3), (6, 2), (8, 1)]
    windows = rule_windows(rounds, 4, 16)
    assert windows == [(slice(0, 6), [(0, 3), (3, 3)]), (slice(6, 9), [(0, 2), (2, 1)])]
    assert rule_windows(rounds, 4, 0) == [(slice(0, 9), rounds)]
    assert rule_windows(rounds, 4, 4) == [(slice(f, f + a), [(0, a)]) for f, a in rounds]


@pytest.mark.parametrize("window", [1, 8, 24])
def test_windowed_steps_follow_the_token_by_token_rule(monkeypatch, window):
    """Fresh prompts of 37, 11 and 6 tokens, then the same slots carried by 21, 9 and 1 tokens, at 4-token chunks
    in windows of every round (1), two rounds (8) and a few (24)."""
    monkeypatch.setattr(gated_delta, "RULE_WINDOW_TOKENS", window)
    run_steps([([(0, 37), (1, 11), (2, 6)], {0, 1, 2}), ([(0, 21), (1, 9), (2, 1)], set())], 4)


def test_windows_bound_each_call_and_match_one_call(monkeypatch):
    """A 100-token fresh prompt then 60 carried tokens at 8-token chunks: in windows of 16 tokens every
    chunked_rule call gets two chunks at most, and outputs and states equal one call over the whole group."""
    calls: list[int] = []
    real = gated_delta.chunked_rule

    def counted(states, q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(states, q, *args, **kwargs)

    monkeypatch.setattr(gated_delta, "chunked_rule", counted)
    results = {}
    for window in (0, 16):
        monkeypatch.setattr(gated_delta, "RULE_WINDOW_TOKENS", window)
        calls.clear()
        pool = torch.zeros(2, HEADS, DK, DV, dtype=torch.float64)
        outs = []
        for seed, (n, fresh) in enumerate([(100, True), (60, False)]):
            q, k, v, g, beta = step_inputs(n, 40 + seed)
            plan = plan_delta_step(StateBatch([1], [fresh]), [0, n], 4, torch.device("cpu"), 8)
            outs.append(gated_delta_rule(q, k, v, g, beta, pool, plan))
        results[window] = (outs, pool[1].clone(), list(calls))
    (whole, whole_state, whole_calls), (cut, cut_state, cut_calls) = results[0], results[16]
    assert whole_calls == [13, 8] and max(cut_calls) == 2 and sum(cut_calls) == 21
    for a, b in zip(whole, cut):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    torch.testing.assert_close(cut_state, whole_state, rtol=0, atol=1e-12)
    expected = torch.zeros(HEADS, DK, DV, dtype=torch.float64)
    for seed, n in enumerate((100, 60)):
        q, k, v, g, beta = step_inputs(n, 40 + seed)
        torch.testing.assert_close(cut[seed], reference(expected, q, k, v, g, beta), rtol=0, atol=1e-10)
    torch.testing.assert_close(cut_state, expected, rtol=0, atol=1e-10)
