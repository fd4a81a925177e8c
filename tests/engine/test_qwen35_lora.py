"""LoRA on Qwen3.5 through the real EngineCore (CPU, float32): PEFT adapters on the gated-attention, Gated DeltaNet
and MLP projections give transformers + peft's greedy ids and logprobs, alone and in one batch with base rows; the
reader's caps know the hybrid's shapes; an adapter naming a module the model lacks is refused by name."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from rawserve.engine.loader import read_model_config
from rawserve.engine.lora import LoraError, layer_modules, read_adapter, weight_limits
from tests.engine.test_core import run
from tests.engine.test_qwen35_engine import assert_no_leak, greedy, make_core, prompt
from tests.qwen35_checkpoints import load_hf_qwen35, make_qwen35_checkpoint

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> (rank, alpha, targets, rslora): each names modules of both layer kinds and the MLP
    "a": (4, 8, ["q_proj", "v_proj", "in_proj_qkv", "in_proj_b", "out_proj", "up_proj"], False),
    "b": (8, 16, ATTENTION + DELTANET + MLP, True),
}


def make_adapter(base: pathlib.Path, out: pathlib.Path, rank: int, alpha: int, targets: list[str],
                 rslora: bool = False, *, seed: int = 1, conditional: bool = False) -> pathlib.Path:
    """A random PEFT adapter on transformers' Qwen3.5 (B not zero, so it changes the output), as saved.

    At 0.1 the deltas change the greedy ids; at 0.3 the tiny model is so ill-conditioned that transformers' own
    merged and unmerged forms differ by 6e-4 in logprob, which no 1e-4 comparison could tell from a bug."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
                             init_lora_weights=False)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(load_hf_qwen35(base, conditional=conditional), config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn_like(param))
    wrapped.save_pretrained(out)
    return out


def hf_peft(base: pathlib.Path, adapter: pathlib.Path | None, *, conditional: bool = False):
    model = load_hf_qwen35(base, conditional=conditional)
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=["causal", "conditional"])
def setup(request, tmp_path_factory):
    conditional = request.param == "conditional"
    root = tmp_path_factory.mktemp(f"qwen35-lora-{request.param}")
    base = make_qwen35_checkpoint(root / "base", conditional=conditional, tied=not conditional,
                                  initializer_range=0.1)
    adapters = {name: make_adapter(base, root / name, *spec, seed=i + 1, conditional=conditional)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters, conditional


def lora_core(base, adapters, **options):
    return make_core(base, lora_modules=[f"{name}={path}" for name, path in adapters.items()], max_loras=2,
                     max_lora_rank=8, **options)


def test_the_adapters_cover_both_layer_kinds_and_the_mlp(setup):
    base, adapters, _ = setup
    cfg = read_model_config(base)
    kinds = cfg.hybrid.layer_types
    for name, (rank, _, targets, _) in ADAPTERS.items():
        adapter = read_adapter(name, adapters[name], cfg, 8)
        assert adapter.rank == rank and adapter.targets == sorted(targets)
        layers = {layer for layer, _ in adapter.weights}
        assert {kinds[layer] for layer in layers} == {"linear_attention", "full_attention"}
        # every module on every layer whose kind has it (PEFT found them all)
        assert len(adapter.weights) == sum(len(set(targets) & set(modules)) for modules in layer_modules(cfg))


def test_greedy_ids_and_logprobs_equal_transformers_peft(setup):
    base, adapters, conditional = setup
    core = lora_core(base, adapters, max_num_batched_tokens=9)  # chunked: the LoRA rows span several steps
    ids = prompt(21, 7)
    for name in (None, "a", "b"):
        hf = hf_peft(base, adapters.get(name), conditional=conditional)
        core.add_request("r", ids, greedy(6, prompt_logprobs=1, logprobs=1), lora=name)
        outs = []
        while core.has_unfinished:
            outs += core.step()
        generated = [t for out in outs for t in out.new_token_ids]
        assert generated == hf_greedy(hf, ids, 6), name
        with torch.no_grad():
            ref = hf(torch.tensor([ids + generated])).logits[0].float().log_softmax(-1)
        plp = outs[0].prompt_logprobs  # sent once, with the first token
        assert [plp[i][0] for i in range(1, len(ids))] == ids[1:]
        got = torch.tensor([plp[i][1] for i in range(1, len(ids))])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
        sampled = [out.logprobs[0] for out in outs if out.logprobs]  # (token, logprob, rank, top) per output token
        assert [entry[0] for entry in sampled] == generated and all(entry[2] == 1 for entry in sampled)
        torch.testing.assert_close(torch.tensor([entry[1] for entry in sampled]),
                                   ref[torch.arange(len(ids) - 1, len(ids) + 5), torch.tensor(generated)],
                                   rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert_no_leak(core)


def test_one_batch_mixes_adapters_and_base_rows(setup):
    base, adapters, conditional = setup
    if conditional:
        pytest.skip("the batch layout does not depend on the checkpoint's form; the causal run covers it")
    core = lora_core(base, adapters)
    ids = prompt(13, 3)
    expected = {name: hf_greedy(hf_peft(base, adapters.get(name)), ids, 8) for name in (None, "a", "b")}
    assert len({tuple(v) for v in expected.values()}) == 3  # each adapter changes the output
    # a, b and the base model twice each, the second ones joining later (their prefill beside the others' decode)
    reqs = [(f"{name}{i}", ids, greedy(8), 0, {"lora": name}) for i in range(2) for name in (None, "a", "b")]
    tokens, _, _ = run(core, reqs, {f"{name}1": 3 for name in (None, "a", "b")})
    for rid, got in tokens.items():
        assert got == expected[None if rid.startswith("None") else rid[0]], rid
    assert core.scheduler.lora_slots is not None
    assert_no_leak(core)


def test_prefix_cache_and_saved_states_are_keyed_by_adapter(setup):
    base, adapters, conditional = setup
    if conditional:
        pytest.skip("the cache keys do not depend on the checkpoint's form")
    core = lora_core(base, adapters)
    ids = prompt(20, 5)
    first, _, _ = run(core, [("x", ids, greedy(4), 0, {"lora": "a"})])
    _, final, _ = run(core, [("y", ids, greedy(4), 0, {"lora": "b"})])
    assert final["y"].num_cached_tokens == 0  # b's KV and states differ from a's
    again, final, _ = run(core, [("z", ids, greedy(4), 0, {"lora": "a"})])
    assert final["z"].num_cached_tokens > 0 and again["z"] == first["x"]
    assert_no_leak(core)


def test_every_linear_of_both_layer_kinds_gets_adapter_slots(setup):
    from rawserve.engine.lora import LoraWeights
    from rawserve.engine.models.qwen35 import GatedAttentionLayer, GatedDeltaNetLayer, Qwen35Model

    cfg = read_model_config(setup[0])
    with torch.device("meta"):
        model = Qwen35Model(cfg, torch.float32)
    weights = LoraWeights(cfg, 2, 4, torch.float32, torch.device("meta"))
    model.enable_lora(weights)
    assert {type(layer) for layer in model.layers} == {GatedAttentionLayer, GatedDeltaNetLayer}
    for layer in model.layers:
        assert layer.lora is weights and set(weights.layers[layer.index]) == set(layer.linear_names)
        for name, (a, bs) in weights.layers[layer.index].items():  # the parts' B as tall as the fused matrix
            matrix = getattr(layer, name)
            assert sum(b.shape[2] for b in bs) == matrix.shape[0] and a.shape[2] == matrix.shape[1]


def _copy(src: pathlib.Path, dst: pathlib.Path, **config_changes) -> pathlib.Path:
    shutil.copytree(src, dst)
    conf = json.loads((dst / "adapter_config.json").read_text())
    conf.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    return dst


def _rename_tensor(adapter: pathlib.Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    file = adapter / "adapter_model.safetensors"
    tensors = load_file(str(file))
    renamed = {name.replace(old, new): t for name, t in tensors.items()}
    assert renamed != tensors
    save_file(renamed, str(file))


def test_caps_know_the_hybrid_shapes(setup, tmp_path):
    base, adapters, _ = setup
    cfg = read_model_config(base)
    from safetensors.torch import load_file

    file = adapters["b"] / "adapter_model.safetensors"
    max_tensors, max_header, max_file = weight_limits(cfg, 8)
    # b is every module of every layer at rank 8 in float32: exactly the data the cap allows, each layer by its kind
    tensors = load_file(str(file))
    assert len(tensors) == max_tensors and file.stat().st_size <= max_file
    assert max_file - 8 - max_header == sum(t.numel() * t.element_size() for t in tensors.values())
    # rank-8 tensors under a config that says 4: more bytes than a rank-4 adapter can need, refused unread
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: \d+ bytes; at most \d+ are read"):
        read_adapter("x", _copy(adapters["b"], tmp_path / "small-rank", r=4), cfg, 8)
    other = make_qwen35_checkpoint(tmp_path / "wide", linear_value_head_dim=32, mtp=False)
    with pytest.raises(LoraError, match=r"has shape|at most \d+ are read"):  # it does not fit the other model
        read_adapter("b", adapters["b"], read_model_config(other), 8)


def test_an_adapter_naming_a_module_the_model_lacks_is_refused(setup, tmp_path):
    base, adapters, conditional = setup
    cfg = read_model_config(base)
    head = make_adapter(base, tmp_path / "head", 4, 8, ["q_proj", "lm_head"], conditional=conditional)
    with pytest.raises(LoraError, match=r"target_modules names \['lm_head'\], which this Qwen3_5\w+ has no "
                                        r"adapter-capable linear of \(it has q_proj, .*in_proj_qkv"):
        read_adapter("x", head, cfg, 8)
    with pytest.raises(LoraError, match="target_modules names"):  # at start-up too, naming it
        lora_core(base, {"head": head})
    # tensors the config does not list: a module no layer has, and one on a layer of the other kind
    unknown = _copy(adapters["a"], tmp_path / "unknown", target_modules=".*")
    _rename_tensor(unknown, "layers.0.linear_attn.in_proj_b.", "layers.0.linear_attn.in_proj_w.")
    with pytest.raises(LoraError, match=r"targets 'in_proj_w', which is not one of q_proj, k_proj"):
        read_adapter("x", unknown, cfg, 8)
    assert cfg.hybrid.layer_types[3] == "full_attention"
    wrong_kind = _copy(adapters["a"], tmp_path / "wrong-kind")
    _rename_tensor(wrong_kind, "layers.3.self_attn.q_proj.", "layers.3.linear_attn.in_proj_qkv.")
    with pytest.raises(LoraError, match=r"targets 'in_proj_qkv' on layer 3, a full_attention layer, which has q_proj"):
        read_adapter("x", wrong_kind, cfg, 8)
    wrong_block = _copy(adapters["a"], tmp_path / "wrong-block")
    _rename_tensor(wrong_block, "layers.0.linear_attn.out_proj.", "layers.0.mlp.out_proj.")
    with pytest.raises(LoraError, match="puts out_proj under 'mlp'; it belongs under 'linear_attn'"):
        read_adapter("x", wrong_block, cfg, 8)
