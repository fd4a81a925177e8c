"""BatchPolicy, the measured switch that turns drafting off where a step is compute-bound: step times injected
(a fake cost model, and a fake clock under a real EngineCore); an explicit disable_by_batch_size still wins."""
from __future__ import annotations

import json
import random

from rawserve.engine.spec.policy import BatchPolicy
from tests.engine.test_core import greedy, make_core, prompt, run


def drive(policy: BatchPolicy, rows: int, steps: int, cost, tokens_drafted: float, seed: int = 0) -> list[bool]:
    """`steps` decode steps of `rows` rows: cost(drafted) seconds each (times a noise factor), a drafted step
    emitting rows * tokens_drafted tokens, a plain one rows. Returns each step's choice."""
    rng = random.Random(seed)
    choices = []
    for _ in range(steps):
        drafted, probe = policy.choose(rows)
        choices.append(drafted)
        tokens = round(rows * tokens_drafted) if drafted else rows
        policy.record(rows, drafted, tokens, cost(drafted) * rng.uniform(0.8, 1.25), probe)
    return choices


def test_a_small_batch_that_gains_keeps_drafting_and_probes_plain_rarely():
    policy = BatchPolicy()
    # One row, memory-bound: a drafted step (k = 4) costs 1.3x a plain one and emits 3 tokens
    choices = drive(policy, 1, 2000, lambda d: 0.013 if d else 0.010, 3.0)
    assert choices[:63] == [True] * 63
    assert sum(not c for c in choices) <= 2000 // 64  # the plain probes: at most one step in 64
    bucket = policy.stats()[0]
    assert bucket["on"] and bucket["ratio"] > 2


def test_a_batch_where_drafting_loses_turns_it_off_after_probes_confirm():
    policy = BatchPolicy(prior_off_at=64)  # a prior that drafts at 32 rows: the measurements must overrule it
    # 32 rows, compute-bound: a drafted step costs 4.5x a plain one and emits 2 tokens a row (L = 2)
    choices = drive(policy, 32, 600, lambda d: 0.45 if d else 0.10, 2.0)
    assert choices[0]  # drafted first, as the prior said
    tail = choices[200:]
    assert sum(tail) <= len(tail) // 64 + 1  # off, but for a rare probe
    bucket = policy.stats()[0]
    assert not bucket["on"] and bucket["ratio"] < 0.6 and bucket["rows"] == "32-63"
    assert policy.describe(32) == f"off: 32 rows decode (measured: drafting {bucket['ratio']:.2f}x plain)"


def test_a_large_batch_off_by_prior_turns_on_when_its_probes_gain():
    policy = BatchPolicy()  # 32 rows: off before measuring
    assert policy.describe(32) == "off: 32 rows decode (before measuring: 8+ rows)"
    choices = drive(policy, 32, 400, lambda d: 0.12 if d else 0.10, 3.0)
    assert not any(choices[:63])
    assert all(choices[150:]) or sum(not c for c in choices[150:]) <= 4
    assert policy.stats()[0]["on"]


def test_break_even_does_not_flip_on_noise():
    for prior_off_at, on in ((8, True), (1, False)):
        policy = BatchPolicy(prior_off_at=prior_off_at)
        # Drafted and plain throughput equal within the noise: whichever mode the bucket starts in, it stays
        choices = drive(policy, 4, 3000, lambda d: 0.02 if d else 0.01, 2.0, seed=3)
        assert policy.stats()[0]["on"] is on
        assert sum(c != on for c in choices) <= 3000 // 64 + 8


def test_buckets_are_separate():
    policy = BatchPolicy(prior_off_at=64)
    drive(policy, 32, 400, lambda d: 0.45 if d else 0.10, 2.0)
    drive(policy, 1, 400, lambda d: 0.013 if d else 0.010, 3.0)
    assert [(b["rows"], b["on"]) for b in policy.stats()] == [("1-1", True), ("32-63", False)]


class FakeClock:
    """The step times a compute-bound machine would show: a drafted step costs `drafted_s`, a plain one
    `plain_s`; the core's SpecDecoder reads it once a step (at propose), the test advances it after each."""

    def __init__(self, plain_s: float, drafted_s: float) -> None:
        self.now, self.plain_s, self.drafted_s = 0.0, plain_s, drafted_s

    def __call__(self) -> float:
        return self.now


def step_with_clock(core, clock: FakeClock, requests, max_steps=4000):
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished:
            break
        drafted_before = core.spec.counters.num_drafts
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        clock.now += clock.drafted_s if core.spec.counters.num_drafts > drafted_before else clock.plain_s
    return out


def synthetic_core(tiny_qwen3_dir, **spec):
    config = json.dumps({"method": "synthetic", "num_speculative_tokens": 4, "acceptance_length": 2,
                         "min_acceptance": 0, **spec})
    return make_core(tiny_qwen3_dir, speculative_config=config)


def test_the_core_turns_drafting_off_where_its_timed_steps_lose(tiny_qwen3_dir):
    core = synthetic_core(tiny_qwen3_dir)
    clock = core.spec.clock = FakeClock(plain_s=0.01, drafted_s=0.04)  # 2 tokens per 40 ms against 1 per 10 ms
    out = step_with_clock(core, clock, [("a", prompt(8, 1), greedy(200, ignore_eos=True))])
    assert len(out["a"]) == 200
    stats = core.stats().extra["spec"]
    assert stats["policy"][0]["rows"] == "1-1" and stats["policy"][0]["on"] is False
    assert stats["policy"][0]["ratio"] < 0.6
    # Drafting until the first probe (step 64), off after two more confirming probes 4 steps apart
    assert stats["num_drafts"] <= 64 + 8 + 2 and stats["num_steps_off_by_batch"] >= 60


def test_the_core_keeps_drafting_where_its_timed_steps_gain(tiny_qwen3_dir):
    core = synthetic_core(tiny_qwen3_dir)
    clock = core.spec.clock = FakeClock(plain_s=0.01, drafted_s=0.012)
    out = step_with_clock(core, clock, [("a", prompt(8, 1), greedy(200, ignore_eos=True))])
    assert len(out["a"]) == 200
    stats = core.stats().extra["spec"]
    bucket = core.spec.policy.buckets[1]
    assert stats["policy"][0]["on"] is True and bucket.plain_samples >= 1
    assert bucket.spec_rate / bucket.plain_rate > 1.4
    assert stats["num_steps_off_by_batch"] <= 3  # its plain probes


def test_prefill_steps_are_not_timed(tiny_qwen3_dir):
    core = synthetic_core(tiny_qwen3_dir)
    clock = core.spec.clock = FakeClock(plain_s=0.01, drafted_s=0.012)
    # Requests joining one by one: steps carrying a prompt chunk are left out of the measurements
    requests = [(f"r{i}", prompt(40, i), greedy(6, ignore_eos=True)) for i in range(3)]
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
        core.step()
        clock.now += 5.0  # a prefill step's time, which would make plain decoding look 500x slower
    step_with_clock(core, clock, [])
    buckets = core.spec.policy.buckets.values()
    assert sum(b.spec_samples for b in buckets) > 0
    assert all(b.spec_rate > 50 for b in buckets if b.spec_samples)
    assert all(b.plain_rate > 50 for b in buckets if b.plain_samples)


def test_an_explicit_disable_by_batch_size_wins(tiny_qwen3_dir):
    core = synthetic_core(tiny_qwen3_dir, disable_by_batch_size=2)
    assert core.spec.policy is None
    run(core, [(f"b{i}", prompt(8, i), greedy(10, ignore_eos=True)) for i in range(2)])
    stats = core.stats().extra["spec"]
    assert stats["num_drafts"] == 0 and "policy" not in stats
    assert core.stats().extra["spec"]["num_steps_off_by_batch"] > 0
