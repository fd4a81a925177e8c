"""LoRA adapters in the core: PEFT's format read and checked, greedy ids equal to transformers + peft, one batch
mixing adapters and the base model, slots bounded per step with LRU swaps, unload after the last request."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from rawserve.engine.lora import LoraError, read_adapter
from rawserve.engine.loader import read_model_config
from tests.checkpoints import load_hf_model, make_hf_checkpoint
from tests.engine.test_core import assert_no_leak, greedy, make_core, prompt, run

peft = pytest.importorskip("peft")

ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "a": (4, 8, ["q_proj", "v_proj", "gate_proj"], False),
    "b": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base_dir, out_dir, rank, alpha, targets, rslora=False, seed=1) -> pathlib.Path:
    """A random PEFT adapter (B not zero, so it changes the output) saved as save_pretrained writes it."""
    model = load_hf_model(base_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    wrapped.save_pretrained(out_dir)
    return pathlib.Path(out_dir)


def hf_greedy(base_dir, adapter_dir, ids, n):
    model = load_hf_model(base_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen2"])
def lora_setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = make_hf_checkpoint(root / "base", request.param)
    adapters = {name: make_adapter(base, root / name, *spec, seed=i + 1)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return base, adapters


def lora_core(base, adapters, **options):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return make_core(base, lora_modules=modules, max_lora_rank=8, **{"max_loras": 2, **options})


@pytest.mark.parametrize("prepack", [True, False])
def test_greedy_matches_peft_and_mixed_batch(lora_setup, prepack, monkeypatch):
    base, adapters = lora_setup
    if not prepack:
        monkeypatch.setattr("rawserve.engine.model_runner.cpu_prepack_supported", lambda dtype: False)
    core = lora_core(base, adapters)
    ids = prompt(9, 3)
    n = 10
    expected = {name: hf_greedy(base, adapters.get(name), ids, n) for name in (None, "a", "b")}
    assert len({tuple(v) for v in expected.values()}) == 3  # each adapter changes the output
    for name, want in expected.items():  # alone
        tokens, _, _ = run(core, [("r", ids, greedy(n, ignore_eos=True), 0, {"lora": name})])
        assert tokens["r"] == want, name
    # One batch: a, b and the base model, twice each, joining at different steps (prefill beside decode).
    reqs = [(f"{name}{i}", ids, greedy(n, ignore_eos=True), 0, {"lora": name})
            for i in range(2) for name in (None, "a", "b")]
    joins = {f"{name}1": 3 for name in (None, "a", "b")}
    tokens, _, _ = run(core, reqs, joins)
    for rid, got in tokens.items():
        name = None if rid.startswith("None") else rid[0]
        assert got == expected[name], rid
    assert_no_leak(core)


def test_slots_bound_each_step_and_swap_lru(lora_setup):
    base, adapters = lora_setup
    core = lora_core(base, adapters, max_loras=1)
    seen = []
    original = core.runner.execute

    def execute(batch):
        seen.append({seq.lora_slot for seq in batch.seqs if seq.lora_slot >= 0})
        return original(batch)

    core.runner.execute = execute
    ids = prompt(6, 4)
    alone = {}
    for name in ("a", "b"):
        tokens, _, _ = run(core, [("r", ids, greedy(6, ignore_eos=True), 0, {"lora": name})])
        alone[name] = tokens["r"]
    reqs = [(f"{name}{i}", ids, greedy(6, ignore_eos=True), 0, {"lora": name})
            for i in range(3) for name in ("a", "b", None)]
    tokens, _, order = run(core, reqs)
    assert all(len(s) <= 1 for s in seen)
    for rid, got in tokens.items():
        if rid[0] in alone:
            assert got == alone[rid[0]], rid  # b waited for a's slot, then swapped in
    assert core.scheduler.lora_slots.slots == ["b"] or core.scheduler.lora_slots.slots == ["a"]
    assert_no_leak(core)


def test_prefix_cache_keyed_by_adapter(lora_setup):
    base, adapters = lora_setup
    core = lora_core(base, adapters)
    ids = prompt(20, 5)
    first, _, _ = run(core, [("x", ids, greedy(4, ignore_eos=True), 0, {"lora": "a"})])
    _, final, _ = run(core, [("y", ids, greedy(4, ignore_eos=True), 0, {"lora": "b"})])
    assert final["y"].num_cached_tokens == 0  # b's KV differs from a's
    again, final, _ = run(core, [("z", ids, greedy(4, ignore_eos=True), 0, {"lora": "a"})])
    assert final["z"].num_cached_tokens > 0 and again["z"] == first["x"]


def test_unload_waits_for_last_request_and_unknown_refused(lora_setup):
    base, adapters = lora_setup
    core = lora_core(base, adapters)
    core.add_request("r", prompt(5, 1), greedy(5, ignore_eos=True), lora="a")
    core.step()
    core.loras.unload("a")
    assert core.loras.names() == ["b"] and "a" in core.loras
    with pytest.raises(ValueError, match="no adapter named 'a'"):
        core.add_request("s", prompt(5, 1), greedy(5), lora="a")
    with pytest.raises(ValueError, match="being unloaded"):
        core.loras.load("a", str(adapters["a"]))
    while core.has_unfinished:
        core.step()
    assert "a" not in core.loras and core.scheduler.lora_slots.slots.count("a") == 0
    core.loras.load("a", str(adapters["a"]))
    with pytest.raises(KeyError):
        core.loras.unload("nope")


def _edit_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    dst.mkdir()
    conf = json.loads((src / "adapter_config.json").read_text())
    conf.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_bad_adapters_name_what_is_wrong(lora_setup, tmp_path):
    base, adapters = lora_setup
    cfg = read_model_config(base)
    src = adapters["b"]
    adapter = read_adapter("b", src, cfg, 8)
    assert adapter.rank == 8 and len(adapter.targets) == 7
    with pytest.raises(LoraError, match="exceeds --max-lora-rank 4"):
        read_adapter("b", src, cfg, 4)
    with pytest.raises(LoraError, match="modules_to_save"):
        read_adapter("x", _edit_config(src, tmp_path / "save", modules_to_save=["lm_head"]), cfg, 8)
    with pytest.raises(LoraError, match=r"lora_A\.weight' has shape \(4, \d+\), expected \(8, \d+\)"):
        read_adapter("x", _edit_config(adapters["a"], tmp_path / "rank", r=8), cfg, 8)
    # rank 8 tensors under a config that says 4: more bytes than a rank-4 adapter can need, refused unread
    with pytest.raises(LoraError, match=r"adapter_model.safetensors: \d+ bytes; at most \d+ are read"):
        read_adapter("x", _edit_config(src, tmp_path / "small-rank", r=4), cfg, 8)
    with pytest.raises(LoraError, match="adapter_config.json: file is missing"):
        read_adapter("x", tmp_path, cfg, 8)
    other = make_hf_checkpoint(tmp_path / "wide", "qwen3", hidden_size=32, head_dim=16)
    with pytest.raises(LoraError, match=r"has shape|at most \d+ are read"):  # it does not fit the other model
        read_adapter("b", src, read_model_config(other), 8)


def test_lora_modules_flag():
    from rawserve.config import EngineConfig, build_parser, configs_from_args

    parser = build_parser()
    for argv in (["--lora-modules", "a=/p/a", "b=/p/b"], ["--lora-modules", "a=/p/a", "--lora-modules", "b=/p/b"]):
        engine, _ = configs_from_args(parser.parse_args(["--model", "m", *argv]))
        assert engine.lora_paths() == {"a": "/p/a", "b": "/p/b"} and engine.lora_enabled
    engine, _ = configs_from_args(parser.parse_args(["--model", "m", "--lora-modules", '{"name": "j", "path": "/p"}']))
    assert engine.lora_paths() == {"j": "/p"}
    assert not configs_from_args(parser.parse_args(["--model", "m"]))[0].lora_enabled
    with pytest.raises(ValueError, match="--lora-modules: adapter name 'a' given twice"):
        EngineConfig(lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="expected name=path"):
        EngineConfig(lora_modules=["a"])


def test_offline_llm_and_process_messages(lora_setup):
    from rawserve.engine.frontend.llm import LLM
    from rawserve.engine.ipc import decode, encode
    from rawserve.engine.messages import MsgKind

    base, adapters = lora_setup
    ids = prompt(7, 2)
    llm = LLM(base, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128, max_loras=2,
              max_lora_rank=8, lora_modules=[f"a={adapters['a']}"])
    out = llm.generate([ids], greedy(6, ignore_eos=True), lora="a")[0].outputs[0].token_ids
    assert out == hf_greedy(base, adapters["a"], ids, 6)
    stats = llm.core.stats()
    assert stats.extra["lora"] == {"max_lora": 2, "running": [], "waiting": []}
    msgs = [(MsgKind.LORA, (3, "load", "b", "/x")), (MsgKind.LORA_DONE, (3, "bad", "bad")), (MsgKind.STATS, stats)]
    assert decode(encode(msgs)) == msgs  # what crosses the process boundary pickles as it is


def test_an_adapter_reloaded_under_its_name_with_other_weights_shares_no_cached_blocks(lora_setup):
    base, adapters = lora_setup
    core = lora_core(base, adapters)
    ids = prompt(20, 5)
    run(core, [("x", ids, greedy(4, ignore_eos=True), 0, {"lora": "a"})])
    as_b, _, _ = run(core, [("y", ids, greedy(4, ignore_eos=True), 0, {"lora": "b"})])
    core.loras.unload("a")
    core.loras.load("a", str(adapters["b"]))  # the name "a" now holds b's weights
    got, final, _ = run(core, [("z", ids, greedy(4, ignore_eos=True), 0, {"lora": "a"})])
    assert final["z"].num_cached_tokens == 0 and got["z"] == as_b["y"]


def test_an_unreadable_adapter_file_fails_the_load_not_the_engine(lora_setup, tmp_path):
    import shutil

    base, adapters = lora_setup
    core = lora_core(base, adapters)
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(adapters["a"] / "adapter_config.json", broken / "adapter_config.json")
    (broken / "adapter_model.safetensors").mkdir()  # opening it raises IsADirectoryError, an OSError
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        core.loras.load("c", str(broken))
    tokens, _, _ = run(core, [("r", prompt(5, 1), greedy(3, ignore_eos=True), 0, {"lora": "a"})])
    assert len(tokens["r"]) == 3


def test_a_new_adapter_takes_the_least_recently_used_idle_slot():
    from rawserve.engine.scheduler import LoraSlots

    slots = LoraSlots(2)
    a, b = slots.acquire("a"), slots.acquire("b")
    slots.release(a)
    slots.release(b)
    slots.release(slots.acquire("a"))  # a is used again: b is now the least recently used
    assert slots.acquire("c") == b and slots.slots == ["a", "c"]
    assert slots.acquire("d") == a and slots.acquire("e") == -1  # c and d are running: nothing to evict
    assert slots.take_loads() == [(0, "a"), (1, "b"), (1, "c"), (0, "d")]


@pytest.mark.parametrize("token_slots", [[2, -1, 0, 2, 2, -1], [3, 3, 0, 0, 0], [1], [-1, 1, -1]])
def test_grouped_delta_equals_each_row_alone(token_slots):
    """Slots with gaps, uneven groups and rows without an adapter: each row gets exactly its own slot's delta."""
    from rawserve.engine.loader import ModelConfig
    from rawserve.engine.lora import LoraAdapter, LoraWeights, part_shapes

    cfg = ModelConfig("qwen3", "Qwen3ForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
    weights = LoraWeights(cfg, max_loras=4, max_rank=4, dtype=torch.float64, device=torch.device("cpu"))
    torch.manual_seed(0)
    adapters = {}
    for slot in range(4):
        rank = 2 + slot % 3  # ranks below max_rank are zero-padded
        adapters[slot] = {m: (torch.randn(rank, i, dtype=torch.float64), torch.randn(o, rank, dtype=torch.float64))
                          for m, (i, o) in part_shapes(cfg).items()}
        weights.load(slot, LoraAdapter(f"s{slot}", "-", rank, {(0, m): ab for m, ab in adapters[slot].items()}))
    shapes = part_shapes(cfg)
    for fused, modules in weights.parts.items():
        x = torch.randn(len(token_slots), shapes[modules[0]][0], dtype=torch.float64)
        out = sum(shapes[m][1] for m in modules)
        got = weights.apply(0, fused, x, torch.zeros(len(token_slots), out, dtype=torch.float64),
                            weights.batch(token_slots))
        for row, slot in enumerate(token_slots):
            want = torch.zeros(out, dtype=torch.float64) if slot < 0 else torch.cat(
                [x[row] @ adapters[slot][m][0].T @ adapters[slot][m][1].T for m in modules])
            torch.testing.assert_close(got[row], want)
