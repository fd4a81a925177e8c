"""Speculative decoding on a tiny random Qwen3.5 (hybrid): each drafted row's recurrent and conv states are copied
aside before the forward and restored past a rejected draft, so greedy and seeded outputs equal plain decoding's,
with chunked prefill, prefix hits (saved states) and preemption; every state slot comes back."""
from __future__ import annotations

import json

import pytest

from rawserve.engine.types import SamplingParams
from tests.engine.test_qwen35_engine import greedy, make_core, prompt, run
from tests.qwen35_checkpoints import make_qwen35_checkpoint

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                    "min_acceptance": 0, "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-spec"), initializer_range=0.1)


def repetitive(i: int, n: int = 24) -> list[int]:
    return (prompt(5, i) * n)[:n]


def looping(i: int) -> dict:
    """A bias onto the prompt's phrase: outputs (random weights vary token to token) then cycle through it, and
    n-gram drafts get accepted."""
    return {"logit_bias": {t: 6.0 for t in prompt(5, i)}}


def both(ckpt, requests, **options):
    plain = run(make_core(ckpt, **options), requests)
    core = make_core(ckpt, speculative_config=NGRAM, **options)
    return plain, run(core, requests), core


def assert_all_back(core):
    assert core.blocks.num_free_blocks == core.num_blocks and not core.has_unfinished
    assert core.states.num_free_slots == core.states.num_running  # snapshots and running slots all returned


def test_greedy_and_seeded_outputs_are_unchanged_by_drafts(ckpt):
    requests = [(f"g{i}", repetitive(i), greedy(30, **looping(i))) for i in range(3)]
    requests += [(f"s{i}", repetitive(10 + i), SamplingParams(temperature=0.8, top_k=8, seed=i, max_tokens=24,
                                                              ignore_eos=True, **looping(10 + i))) for i in range(2)]
    requests.append(("rnd", prompt(7, 50), greedy(20)))
    plain, spec, core = both(ckpt, requests)
    assert spec[0] == plain[0]
    stats = core.stats().extra["spec"]
    assert stats["num_accepted_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert_all_back(core)


def test_unchanged_under_chunked_prefill_and_preemption(ckpt):
    requests = [(f"p{i}", repetitive(i, 14 + 3 * i), greedy(14, **looping(i))) for i in range(3)]
    options = dict(max_num_batched_tokens=12, num_kv_blocks=18)  # 3 x 7-8 blocks at full length: someone yields
    plain, spec, core = both(ckpt, requests, **options)
    assert spec[0] == plain[0]
    assert core.scheduler.num_preemptions > 0 and core.stats().extra["spec"]["num_accepted_tokens"] > 0
    assert_all_back(core)


def test_a_prefix_hit_restores_a_state_saved_after_accepted_drafts(ckpt):
    """The second turn extends the first's output: it hits blocks and a state saved while drafts were verified
    (a saved state that had run past a rejected draft would change its output)."""
    first = repetitive(4, 20)
    plain_core = make_core(ckpt)
    spec_core = make_core(ckpt, speculative_config=NGRAM)
    outs = []
    for core in (plain_core, spec_core):
        one = run(core, [("t1", first, greedy(24, **looping(4)))])[0]["t1"]
        two = run(core, [("t2", first + one + [7, 8], greedy(16, **looping(4)))])[0]["t2"]
        outs.append((one, two))
    assert outs[1] == outs[0]
    assert spec_core.stats().extra["state_restores"] > 0 and spec_core.stats().extra["spec"]["num_accepted_tokens"] > 0
    assert_all_back(spec_core)


def test_aborts_mid_run_give_every_slot_back(ckpt):
    core = make_core(ckpt, speculative_config=NGRAM)
    for i in range(4):
        core.add_request(f"a{i}", repetitive(i), greedy(60, **looping(i)))
    for _ in range(10):
        core.step()
    assert core.stats().extra["spec"]["num_drafts"] > 0
    for i in range(4):
        core.abort_request(f"a{i}")
    assert_all_back(core)


def test_a_dense_draft_model_drafts_for_a_hybrid_target(ckpt, tmp_path):
    from tests.checkpoints import make_hf_checkpoint

    draft = make_hf_checkpoint(tmp_path / "draft", "qwen3", num_hidden_layers=1, hidden_size=32,
                               intermediate_size=64, head_dim=16)
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 2, "disable_by_batch_size": 64})
    requests = [(f"h{i}", prompt(9, i), greedy(16)) for i in range(2)]
    plain = run(make_core(ckpt), requests)
    core = make_core(ckpt, speculative_config=spec)
    assert run(core, requests)[0] == plain[0]
    assert core.stats().extra["spec"]["num_draft_tokens"] > 0
    assert_all_back(core)
    with pytest.raises(ValueError, match="a draft model must be a dense decoder"):
        make_core(ckpt, speculative_config=json.dumps({"model": str(ckpt), "num_speculative_tokens": 2}))
