"""The RMS norms every model runs (decoder.rms_normalize and the forms built on it) compute transformers' formula:
x.float() * rsqrt(x.float().pow(2).mean(-1) + eps), then the weight, rounded where transformers rounds."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.models.decoder import rms_norm, rms_normalize
from rawserve.engine.models.qwen35 import offset_rms_norm

EPS = 1e-6


def reference(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' RMSNorm arithmetic in float32 (Qwen3_5RMSNorm before its cast, LlamaRMSNorm's normalising)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * weight


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, weight_shape", [((5, 96), (96,)), ((3, 6, 32), (6, 32)), ((1, 1024), None)])
def test_rms_normalize_is_transformers_formula_in_float32(dtype, shape, weight_shape):
    """Per row, per head with a [heads, D] weight (the q/k norm's table), and without a weight; a width that is no
    power of two (96: the mean's division is not exact as a product)."""
    x = rows(shape, dtype)
    weight = 1 + 0.1 * torch.randn(weight_shape) if weight_shape else None
    got = rms_normalize(x, EPS, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(x, EPS, weight), rtol=2e-6, atol=0)


def test_rms_normalize_adds_eps_inside_the_root():
    """Rows so small that eps dominates their mean square: eps in the wrong place (or left out) shows at once."""
    x = torch.full((2, 64), 1e-4)
    x[1] *= -0.5
    torch.testing.assert_close(rms_normalize(x, 1e-6), reference(x, 1e-6), rtol=2e-6, atol=0)
    torch.testing.assert_close(rms_normalize(x, 1e-2), reference(x, 1e-2), rtol=2e-6, atol=0)


def test_rms_normalize_leaves_a_float32_input_as_it_was():
    """A float32 x is the caller's tensor (the residual stream): the norm must not scale it in place."""
    x = rows((4, 64), torch.float32)
    kept = x.clone()
    rms_normalize(x, EPS, torch.full((64,), 2.0))
    assert torch.equal(x, kept)


def test_rms_normalize_in_place_writes_the_same_values_into_x():
    """inplace (a tensor its caller reads nowhere after, as the gated norm's rule output): the values of the plain
    call, in x's own memory."""
    x = rows((3, 4, 128), torch.float32)
    weight = 1 + 0.1 * torch.randn(128)
    want = rms_normalize(x, EPS, weight)
    got = rms_normalize(x, EPS, weight, inplace=True)
    assert got.data_ptr() == x.data_ptr()
    assert torch.equal(got, want)


def test_offset_norm_rounds_once_after_the_float32_weight():
    """Qwen3.5's norm: (1 + w) applied in float32, then one rounding to bf16. Equal to the reference's bits here
    (its sum of squares may land a float32 rounding apart, which moves a bf16 rounding only at a tie); rounding
    before the weight, or twice, does not."""
    x = rows((6, 256), torch.bfloat16)
    scale = 1 + 0.1 * torch.randn(256)
    got = offset_rms_norm(x, scale, EPS)
    assert got.dtype == torch.bfloat16
    want = reference(x, EPS, scale).to(torch.bfloat16)
    assert torch.equal(got, want)
    torch.testing.assert_close(offset_rms_norm(x.float(), scale, EPS), reference(x.float(), EPS, scale),
                               rtol=2e-6, atol=0)


def test_decoder_norm_rounds_before_a_narrow_weight():
    """Llama/Qwen3 semantics for a bf16 model: normalise in float32, round to bf16, then the bf16 weight's product
    (bit for bit here, as above: the weight's product before the rounding differs)."""
    x = rows((6, 128), torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(128)).to(torch.bfloat16)
    want = weight * reference(x, EPS).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, EPS), want)
