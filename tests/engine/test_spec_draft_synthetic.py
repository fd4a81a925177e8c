"""Synthetic acceptance over real drafts (a draft model with "acceptance_length", as llama.cpp's --spec-synth-len
over its draft-simple): the draft model runs and pays for every draft, and the accepted count follows L, not the
drafts' agreement with the target."""
from __future__ import annotations

import json

import pytest

from rawserve.config import SpeculativeConfig
from tests.engine.test_core import greedy, make_core, prompt, run
from tests.engine.test_spec import small_draft_dir  # noqa: F401 (fixture)


def test_a_draft_model_with_acceptance_length_drafts_for_real_and_accepts_at_L(tiny_qwen3_dir,
                                                                              small_draft_dir):  # noqa: F811
    spec = json.dumps({"model": str(small_draft_dir), "num_speculative_tokens": 4, "acceptance_length": 3,
                       "min_acceptance": 0, "disable_by_batch_size": 64})
    core = make_core(tiny_qwen3_dir, speculative_config=spec)
    calls = []
    real = core.spec.draft.propose_batch
    core.spec.draft.propose_batch = lambda reqs, ks: calls.append(len(reqs)) or real(reqs, ks)
    out = run(core, [(f"r{i}", prompt(9, i), greedy(200, ignore_eos=True)) for i in range(2)])[0]
    assert all(len(ids) == 200 for ids in out.values())
    stats = core.stats().extra["spec"]
    # This draft's own drafts are nearly all rejected (test_spec.py); forced, they are accepted at L = 3
    measured = 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    assert 2.6 < measured < 3.4, stats
    assert sum(calls) >= stats["num_drafts"]  # every verified row was drafted by the model


def test_acceptance_length_is_checked_for_a_draft_model(small_draft_dir):  # noqa: F811
    with pytest.raises(ValueError, match="acceptance_length must be in 1..num_speculative_tokens"):
        SpeculativeConfig.from_dict({"model": str(small_draft_dir), "num_speculative_tokens": 2,
                                     "acceptance_length": 4})
