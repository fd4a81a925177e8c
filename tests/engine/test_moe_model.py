"""The MoE layer itself: which experts' weights a step reads (only those its tokens chose), the routers' rules,
quantized experts (--quantization int8/int4), gpt-oss's MXFP4 expert tensors and its sliding-window gathers, LoRA on a
MoE model's attention, and bad expert tensors or MoE config fields refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.loader import CheckpointError
from rawserve.engine.model_runner import weight_bytes
from rawserve.engine.models import moe
from rawserve.engine.types import SamplingParams
from tests.checkpoints import load_hf_moe, make_moe_checkpoint


def make_core(model_dir, **options) -> EngineCore:
    defaults = dict(model_dir=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    return EngineCore(EngineConfig(**{**defaults, **options}))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


class Reads:
    """Records, per Experts module, the expert ids its router chose and the experts whose weights it read (each of
    an expert's two matrices, as handed to its matmul)."""

    def __init__(self, monkeypatch) -> None:
        self.chosen: dict[int, set[int]] = {}
        self.read: dict[int, list[int]] = {}
        self.read_down: dict[int, list[int]] = {}
        gate_up, down, forward = moe.Experts.gate_up_proj, moe.Experts.down_proj, moe.Experts.forward

        def recording_gate_up(module, x, index):
            self.read.setdefault(id(module), []).append(index)
            return gate_up(module, x, index)

        def recording_down(module, h, index):
            self.read_down.setdefault(id(module), []).append(index)
            return down(module, h, index)

        def recording_forward(module, x, weights, ids):
            self.chosen.setdefault(id(module), set()).update(ids.flatten().tolist())
            return forward(module, x, weights, ids)

        monkeypatch.setattr(moe.Experts, "gate_up_proj", recording_gate_up)
        monkeypatch.setattr(moe.Experts, "down_proj", recording_down)
        monkeypatch.setattr(moe.Experts, "forward", recording_forward)

    def clear(self) -> None:
        self.chosen.clear()
        self.read.clear()
        self.read_down.clear()


@pytest.mark.parametrize("num_streams", [1, 3])
def test_a_decode_step_reads_only_the_experts_its_tokens_chose(qwen3_moe, monkeypatch, num_streams):
    core = make_core(qwen3_moe)
    for i in range(num_streams):
        core.add_request(f"r{i}", prompt(9, i), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.step()  # the prompts
    reads = Reads(monkeypatch)
    core.step()  # one decode step: one token per stream
    cfg = core.runner.model_config.moe
    assert len(reads.read) == sum(cfg.sparse_layers) == 2  # layer 1 is dense (mlp_only_layers)
    for module, read in reads.read.items():
        assert sorted(read) == sorted(set(read)), "an expert ran twice in one layer"
        assert set(read) == reads.chosen[module]  # every chosen expert, and no other
        assert sorted(reads.read_down[module]) == sorted(read)  # both matrices of each, once
        if num_streams == 1:
            assert len(read) == cfg.top_k < cfg.num_experts
        else:
            assert len(read) <= num_streams * cfg.top_k


def test_routers_follow_their_rules():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    weights, ids = moe.route(logits, 2, "softmax_topk", norm_topk_prob=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])  # shares of all four experts: they sum below 1
    weights, _ = moe.route(logits, 2, "softmax_topk", norm_topk_prob=True)
    torch.testing.assert_close(weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())
    weights, ids = moe.route(logits, 2, "topk_softmax", norm_topk_prob=False)  # gpt-oss: softmax of the two
    torch.testing.assert_close(weights, torch.tensor([[3.0, 2.0]]).softmax(-1))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts_hold_only_their_quantized_form_and_track_float32(qwen3_moe, scheme):
    dense = make_core(qwen3_moe)
    quantized = make_core(qwen3_moe, quantization=scheme, quantization_group_size=32)
    model, cfg = quantized.runner.model, quantized.runner.model_config
    blocks = [layer.moe.experts for layer in model.layers if hasattr(layer, "moe")]
    for experts in blocks:
        assert experts.gate_up.numel() == 0 or experts.gate_up.is_meta  # no dense stack was allocated
        assert all(q is not None for q in experts.quant)
    # attention's q/k/v and o per layer, the dense layer's MLP, the LM head, and two per expert
    assert model.num_quantized == 2 * 3 + 2 + 1 + 2 * 8 * 2
    held = sum(experts.expert_bytes(e) for experts in blocks for e in range(8))
    assert held == moe.expert_weight_bytes(cfg, 4, quantized.runner.quant)
    assert weight_bytes(qwen3_moe, torch.float32, cfg, torch.device("cpu"), quantized.runner.quant) < \
        0.6 * weight_bytes(qwen3_moe, torch.float32, cfg, torch.device("cpu"))
    ids = prompt(20, 7)
    logits = []
    for core in (dense, quantized):
        core.add_request("q", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        outs = []
        while core.has_unfinished:
            outs += core.step()
        logits.append(torch.tensor([outs[0].prompt_logprobs[i][1] for i in range(1, len(ids))]))
    error = (logits[1] - logits[0]).abs().mean() / logits[0].abs().mean()
    assert 0 < error < (0.05 if scheme == "int8" else 0.15), error


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8, the values they hold)."""
    lut = torch.tensor(moe.FP4_VALUES)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1)  # nearest code point (ties to the lower code)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = (lut[codes] * torch.exp2(exponent).unsqueeze(-1)).reshape(w.shape)
    return blocks, (exponent + 127).to(torch.uint8), values


def test_gpt_oss_mxfp4_experts_load_as_the_values_they_encode(tmp_path):
    from safetensors.torch import load_file, save_file

    dense_dir = make_moe_checkpoint(tmp_path / "dense", "gpt_oss", intermediate_size=32, hidden_size=64)
    mxfp4_dir = tmp_path / "mxfp4"
    mxfp4_dir.mkdir()
    tensors = load_file(str(dense_dir / "model.safetensors"))
    rounded, packed = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors[name].transpose(1, 2).contiguous()  # [E, in, out] as saved -> [E, out, in] as MXFP4 holds it
        blocks, scales, values = _to_mxfp4(w)
        rounded[name] = values.transpose(1, 2).contiguous()
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(rounded, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, str(mxfp4_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    hf = load_hf_moe(dense_dir, "gpt_oss")
    ids = prompt(15, 3)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 15:].tolist()
    for path in (dense_dir, mxfp4_dir):
        core = make_core(path)
        core.add_request("g", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        got = []
        while core.has_unfinished:
            got += [t for out in core.step() for t in out.new_token_ids]
        assert got == want, path.name


def test_dequantize_mxfp4_reads_low_nibble_first_and_scales_by_a_power_of_two():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # low nibble 0xF (-6.0), high nibble 0x2 (1.0)
    out = moe.dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)  # scale 2^1
    assert out.shape == (32,) and out[:3].tolist() == [-12.0, 2.0, 0.0]


def test_a_wrongly_shaped_expert_tensor_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_moe_checkpoint(tmp_path, "qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj"):
        make_core(path)


def test_lora_on_attention_projections_matches_peft_and_an_expert_target_is_refused(qwen3_moe, tmp_path):
    pytest.importorskip("peft")
    from rawserve.engine.lora import LoraError, read_adapter
    from rawserve.engine.loader import read_model_config
    from tests.engine.test_lora import hf_greedy, make_adapter

    adapter = make_adapter(qwen3_moe, tmp_path / "attn", 4, 8, ["q_proj", "v_proj", "o_proj"])
    core = make_core(qwen3_moe, lora_modules=[f"attn={adapter}"], max_lora_rank=4, max_loras=1)
    ids = prompt(9, 3)
    core.add_request("r", ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora="attn")
    got = []
    while core.has_unfinished:
        got += [t for out in core.step() for t in out.new_token_ids]
    want = hf_greedy(qwen3_moe, adapter, ids, 8)
    assert got == want and want != hf_greedy(qwen3_moe, None, ids, 8)
    # layer 0's MLP is its experts, which take no adapter: a delta for a gate_proj there is refused by name
    from safetensors.torch import load_file, save_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    a, b = (weights[f"base_model.model.model.layers.1.self_attn.q_proj.lora_{x}.weight"] for x in "AB")
    weights["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = a.clone()
    weights["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = b[:32].clone()
    save_file(weights, str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "gate_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraError, match="gate_proj"):
        read_adapter("mlp", str(adapter), read_model_config(qwen3_moe), 4)


def test_gpt_oss_sliding_layers_gather_only_the_blocks_their_window_reaches(tmp_path, monkeypatch):
    from rawserve.engine.models import gpt_oss

    core = make_core(make_moe_checkpoint(tmp_path, "gpt_oss"))
    core.add_request("w", prompt(30, 1), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()  # the prompt
    gathered = []
    gather = gpt_oss.gather_blocks

    def counting(cache, blocks, out=None):
        gathered.append(blocks.numel())
        return gather(cache, blocks, out)

    monkeypatch.setattr(gpt_oss, "gather_blocks", counting)
    core.step()  # the decode of position 30: 31 keys in 8 blocks of 4
    # per layer a K and a V gather; layers 0 and 2 slide (window 6: positions 25..30, blocks 6 and 7)
    assert gathered == [2, 2, 8, 8, 2, 2, 8, 8]


def _prompt_logprobs(core: EngineCore, ids: list[int]) -> torch.Tensor:
    core.add_request("q", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    outs = []
    while core.has_unfinished:
        outs += core.step()
    return torch.tensor([outs[0].prompt_logprobs[i][1] for i in range(1, len(ids))])


@pytest.mark.parametrize("family", ["qwen3_5_moe", "gpt_oss"])
def test_the_hybrid_and_gpt_oss_run_with_int8_experts(family, tmp_path):
    path = make_moe_checkpoint(tmp_path, family)
    dense, quantized = make_core(path), make_core(path, quantization="int8")
    experts = [m for m in quantized.runner.model.modules() if isinstance(m, moe.Experts)]
    assert len(experts) == 4 and all(q is not None for e in experts for q in e.quant)
    ids = prompt(20, 7)
    want, got = _prompt_logprobs(dense, ids), _prompt_logprobs(quantized, ids)
    assert 0 < (got - want).abs().mean() / want.abs().mean() < 0.05


@pytest.mark.parametrize("field, value, named", [("num_experts", 0, "num_experts"),
                                                 ("num_experts_per_tok", 9, "num_experts_per_tok"),
                                                 ("mlp_only_layers", 1, "mlp_only_layers")])
def test_a_malformed_moe_config_is_refused_by_field(tmp_path, field, value, named):
    from rawserve.engine.loader import read_model_config

    path = make_moe_checkpoint(tmp_path, "qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts", 8)  # transformers writes the alias; either is read
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=named):
        read_model_config(path)
