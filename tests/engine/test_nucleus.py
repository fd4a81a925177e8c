"""nucleus.draw_nucleus against its definition, nucleus.reference (a whole-row sort with float64 masses):
the same token for the same uniform, on every shape of row the sampler sends it."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine import nucleus
from rawserve.engine.request import Request
from rawserve.engine.sampler import Sampler
from rawserve.engine.types import SamplingParams

# temperature, top_k (always 0 here), top_p, min_p
OPTIONS = torch.tensor([[1.0, 0, 0.9, 0.0], [0.7, 0, 0.95, 0.0], [1.3, 0, 0.5, 0.05], [1.0, 0, 0.99, 0.1],
                        [0.5, 0, 0.8, 0.0], [2.0, 0, 0.3, 0.0], [1.0, 0, 0.999, 0.0], [1.0, 0, 0.1, 0.5],
                        [1.0, 0, 0.9, 0.0], [0.9, 0, 0.6, 0.0]])


def rows_of(kind: str, vocab: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(OPTIONS.shape[0], vocab, generator=g)
    if kind == "flat":  # the case this path exists for: the nucleus holds most of the vocabulary
        return x * 0.05
    if kind == "ties":  # long runs of equal logits, cut and drawn in token-id order
        return (x * 2).round()
    if kind == "bf16":  # a bf16 model's logits
        return (x * 3).to(torch.bfloat16).float()
    if kind == "peaked":
        return x * 6
    if kind == "tail":  # a few likely tokens over a tail further than SPAN below them
        x[:, :5] += 60
        return x
    return x


@pytest.mark.parametrize("vocab", [4096, 20_000, 151_936])
@pytest.mark.parametrize("kind", ["flat", "normal", "ties", "bf16", "peaked", "tail"])
def test_draws_what_the_sorted_definition_draws(vocab, kind):
    g = torch.Generator().manual_seed(vocab + len(kind))
    x = rows_of(kind, vocab, g)
    rows = torch.arange(x.shape[0])
    for _ in range(2 if vocab > 100_000 else 6):
        uniforms = torch.rand(x.shape[0], generator=g)
        assert nucleus.draw_nucleus(x, rows, OPTIONS, uniforms).tolist() == \
            nucleus.reference(x, rows, OPTIONS, uniforms).tolist()


def test_the_extremes_of_the_uniform_and_a_subset_of_rows():
    # u near 0 takes the most likely token, u near 1 the last one kept; rows picked out of a larger batch
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 30_000, generator=g) * 0.1
    rows = torch.tensor([1, 4, 5, 11])
    options = OPTIONS[:4]
    for u in (0.0, 1e-9, 0.5, 1 - 1e-9, 0.9999999):
        uniforms = torch.full((4,), u)
        got = nucleus.draw_nucleus(x, rows, options, uniforms).tolist()
        assert got == nucleus.reference(x, rows, options, uniforms).tolist()
        if u == 0.0:
            assert got == x[rows].argmax(dim=1).tolist()


def test_a_nan_row_draws_its_argmax_and_leaves_the_others_alone():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8192, generator=g) * 0.05
    clean = x.clone()
    x[1, 100] = float("nan")
    options, uniforms = OPTIONS[:3], torch.tensor([0.3, 0.6, 0.9])
    got = nucleus.draw_nucleus(x, torch.arange(3), options, uniforms).tolist()
    assert got[1] == 100  # NaN counts as the largest, as greedy's argmax
    expected = nucleus.reference(clean, torch.arange(3), options, uniforms).tolist()
    assert [got[0], got[2]] == [expected[0], expected[2]]


def test_the_sampler_sends_wide_top_p_rows_here_and_sorts_no_whole_row(monkeypatch):
    vocab = 151_936
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, vocab, generator=g) * 0.05  # flat: the 128-candidate probe cannot decide them
    sorts = []
    monkeypatch.setattr(Sampler, "_sample_sorted", staticmethod(lambda *a: sorts.append(a)))
    monkeypatch.setattr(nucleus, "reference", lambda *a: sorts.append(a))
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01 * (i % 2), seed=i,
                                                    max_tokens=4))
            for i in range(6)]
    tokens = Sampler(vocab).sample(logits, reqs).token_ids
    assert sorts == []
    uniforms = torch.stack([torch.rand((), generator=torch.Generator().manual_seed(i)) for i in range(6)])
    options = torch.tensor([r.sampling_row for r in reqs])
    monkeypatch.undo()
    assert tokens == nucleus.reference(logits, torch.arange(6), options, uniforms).tolist()
