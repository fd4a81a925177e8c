"""Speculative sampling keeps the target's distribution: the rejection sampler alone with fixed draft
distributions, and the engine's verification against plain sampling (chi-square over many draws, tiny vocabularies)
under temperature, top-k and top-p."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from rawserve.engine.spec.rejection import rejection_sample
from rawserve.engine.types import SamplingParams
from tests.engine.test_core import make_core

V = 6


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """Goodness of fit: the p-value of Pearson's statistic (categories with no expected mass must be empty)."""
    stat, df = 0.0, -1
    for o, e in zip(observed, expected):
        if e == 0:
            assert o == 0, "a token with no target probability was drawn"
            continue
        stat += (o - e) ** 2 / e
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def homogeneity_p(a: Counter, b: Counter) -> float:
    """Two samples from one distribution? Pearson's chi-square over their pooled categories."""
    cats = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cats:
        total = a[c] + b[c]
        for count, n in ((a[c], na), (b[c], nb)):
            e = total * n / (na + nb)
            stat += (count - e) ** 2 / e
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def target_rows(kind: str, k: int, seed: int) -> torch.Tensor:
    """[k + 1, V] final target distributions after temperature, top-k or top-p (a reference implementation)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    if kind == "temperature":
        return (logits / 0.6).softmax(-1)
    if kind == "top_k":
        cut = logits.topk(3, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < cut, float("-inf")).softmax(-1)
    probs = logits.softmax(-1)  # top_p 0.7: the smallest most-likely set reaching 0.7
    values, order = probs.sort(dim=-1, descending=True)
    drop = values.cumsum(-1) - values > 0.7
    kept = torch.zeros_like(probs).scatter(1, order, (~drop).float())
    return (probs * kept) / (probs * kept).sum(-1, keepdim=True)


@pytest.mark.parametrize("kind", ["temperature", "top_k", "top_p"])
@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampler_emits_the_targets_distribution(kind, point_mass):
    k, n = 3, 6000
    p = target_rows(kind, k, seed=1)
    g = torch.Generator().manual_seed(7)
    q = torch.tensor([[0.3, 0.3, 0.1, 0.1, 0.1, 0.1], [0.05, 0.05, 0.2, 0.2, 0.2, 0.3],
                      [1 / 6] * 6])  # [k, V], deliberately unlike p
    first, second = Counter(), Counter()
    num_accepted = 0
    for _ in range(n):
        if point_mass:
            drafts = p[:k].argmax(-1).tolist()  # the likeliest: accepted often, not always
        else:
            drafts = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
        out = rejection_sample(p, drafts, None if point_mass else q, torch.rand(k, generator=g), g)
        assert 1 <= len(out) <= k + 1 and out[:-1] == drafts[:len(out) - 1]
        num_accepted += len(out) - 1
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert num_accepted > n * 0.15  # drafts were accepted often enough to matter
    assert chi_square_p([first[t] for t in range(V)], (p[0] * n).tolist()) > 1e-3
    m = sum(second.values())
    assert chi_square_p([second[t] for t in range(V)], (p[1] * m).tolist()) > 1e-3


def test_a_wrong_acceptance_rule_is_caught():
    """The test above has power: accepting every point-mass draft (no rejection) fails it."""
    p = target_rows("temperature", 1, seed=1)
    g = torch.Generator().manual_seed(3)
    firsts = Counter(rejection_sample(p, [2], None, torch.zeros(1), g)[0] for _ in range(2000))
    assert chi_square_p([firsts[t] for t in range(V)], (p[0] * 2000).tolist()) < 1e-6


SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                   "min_acceptance": 0, "disable_by_batch_size": 1000})


@pytest.mark.parametrize("kind", [dict(temperature=1.0), dict(temperature=1.0, top_k=3),
                                  dict(temperature=1.0, top_p=0.8)])
def test_engine_sampling_with_drafts_matches_plain_sampling(tiny_qwen3_dir, kind):
    """Unseeded draws (so the two engines' uniforms differ) of the 2nd to 4th output tokens, where drafts are
    verified: the speculative engine's token counts against the plain engine's."""
    n = 240
    # A bias onto four tokens keeps the vocabulary effectively tiny; the prompt repeats them, so the n-gram
    # proposer drafts from the first decode and the target often agrees
    bias = {5: 6.0, 6: 6.0, 7: 6.0, 8: 6.0}
    base = [5, 6, 7, 8] * 4

    def draws(spec):
        core = make_core(tiny_qwen3_dir, speculative_config=spec, max_num_seqs=64, max_num_batched_tokens=2048)
        for i in range(n):
            core.add_request(f"r{i}", base, SamplingParams(max_tokens=4, logit_bias=bias, **kind))
        tokens: dict[str, list[int]] = {}
        while core.has_unfinished:
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return core, [Counter(ids[j] for ids in tokens.values()) for j in (1, 2, 3)]

    _, plain = draws(None)
    core, spec = draws(SPEC)
    stats = core.stats().extra["spec"]
    assert stats["num_accepted_tokens"] > n // 5
    for a, b in zip(plain, spec):
        assert homogeneity_p(a, b) > 1e-3, (a, b)
