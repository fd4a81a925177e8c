"""vocab_ops against torch's own argmax and topk, on rows shaped to catch ties, NaN and a short last block."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine import vocab_ops


def rows(vocab: int, num: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num, vocab, generator=g)
    x[1] = x[1].round()  # many equal values: the first of equal maxima must win
    x[2, : vocab // 2] = float("-inf")  # a masked half, as a grammar leaves it
    x[3] = float("-inf")
    x[3, vocab - 1] = 0.5  # the max in the short last block
    x[4, vocab // 2] = float("nan")  # argmax counts NaN as the largest
    return x


@pytest.mark.parametrize("vocab", [5, 128, 1000, 19_200, 151_936 // 8 + 3])
def test_argmax_matches_torch(vocab):
    x = rows(vocab)
    assert torch.equal(vocab_ops.argmax(x), x.argmax(dim=1))


@pytest.mark.parametrize("vocab,k", [(1000, 1), (1000, 3), (20_000, 20), (20_000, 50), (19_200, 20), (700, 300)])
def test_topk_matches_torch_values_and_ids_point_at_them(vocab, k):
    x = rows(vocab)[[0, 1, 2, 3, 5]]
    x[1] = x[1] + torch.linspace(0, 1e-3, vocab)  # rounded values, made distinct so the ids are unique
    maxima = vocab_ops.block_maxima(x)
    values, ids = vocab_ops.topk(x, k, maxima)
    expected = x.topk(k, dim=1).values
    assert torch.equal(values, expected)
    finite = values.isfinite()  # -inf candidates (masked tokens, or past the short last block) are never drawn
    assert torch.equal(x.gather(1, ids)[finite], values[finite])
    for r in range(x.shape[0]):  # a real token each time, never one twice
        assert len(set(ids[r][finite[r]].tolist())) == int(finite[r].sum())
    picked = torch.tensor([4, 0])
    sub_values, sub_ids = vocab_ops.topk(x, k, maxima, picked)
    assert torch.equal(sub_values, expected[picked])
    assert torch.equal(x[picked].gather(1, sub_ids)[finite[picked]], sub_values[finite[picked]])


def test_probs_at_in_chunks_matches_torch():
    x = torch.randn(40, 3000)
    picked = torch.arange(39, -1, -2)
    scale = torch.linspace(0.3, 2.0, picked.numel())
    ids = torch.randint(0, 3000, (picked.numel(), 7))
    expected = (x[picked] / scale.unsqueeze(1)).softmax(dim=1).gather(1, ids)
    assert torch.allclose(vocab_ops.probs_at(x, picked, scale, ids), expected)


def test_draw_follows_the_weights_and_never_picks_a_zero_weight():
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.0]).expand(20_000, -1).contiguous()
    uniforms = torch.rand(20_000, generator=torch.Generator().manual_seed(1))
    picks = vocab_ops.draw(weights.clone(), uniforms)
    assert set(picks.tolist()) == {1, 3}
    assert (picks == 3).float().mean().item() == pytest.approx(0.75, abs=0.02)
    edge = vocab_ops.draw(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), torch.tensor([1 - 2 ** -24, 0.0]))
    assert edge.tolist() == [0, 1]  # u just below 1 stays on the last kept token; u = 0 skips leading zeros
