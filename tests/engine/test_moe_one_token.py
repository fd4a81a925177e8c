"""The one-stream decode path of the experts (moe.Experts.one_token): the same sum as the sorted path over every weight
form (dense, oneDNN pre-packed, int8, int4) and both activations (Qwen's SwiGLU, gpt-oss's clamped one with biases),
each chosen expert's two matrices read once, and the router and shared expert pre-packed on a CPU."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.loader import ModelConfig, MoEConfig
from rawserve.engine.models import moe
from rawserve.engine.models.packed import cpu_prepack_supported
from rawserve.engine.quant import probe_plan

E, K, H, I = 8, 3, 64, 32


def config(activation: str, shared: int = 0) -> ModelConfig:
    gpt_oss = activation == "gpt_oss"
    return ModelConfig("gpt_oss" if gpt_oss else "qwen3_moe", "X", 64, H, 2 * I, 1, 4, 2, 16, 1e-6, 1e4, 128,
                       False, False, True,
                       moe=MoEConfig(E, K, I, "topk_softmax" if gpt_oss else "softmax_topk", not gpt_oss, (True,),
                                     shared_expert_intermediate_size=shared, activation=activation,
                                     expert_bias=gpt_oss))


def random_moe(activation: str, dtype: torch.dtype, shared: int = 0) -> moe.SparseMoe:
    block = moe.SparseMoe(config(activation, shared), dtype)
    gen = torch.Generator().manual_seed(0)
    for param in block.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return block


def quantize_experts(experts: moe.Experts, scheme: str) -> None:
    """What load_moe_model's deferred quantization ends with: each expert's two matrices quantized, stacks empty."""
    experts.quant_plan = probe_plan(scheme, 32, torch.device("cpu"))
    experts.quant = [(experts._quantize(experts.gate_up[e].float()), experts._quantize(experts.down[e].float()))
                     for e in range(E)]
    experts.gate_up.data = torch.empty(0, dtype=experts.gate_up.dtype)
    experts.down.data = torch.empty(0, dtype=experts.down.dtype)


def chosen(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=gen)
    ids = torch.randperm(E, generator=gen)[:K].unsqueeze(0)
    weights = torch.rand(1, K, generator=gen).softmax(-1)
    return x, weights, ids


FORMS = ["dense", "prepacked", "int8", "int4"]


@pytest.mark.parametrize("activation", ["silu", "gpt_oss"])
@pytest.mark.parametrize("form", FORMS)
def test_one_token_equals_the_sorted_path_and_reads_each_chosen_expert_once(activation, form, monkeypatch):
    if form == "prepacked" and not cpu_prepack_supported(torch.float32):
        pytest.skip("no oneDNN pre-packing in this torch build")
    experts = random_moe(activation, torch.float32).experts
    if form == "prepacked":
        experts.prepack()
    elif form in ("int8", "int4"):
        quantize_experts(experts, form)
    reads = {"gate_up": [], "down": []}
    gate_up, down = moe.Experts.gate_up_proj, moe.Experts.down_proj

    def recording(part, proj):
        def run(module, x, index):
            reads[part].append(index)
            return proj(module, x, index)
        return run

    monkeypatch.setattr(moe.Experts, "gate_up_proj", recording("gate_up", gate_up))
    monkeypatch.setattr(moe.Experts, "down_proj", recording("down", down))
    for seed in range(3):
        x, weights, ids = chosen(seed)
        want = experts.sorted_by_expert(x, weights, ids)
        reads["gate_up"].clear(), reads["down"].clear()
        got = experts(x, weights, ids)  # one token: forward takes the one-token path
        assert sorted(reads["gate_up"]) == sorted(reads["down"]) == sorted(ids[0].tolist())
        assert got.shape == (1, H) and got.dtype == x.dtype
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # and the sum is each chosen expert's output, weighted: not any one of them, not unweighted
        alone = sum(weights[0, j] * experts.expert(x, e) for j, e in enumerate(ids[0].tolist()))
        torch.testing.assert_close(got, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", ["prepacked", "int8"])
def test_one_token_in_bfloat16_returns_bfloat16_and_tracks_float32(form):
    block = random_moe("silu", torch.float32)
    x, weights, ids = chosen(5)
    want = block.experts(x, weights, ids)
    block16 = random_moe("silu", torch.bfloat16)
    if form == "int8":  # W8A8 computes the chain in float32: the result still comes back at the model's dtype
        quantize_experts(block16.experts, "int8")
    elif cpu_prepack_supported(torch.bfloat16):
        block16.experts.prepack()
    got = block16.experts(x.bfloat16(), weights.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("shared", [0, 16])
def test_prepack_moves_the_router_and_shared_expert_and_keeps_the_output(shared):
    if not cpu_prepack_supported(torch.float32):
        pytest.skip("no oneDNN pre-packing in this torch build")
    block = random_moe("silu", torch.float32, shared)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    router_bytes = block.router_bytes()
    want = block(x)
    block.prepack()
    packed = {"router", "shared_gate_up", "shared_down"} if shared else {"router"}
    assert set(block.packed) == packed
    assert all(getattr(block, name).numel() == 0 for name in packed)  # the dense copies are gone
    assert block.router_bytes() >= router_bytes
    assert block.experts.packed is not None
    torch.testing.assert_close(block(x), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(block(x[:1]), want[:1], rtol=1e-4, atol=1e-5)
