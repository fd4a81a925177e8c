"""A sampling value or one request's fault never fails the step for everyone (issue 33 item 1): extreme values of
every sampling field in mixed batches leave the other rows' tokens as they are alone; a row whose sampling, logits
processing or grammar raises ends alone with finish_reason "error" (a 500 to its client) and frees what it held.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import random

import pytest
import torch

from rawserve.api.serving import stream_error
from rawserve.engine.core import EngineCore
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.request import Request
from rawserve.engine.sampler import Sampler
from rawserve.engine.types import FLOAT32_MAX, FLOAT32_TINY, RequestFailed, SamplingParams
from tests.engine.test_async_llm import byte_tokenizer, engine_config
from tests.engine.test_core import assert_no_leak, make_core, prompt, run

# A vocabulary past nucleus.MIN_VOCAB and 32 x TOP_P_PROBE: every path of the sampler (greedy, top-k candidates,
# the top-p probe, nucleus, the whole-row draw, the sort) runs.
VOCAB = 4096 + 512
NAN, INF = float("nan"), float("inf")

# Each sampling field at its extremes (what the rules let through: subnormal temperatures become greedy by rule).
EXTREMES = {
    "temperature": [0, 1e-300, 1e-45, 1e-39, FLOAT32_TINY, 1e-30, 1e-7, 2],
    "top_k": [0, 1, 2, 20, (1 << 31) - 1],
    "top_p": [1e-300, 1e-45, 1e-7, 0.5, 1],
    "min_p": [0, 1e-45, 1e-7, 0.99, 1],
    "repetition_penalty": [FLOAT32_TINY, 1e-30, 1, 1e30, FLOAT32_MAX],
    "presence_penalty": [-2, 0, 2],
    "frequency_penalty": [-2, 0, 2],
    "logprobs": [None, 0, 20],
    "min_tokens": [0, 3],
}


def extreme_params(rng: random.Random, vocab: int, seed: int) -> SamplingParams:
    fields = {name: rng.choice(values) for name, values in EXTREMES.items() if rng.random() < 0.6}
    if rng.random() < 0.3:  # logit_bias of +-100 on every id
        sign = rng.choice((-100.0, 100.0))
        fields["logit_bias"] = {t: sign if t % 3 else -sign for t in range(vocab)}
    return SamplingParams(seed=seed, max_tokens=8, **fields)


def normal_params(seed: int) -> SamplingParams:
    return SamplingParams(seed=seed, temperature=0.8, top_p=0.9, top_k=[0, 40][seed % 2], max_tokens=8)


def make_req(rid: str, params: SamplingParams, prompt_ids: list[int]) -> Request:
    return Request(rid, prompt_ids, params, eos_token_ids=(3,))


def logits_rows(count: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, vocab, generator=g) * 3


def sample_steps(sampler: Sampler, reqs: list[Request], rows: torch.Tensor, steps: int) -> list[list[int]]:
    """Sample `steps` steps of the same logits rows (copies: the sampler writes in place), feeding each token back
    as the core does (penalties, min_tokens); -> each request's tokens."""
    tokens: list[list[int]] = [[] for _ in reqs]
    for _ in range(steps):
        out = sampler.sample(rows.clone(), reqs, may_overwrite=True)
        assert not out.failed, out.failed
        for i, (r, t) in enumerate(zip(reqs, out.token_ids)):
            assert 0 <= t < rows.shape[1], (r.params, t)
            r.token_ids.append(t)
            r.num_output_tokens += 1
            tokens[i].append(t)
    return tokens


@pytest.mark.parametrize("round_", range(6))
def test_extreme_values_in_mixed_batches_sample_and_leave_the_other_rows_as_they_are_alone(round_):
    rng = random.Random(round_)
    num_extreme, num_normal = 12, 6
    rows = logits_rows(num_extreme + num_normal, round_)
    if round_ % 2:  # a broken model's rows too: NaN, +-inf, all -inf
        rows[0, 7] = NAN
        rows[1, :] = NAN
        rows[2, 5] = INF
        rows[3, :] = -INF
        rows[4, ::2] = -INF
    prompt_ids = [rng.randrange(VOCAB) for _ in range(6)]
    extreme = [extreme_params(rng, VOCAB, 100 + i) for i in range(num_extreme)]
    normal = [normal_params(200 + i) for i in range(num_normal)]
    order = list(range(num_extreme + num_normal))
    rng.shuffle(order)  # the normal rows sit between the extreme ones
    params = extreme + normal
    mixed = [make_req(f"r{k}", params[k], prompt_ids) for k in order]
    got = sample_steps(Sampler(VOCAB, seed=round_), mixed, rows[order], steps=4)
    by_index = dict(zip(order, got))
    for j in range(num_extreme, num_extreme + num_normal):  # each normal row alone
        alone = sample_steps(Sampler(VOCAB, seed=99), [make_req("alone", params[j], prompt_ids)], rows[j:j + 1], 4)
        assert by_index[j] == alone[0], params[j]


def test_tiny_temperature_and_penalty_rows_are_greedy_or_keep_the_boosted_token():
    """The issue's values: temperature 1e-300 (greedy by rule), 1e-37 (a normal float32: the shift keeps it off
    inf), a repetition penalty of 1e-37 (divides a logit past float32's range: held at its largest)."""
    rows = logits_rows(1, 5)
    top = int(rows[0].argmax())
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-37, logprobs=5),
                   SamplingParams(temperature=1e-37, top_k=5), SamplingParams(temperature=1e-37, top_p=0.5),
                   SamplingParams(temperature=1e-37, min_p=0.5)):
        out = Sampler(VOCAB).sample(rows.clone(), [make_req("t", params, [1])])
        assert out.token_ids == [top] and not out.failed, params
    boosted = 11  # in the prompt, so the penalty applies; positive, so it divides (0 < penalty < 1 rewards it)
    rows[0, boosted] = 0.5
    out = Sampler(VOCAB).sample(rows.clone(), [make_req("p", SamplingParams(repetition_penalty=1e-37), [boosted])])
    assert out.token_ids == [boosted] and not out.failed


def test_extreme_values_through_the_engine_core_leave_the_others_unchanged(tiny_qwen3_dir):
    rng = random.Random(7)
    vocab = 256
    extreme = [(f"x{i}", prompt(5 + i, 50 + i), extreme_params(rng, vocab, 300 + i)) for i in range(10)]
    normal = [(f"n{i}", prompt(6 + i, 80 + i), normal_params(400 + i)) for i in range(4)]
    core = make_core(tiny_qwen3_dir)
    tokens, final, _ = run(core, [(rid, ids, p) for rid, ids, p in itertools.chain(*zip(extreme, normal[:2]),
                                                                                   normal[2:])])
    assert all(final[rid].finish_reason in ("stop", "length") for rid in final), final
    assert_no_leak(core)
    alone, _, _ = run(make_core(tiny_qwen3_dir), [(rid, ids, p) for rid, ids, p in normal])
    assert {rid: tokens[rid] for rid, _, _ in normal} == alone


class RaisingMask:
    def apply(self, row: torch.Tensor, end_ids: list[int]) -> None:
        row[:3] = float("-inf")  # half done, then the fault: its row is left partly written
        raise RuntimeError("grammar table corrupted")


class FaultyGrammar:
    """A request's grammar state (outside the core's unit) that raises: in its mask, or in advance at a token."""

    def __init__(self, fail_in: str, after: int = 0) -> None:
        self.fail_in, self.after, self.num_advanced = fail_in, after, 0
        self.is_complete = False

    def mask(self):
        if self.fail_in == "mask" and self.num_advanced >= self.after:
            return RaisingMask()
        return AllowAll()

    def advance(self, token_id: int) -> None:
        if self.fail_in == "advance" and self.num_advanced >= self.after:
            raise KeyError(f"no transition for token {token_id}")
        self.num_advanced += 1


class AllowAll:
    def apply(self, row: torch.Tensor, end_ids: list[int]) -> None:
        pass


@pytest.mark.parametrize("fail_in, after, stage", [("mask", 0, "logits processing"), ("mask", 2, "logits processing"),
                                                   ("advance", 0, "grammar"), ("advance", 3, "grammar")])
def test_a_faulty_grammar_fails_its_request_alone_and_the_others_finish_with_the_same_tokens(
        tiny_qwen3_dir, fail_in, after, stage):
    others = [(f"o{i}", prompt(7 + i, 10 + i), SamplingParams(seed=i, temperature=0.9, top_k=[0, 30][i % 2],
                                                              repetition_penalty=1.2, logit_bias={5: 3.0},
                                                              max_tokens=10, logprobs=2)) for i in range(3)]
    others.append(("g", prompt(9, 30), SamplingParams(temperature=0, max_tokens=10)))
    expected, expected_final, _ = run(make_core(tiny_qwen3_dir), others)

    core = make_core(tiny_qwen3_dir)
    for rid, ids, params in others[:2]:
        core.add_request(rid, ids, params)
    core.add_request("bad", prompt(8, 20), SamplingParams(seed=5, temperature=0.7, max_tokens=10))
    core.requests["bad"].guided = FaultyGrammar(fail_in, after)
    tokens, final, _ = run(core, others[2:])
    assert final["bad"].finish_reason == "error" and f"{stage} failed" in final["bad"].error
    assert final["bad"].finished and len(tokens.get("bad", [])) == after
    assert {rid: tokens[rid] for rid, _, _ in others} == expected
    assert {rid: [entry[0] for entry in final[rid].logprobs or []] for rid, _, _ in others} == \
        {rid: [entry[0] for entry in expected_final[rid].logprobs or []] for rid, _, _ in others}
    assert_no_leak(core)  # its blocks and penalty row went back, as an abort gives them
    assert core.sampler._free_slots and "bad" not in core.requests


def test_a_row_whose_sampling_raises_fails_alone_after_the_batch_changed_the_logits_in_place():
    """The batch applies logit_bias and penalties in place, then one row's draw raises: rows retried alone get
    each processor once, the uniform they drew for the batch, and their penalty counts once."""
    rows = logits_rows(6, 3)
    prompt_ids = [4, 9, 9, 30]
    params = [SamplingParams(seed=i, temperature=0.9, top_k=[0, 50, 0][i % 3], top_p=[1, 1, 0.8][i % 3],
                             repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={9: 4.0, 30: -2.0},
                             logprobs=3) for i in range(5)]
    good = [make_req(f"r{i}", p, prompt_ids) for i, p in enumerate(params)]
    bad = make_req("bad", SamplingParams(seed=9, temperature=0.5), prompt_ids)
    bad.sampling_row = (0.5, 0.0, "broken", 0.0)  # a corrupted row of the options table: torch refuses it
    batch = good[:3] + [bad] + good[3:]
    sampler = Sampler(VOCAB)
    alone_sampler = Sampler(VOCAB)
    for step in range(3):
        before = [r.generator.get_state() if r.generator is not None else None for r in good]
        out = sampler.sample(rows.clone(), batch, may_overwrite=True)
        assert list(out.failed) == [3] and isinstance(out.failed[3], TypeError) and out.token_ids[3] == -1
        for i, r in enumerate(good):
            k = i if i < 3 else i + 1
            ref = Request(f"a{i}", list(r.token_ids), r.params, eos_token_ids=(3,))
            ref.num_prompt_tokens, ref.num_output_tokens = len(prompt_ids), r.num_output_tokens
            if before[i] is not None:  # the same place in its seeded stream as the batch drew from
                ref.generator = torch.Generator()
                ref.generator.set_state(before[i])
            alone = alone_sampler.sample(rows[k:k + 1].clone(), [ref], may_overwrite=True)
            alone_sampler.release(ref)
            assert out.token_ids[k] == alone.token_ids[0], (step, i)
            assert out.logprobs[k][:3] == alone.logprobs[0][:3]
        for i, r in enumerate(good):
            k = i if i < 3 else i + 1
            r.token_ids.append(out.token_ids[k])
            r.num_output_tokens += 1
        # each good row's penalty counts hold its outputs once (a retry must not count a token twice)
        for r in good:
            counts = sampler._counts[r.penalty_slot]
            assert int(counts.sum()) == r.num_output_tokens
            for t in set(r.token_ids[len(prompt_ids):]):
                assert int(counts[t]) == r.token_ids[len(prompt_ids):].count(t)


class FaultyGrammarCore(EngineCore):
    """The real core, whose requests named "bad..." get a grammar state that raises at their third token."""

    def add_request(self, rid, prompt_ids, params, *args, **kwargs):
        super().add_request(rid, prompt_ids, params, *args, **kwargs)
        if rid.startswith("bad"):
            self.requests[rid].guided = FaultyGrammar("advance", 2)


def make_faulty_grammar_core(config) -> FaultyGrammarCore:
    return FaultyGrammarCore(config)


@pytest.mark.parametrize("mode", ["thread", "process"])
async def test_a_request_failed_in_the_core_reaches_its_stream_as_a_server_error_and_the_engine_lives(
        tiny_qwen3_dir, mode):
    llm = AsyncLLM(functools.partial(make_faulty_grammar_core, engine_config(tiny_qwen3_dir)), byte_tokenizer(),
                   mode=mode)
    await llm.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

        async def collect(rid):
            return [out async for out in llm.generate([5, 6, 7], params, rid)]

        results = await asyncio.gather(collect("bad-1"), collect("ok-1"), collect("ok-2"), return_exceptions=True)
        assert isinstance(results[0], RequestFailed) and "grammar failed" in str(results[0])
        error = stream_error(results[0])
        assert error.status == 500 and error.code == "internal_error"
        for outs in results[1:]:
            assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 12
        assert not llm.is_dead
        again = await collect("ok-3")
        assert again[-1].finish_reason == "length" and llm.num_in_flight == 0
    finally:
        await llm.stop(0.5)

