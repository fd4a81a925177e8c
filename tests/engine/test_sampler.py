"""Sampler: each option's effect on a known logits tensor, seeded invariance, logprobs of the raw distribution."""
from __future__ import annotations

import math

import pytest
import torch

from rawserve.engine.request import Request
from rawserve.engine.sampler import Sampler, token_logprobs
from rawserve.engine.types import SamplingParams

EOS = 3


def req(rid="r", prompt=(1,), eos=(EOS,), **params):
    return Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=eos)


def emit(r: Request, token: int) -> None:
    """What the core does with a sampled token."""
    r.token_ids.append(token)
    r.num_output_tokens += 1


def frequencies(probs, n=4000, seed=0, **params):
    """Sample n unseeded rows of the same distribution in one batch; return each token's share."""
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    sampler = Sampler(len(probs), seed=seed)
    out = sampler.sample(logits, [req(f"r{i}", **params) for i in range(n)]).token_ids
    return [out.count(t) / n for t in range(len(probs))]


P = [0.6, 0.25, 0.1, 0.05]


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0], [5.0, 2.0, 0.3, 4.9]])
    out = Sampler(4).sample(logits, [req("a", temperature=0), req("b", temperature=0)])
    assert out.token_ids == [1, 0] and out.logprobs is None


def test_temperature_one_samples_the_softmax():
    shares = frequencies(P, temperature=1.0)
    assert shares == pytest.approx(P, abs=0.03)


def test_low_temperature_sharpens_and_high_temperature_flattens():
    sharp = frequencies(P, temperature=0.5)  # p^2 renormalised
    expected = [p * p / sum(q * q for q in P) for p in P]
    assert sharp == pytest.approx(expected, abs=0.03)
    flat = frequencies(P, temperature=2.0)  # sqrt(p) renormalised (2 is OpenAI's largest temperature)
    assert flat == pytest.approx([math.sqrt(p) / sum(math.sqrt(q) for q in P) for p in P], abs=0.03)


def test_top_k_keeps_only_the_k_most_likely():
    shares = frequencies(P, top_k=2)
    assert shares[2] == 0 and shares[3] == 0
    assert shares[0] == pytest.approx(0.6 / 0.85, abs=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    shares = frequencies(P, top_p=0.8)  # 0.6 + 0.25 reaches 0.8: tokens 0 and 1
    assert shares[2] == 0 and shares[3] == 0 and shares[1] > 0.2
    only_first = frequencies(P, top_p=0.5)
    assert only_first == [1.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    shares = frequencies(P, min_p=0.2)  # threshold 0.12: keep 0.6 and 0.25
    assert shares[2] == 0 and shares[3] == 0 and shares[1] > 0.2


def test_mixed_rows_each_get_their_own_options():
    logits = torch.tensor(P).log().expand(3, -1).contiguous()
    sampler = Sampler(4)
    for _ in range(50):
        out = sampler.sample(logits, [req("g", temperature=0), req("k", top_k=1), req("p", top_p=0.3)])
        assert out.token_ids == [0, 0, 0]


def test_logit_bias_adds_to_the_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert Sampler(4).sample(logits, [req(temperature=0, logit_bias={2: 2.5})]).token_ids == [2]
    assert Sampler(4).sample(logits, [req(temperature=0, logit_bias={0: -1.5})]).token_ids == [1]


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 3.0, 9.0, 8.0]])  # EOS (3) then stop id 4 lead
    r = req(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=(4,))
    sampler = Sampler(5)
    for _ in range(2):
        token = sampler.sample(logits, [r]).token_ids[0]
        assert token == 2
        emit(r, token)
    assert sampler.sample(logits, [r]).token_ids == [EOS]


def test_min_tokens_does_not_hold_back_eos_under_ignore_eos():
    logits = torch.tensor([[0.0, 1.0, 3.0, 9.0]])
    r = req(temperature=0, min_tokens=2, max_tokens=5, ignore_eos=True)
    assert Sampler(4).sample(logits, [r]).token_ids == [EOS]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Token 0 (positive, in the prompt) and token 2 (negative, generated) are penalised by 2.
    logits = torch.tensor([[2.0, 1.5, -0.4, -0.5]])
    r = req(prompt=(0,), temperature=0, repetition_penalty=2.0)
    sampler = Sampler(4)
    assert sampler.sample(logits, [r]).token_ids == [1]  # 2.0 / 2 = 1.0 < 1.5
    masked = torch.tensor([[-5.0, -5.0, -0.4, -0.5]])
    r2 = req(prompt=(1,), temperature=0, repetition_penalty=2.0)
    emit(r2, 2)
    assert sampler.sample(masked, [r2]).token_ids == [3]  # -0.4 * 2 = -0.8 < -0.5
    assert Sampler(4).sample(masked, [req(prompt=(1,), temperature=0)]).token_ids == [2]


def test_frequency_penalty_grows_with_each_generated_repeat():
    logits = torch.tensor([[1.0, 0.9, 0.8, -9.0]])
    r = req(prompt=(1,), temperature=0, frequency_penalty=0.15)  # prompt tokens are not counted
    sampler = Sampler(4)
    seen = []
    for _ in range(5):
        token = sampler.sample(logits, [r]).token_ids[0]
        seen.append(token)
        emit(r, token)
    # Each generated copy subtracts 0.15: (1.0, .9, .8) -> 0 -> (.85, .9, .8) -> 1 -> (.85, .75, .8) -> 0
    # -> (.7, .75, .8) -> 2 -> (.7, .75, .65) -> 1
    assert seen == [0, 1, 0, 2, 1]


def test_presence_penalty_is_flat_and_ignores_the_prompt():
    logits = torch.tensor([[1.0, 0.9, 0.5, -9.0]])
    r = req(prompt=(0, 1), temperature=0, presence_penalty=0.3)
    sampler = Sampler(4)
    assert sampler.sample(logits, [r]).token_ids == [0]  # prompt tokens carry no presence penalty
    emit(r, 0)
    assert sampler.sample(logits, [r]).token_ids == [1]  # 1.0 - 0.3 < 0.9
    emit(r, 1)
    emit(r, 0)  # a second 0 costs nothing more: presence, not frequency
    assert sampler.sample(logits, [r]).token_ids == [0]  # 0.7 vs 0.6 vs 0.5


def test_penalty_rows_are_released_and_reused():
    sampler = Sampler(4)
    logits = torch.zeros(1, 4)
    first = req("a", temperature=0, frequency_penalty=1.0)
    sampler.sample(logits, [first])
    slot = first.penalty_slot
    sampler.release(first)
    second = req("b", temperature=0, frequency_penalty=1.0)
    emit(second, 2)
    assert sampler.sample(logits, [second]).token_ids == [0]  # fresh row: nothing of `first` is left
    assert second.penalty_slot == slot


def test_many_penalised_requests_grow_the_state():
    sampler = Sampler(6)
    reqs = [req(f"r{i}", temperature=0, frequency_penalty=2.0) for i in range(20)]
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, 0.6, 0.5]]).expand(20, -1).contiguous()
    assert sampler.sample(logits, reqs).token_ids == [0] * 20
    for r in reqs:
        emit(r, 0)
    assert sampler.sample(logits, reqs).token_ids == [1] * 20
    assert len({r.penalty_slot for r in reqs}) == 20


def test_seeded_request_samples_the_same_whatever_the_batch():
    torch.manual_seed(0)
    vocab = 1000
    rows = torch.randn(3, vocab)

    def run(batch_of):
        sampler = Sampler(vocab, seed=batch_of)
        mine = req("mine", seed=1234, temperature=0.9, top_p=0.95)
        others = [req(f"o{i}", seed=i if i % 2 else None, top_k=50) for i in range(batch_of)]
        out = []
        for step in range(20):
            batch = others[:batch_of // 2] + [mine] + others[batch_of // 2:]
            logits = torch.stack([rows[step % 3]] * len(batch))
            tokens = sampler.sample(logits, batch).token_ids
            token = tokens[batch.index(mine)]
            out.append(token)
            emit(mine, token)
            for o, t in zip(batch, tokens):
                if o is not mine:
                    emit(o, t)
        return out

    alone = run(0)
    assert run(5) == alone and run(8) == alone
    assert len(set(alone)) > 5  # it really sampled


def test_different_seeds_give_different_samples():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(1000)
    a, b = req("a", seed=1), req("b", seed=2)
    seq_a = [sampler.sample(logits, [a]).token_ids[0] for _ in range(10)]
    seq_b = [sampler.sample(logits, [b]).token_ids[0] for _ in range(10)]
    assert seq_a != seq_b


def test_logprobs_come_from_the_raw_log_softmax_with_rank_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits[0], dim=0).tolist()
    # Bias and temperature change the sample, never the reported distribution.
    r = req(temperature=0, logit_bias={3: 50.0}, logprobs=2)
    out = Sampler(4).sample(logits, [r])
    token, value, rank, top = out.logprobs[0]
    assert token == 3 and value == pytest.approx(raw[3]) and rank == 4
    assert [t for t, _ in top] == [1, 2] and [v for _, v in top] == pytest.approx([raw[1], raw[2]])


def test_logprobs_zero_gives_only_the_sampled_token_and_other_rows_get_none():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 2)
    out = Sampler(4).sample(logits, [req("a", temperature=0, logprobs=0), req("b", temperature=0)])
    assert out.logprobs[0][:3] == (1, pytest.approx(math.log(math.exp(3) / sum(map(math.exp, [1, 3, 2, 0])))), 1)
    assert out.logprobs[0][3] == () and out.logprobs[1] is None


def test_token_logprobs_ranks_targets():
    lp = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0], [5.0, 1.0, 0.0]]), dim=1)
    entries = token_logprobs(lp, torch.tensor([0, 0]), [1, 3])
    assert entries[0][2] == 3 and entries[0][3][0][0] == 2
    assert entries[1][2] == 1 and [t for t, _ in entries[1][3]] == [0, 1, 2]


def test_no_python_loop_over_the_vocabulary():
    # A full-size vocabulary with every option on stays fast: vectorised, not per-token Python.
    import time

    vocab = 151_936
    logits = torch.randn(8, vocab)
    reqs = [req(f"r{i}", prompt=tuple(range(100)), seed=i, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={1: 3.0},
                logprobs=5) for i in range(8)]
    sampler = Sampler(vocab)
    sampler.sample(logits, reqs)
    start = time.perf_counter()
    sampler.sample(logits, reqs)
    # ~50 ms when vectorised; a per-token loop over 8 x 151,936 entries would take tens of seconds. The
    # bound is loose because CI shares its 2 cores.
    assert time.perf_counter() - start < 3.0


def test_logits_are_left_intact_unless_overwriting_is_allowed():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    before = logits.clone()
    sampler = Sampler(4)
    sampler.sample(logits, [req(temperature=0.5, logit_bias={0: 5.0})])
    assert torch.equal(logits, before)
    sampler.sample(logits, [req(temperature=0.5, logit_bias={0: 5.0})], may_overwrite=True)
    assert not torch.equal(logits, before)
    # With logprobs only the rows that report them are kept as they came, and the report is of those.
    raw = before.log_softmax(dim=1)[0]
    out = sampler.sample(before.clone(), [req(temperature=0, logit_bias={0: 5.0}, logprobs=1)], may_overwrite=True)
    token, value, rank, top = out.logprobs[0]
    assert token == 0 and value == pytest.approx(raw[0].item()) and rank == 3
    assert top[0][0] == 1 and top[0][1] == pytest.approx(raw[1].item())


def mixed_rows(vocab: int, seed: int) -> tuple[torch.Tensor, list[Request]]:
    """Rows for every fast path: top_k (some with ties at the k-th value), top-p whose cut lies among the
    probe's candidates and top-p whose cut does not (a flat row), min-p, greedy with processors."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, vocab, generator=g)
    logits[0:4] *= 4  # peaked: top-p is decided among the largest few
    logits[11] *= 2.0  # top-p 0.8 at temperature 0.7: at 131,072 ids, more than 128 candidates and fewer than 4,096
    logits[4:6] *= 0.05  # flat: top-p needs most of the vocabulary
    logits[6:8] = (logits[6:8] * 2).round()  # many ties, at every k
    options = [dict(top_k=20), dict(top_p=0.9, temperature=0.7), dict(top_k=50, top_p=0.8, min_p=0.02),
               dict(top_k=1, temperature=1.3), dict(top_p=0.95), dict(top_k=5, top_p=0.5),
               dict(top_k=3), dict(top_k=7, temperature=0.5), dict(top_p=0.9, min_p=0.1),
               dict(temperature=0, logit_bias={5: 1.0}), dict(top_k=40, repetition_penalty=1.2),
               dict(top_p=0.8, temperature=0.7, logit_bias={9: 0.5})]
    reqs = [req(f"r{i}", prompt=(1, 2, 3), seed=i if i % 3 else None, **o) for i, o in enumerate(options)]
    return logits, reqs


@pytest.mark.parametrize("vocab,seeds,steps", [(20_000, 3, 6), (131_072, 1, 2)])  # the second: both top-p probes
def test_fast_paths_draw_what_the_sorted_reference_draws(vocab, seeds, steps):
    # Same uniforms (same seeds, same engine seed), so each row must pick the same token as the full sort.
    for seed in range(seeds):
        logits, reqs_fast = mixed_rows(vocab, seed)
        _, reqs_ref = mixed_rows(vocab, seed)
        fast, ref = Sampler(vocab, seed=seed), Sampler(vocab, seed=seed, fast=False)
        for _ in range(steps):
            a = fast.sample(logits.clone(), reqs_fast, may_overwrite=True).token_ids
            b = ref.sample(logits.clone(), reqs_ref, may_overwrite=True).token_ids
            assert a == b
            for r, s, t in zip(reqs_fast, reqs_ref, a):
                emit(r, t)
                emit(s, t)


def test_fast_greedy_is_torch_argmax_on_a_full_vocabulary():
    vocab = 151_936
    logits = torch.randn(6, vocab)
    logits[1] = logits[1].round()  # equal maxima: the first wins, as torch.argmax's
    reqs = [req(f"g{i}", temperature=0) for i in range(6)]
    assert Sampler(vocab).sample(logits, reqs).token_ids == logits.argmax(dim=1).tolist()
    bias = [req(f"b{i}", temperature=0, logit_bias={7: 0.5}) for i in range(6)]  # processors, then argmax
    biased = logits.clone()
    biased[:, 7] += 0.5
    assert Sampler(vocab).sample(logits, bias).token_ids == biased.argmax(dim=1).tolist()


def test_top_k_keeps_every_token_tied_at_the_k_th_value():
    shares = frequencies([0.4, 0.2, 0.2, 0.2], top_k=2)  # the k-th value is shared by three tokens
    assert shares == pytest.approx([0.4, 0.2, 0.2, 0.2], abs=0.03)


def test_bf16_ties_at_the_k_th_value_stay_on_the_candidate_path(monkeypatch):
    # A bf16 model's logits (cast to float32) tie often: Qwen3's defaults (top_k 20) must not send such rows to
    # the whole-vocabulary sort, and must still draw what the sorted reference draws, ties in token-id order.
    vocab, rows = 151_936, 24
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).float()
    logits[-1, :64] = 20.0  # a tie run longer than the candidates' room: this row alone sorts its vocabulary
    options = dict(temperature=0.6, top_k=20, top_p=0.95)
    top20 = logits.topk(21, dim=1).values
    assert bool((top20[:, 19] == top20[:, 20]).sum() >= 3)  # the case under test: ties at the 20th value
    sorted_rows = []
    original = Sampler._sample_sorted

    def spy(x, rows_x, opts, uniforms):
        sorted_rows.extend(rows_x.tolist())
        return original(x, rows_x, opts, uniforms)

    monkeypatch.setattr(Sampler, "_sample_sorted", staticmethod(spy))
    reqs_fast = [req(f"f{i}", seed=i, **options) for i in range(rows)]
    reqs_ref = [req(f"s{i}", seed=i, **options) for i in range(rows)]
    for _ in range(3):
        sorted_rows.clear()
        fast = Sampler(vocab).sample(logits.clone(), reqs_fast).token_ids
        assert sorted_rows == [rows - 1]
        assert fast == Sampler(vocab, fast=False).sample(logits.clone(), reqs_ref).token_ids
        assert fast[-1] < 64  # the long tie run is kept whole, and drawn from
