"""Checkpoint loading: real files on disk, every failure names its file, tensor or field."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rawserve.config import EngineConfig
from rawserve.engine.loader import CheckpointError, ModelConfig, read_model_config
from rawserve.engine.model_runner import ModelRunner, load_model, resolve_dtype
from rawserve.engine.step_plan import ForwardBatch, StepInput
from tests.checkpoints import make_hf_checkpoint
from tests.conftest import fixture_path

GOLDEN_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
             411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]


@pytest.fixture()
def ckpt(tmp_path, tiny_qwen3_dir):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen3_dir, target)
    return target


def load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: model directory does not exist"):
        read_model_config(tmp_path / "nowhere")


def test_missing_config_is_named(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file is missing"):
        read_model_config(ckpt)


def test_corrupt_config_is_named(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        read_model_config(ckpt)


def test_missing_config_field_is_named(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    del config["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        read_model_config(ckpt)


def test_unsupported_architecture_lists_supported_ones(ckpt):
    edit_config(ckpt, architectures=["MixtralForCausalLM"])
    with pytest.raises(CheckpointError, match="unsupported architecture MixtralForCausalLM; supported: "
                                              "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"):
        read_model_config(ckpt)


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        load(ckpt)


def test_shape_mismatch_shows_both_shapes(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' has shape "
                                              r"\(64, 64\), expected \(64, 128\)"):
        load(ckpt)


def test_truncated_safetensors_is_named(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file .*truncated"):
        load(ckpt)


def test_sharded_checkpoint_loads_like_single_file(ckpt, tmp_path):
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in ("config.json", "generation_config.json"):
        shutil.copy(ckpt / f, sharded / f)
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, sharded / file)
        weight_map.update({k: file for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(ckpt, torch.float32, torch.device("cpu"), prepack=False)
    b = load_model(sharded, torch.float32, torch.device("cpu"), prepack=False)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert pa.numel() > 0 and torch.equal(pa, pb), name


def test_bfloat16_checkpoint_converts_to_float32(tmp_path):
    path = make_hf_checkpoint(tmp_path / "bf16", "qwen2", dtype="bfloat16")
    cfg = read_model_config(path)
    assert cfg.dtype == torch.bfloat16
    model = load_model(path, torch.float32, torch.device("cpu"))
    ref = load_file(path / "model.safetensors")
    assert model.norm.dtype == torch.float32 and torch.equal(model.norm, ref["model.norm.weight"].float())
    # Only lookups read the (untied) embedding: it stays at the checkpoint's bf16, and what a lookup returns
    # is the float32 of the checkpoint's values.
    assert model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens, ref["model.embed_tokens.weight"])


def _cfg(dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(family="qwen3", architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=64,
                       intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64, tie_word_embeddings=True,
                       qkv_bias=False, qk_norm=True, dtype=dtype)


def test_dtype_auto_keeps_a_float32_checkpoint_in_float32_and_honours_the_flag():
    cpu = torch.device("cpu")
    choice = resolve_dtype(EngineConfig(), _cfg(torch.float32), cpu)
    assert choice.dtype == torch.float32 and "float32 holds its values exactly" in choice.reason
    assert resolve_dtype(EngineConfig(dtype="float16"), _cfg(torch.bfloat16), cpu).dtype == torch.float16
    assert resolve_dtype(EngineConfig(dtype="bfloat16"), _cfg(torch.float32), cpu).dtype == torch.bfloat16


def test_dtype_auto_on_a_bf16_checkpoint_follows_the_probe_it_ran():
    """The real probe runs; whichever way it goes, the choice is what its own timings say."""
    choice = resolve_dtype(EngineConfig(), _cfg(torch.bfloat16), torch.device("cpu"))
    assert re.search(r"1 rows [\d.]+ vs [\d.]+ ms, 32 rows [\d.]+ vs [\d.]+ ms", choice.reason), choice.reason
    bf16, f32 = choice.timings[torch.bfloat16], choice.timings[torch.float32]
    assert sorted(bf16) == sorted(f32) == [1, 32]
    bf16_faster = all(bf16[m] < f32[m] for m in (1, 32))
    assert choice.dtype == (torch.bfloat16 if bf16_faster else torch.float32), choice.reason


@pytest.mark.parametrize("bf16_ms, expected", [((0.2, 1.0), torch.bfloat16), ((0.2, 3.0), torch.float32),
                                                ((0.9, 1.0), torch.float32)])
def test_dtype_probe_picks_bf16_only_when_faster_at_every_size(monkeypatch, bf16_ms, expected):
    """The CPU's speed is what lies outside the rule: fake the timings (float32: 0.5 ms at 1 row, 2 ms at 32)."""
    from rawserve.engine import dtype_probe

    def fake(dtypes, out_features, in_features, rows):
        return {dtype: dict(zip(rows, bf16_ms if dtype == torch.bfloat16 else (0.5, 2.0))) for dtype in dtypes}

    monkeypatch.setattr(dtype_probe, "_matmul_ms", fake)
    choice = dtype_probe.probe_cpu_dtype(torch.bfloat16, 64, 128)
    assert choice.dtype == expected, choice.reason
    assert "256x64 matmul" in choice.reason


def test_dtype_probe_times_the_matrix_that_carries_most_weight_bytes():
    from rawserve.engine.dtype_probe import probe_shape

    # 2 layers under a 152k vocabulary: the head's 256-wide rows, cut to 12 MiB of float32
    assert probe_shape(256, 768, 151_936, 2) == (12_288, 256)
    # Qwen3-0.6B: 28 gate/up matrices of 6,144 x 1,024 outweigh the head; cut to 12 MiB as well
    assert probe_shape(1024, 3072, 151_936, 28) == (3072, 1024)
    assert probe_shape(64, 128, 0, 1) == (256, 64)  # small enough to time whole


def test_max_model_len_beyond_checkpoint_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="--max-model-len: 100000 exceeds"):
        ModelRunner(EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", max_model_len=100000))


def test_stories260k_greedy_reproduces_golden_ids():
    model_dir = fixture_path("stories260k")
    runner = ModelRunner(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", block_size=16,
                                      num_kv_blocks=8))
    prompt = [1, 403, 407, 261, 378]
    table = [5, 2, 7, 0]
    logits = runner.execute(ForwardBatch.last_tokens([StepInput(prompt, 0, table)]))
    top5 = logits[0].topk(5)
    assert top5.indices.tolist() == [432, 383, 322, 353, 323]
    torch.testing.assert_close(top5.values, torch.tensor([17.7994, 14.2813, 9.7097, 9.5873, 9.1342]),
                               atol=1e-3, rtol=0)
    out = []
    for step in range(40):
        out.append(int(logits[0].argmax()))
        logits = runner.execute(ForwardBatch.last_tokens([StepInput([out[-1]], len(prompt) + step, table)]))
    assert out == GOLDEN_40


PEAK_SCRIPT = """
import sys, torch
from rawserve.engine.model_runner import load_model
def peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
# Warm up torch's allocator and thread pools first: their one-off cost is not the loader's.
load_model(sys.argv[2], torch.float32, torch.device('cpu'), prepack=False)
base = peak()
# The loader's own footprint; CPU pre-packing afterwards re-lays weights one at a time (plus a tied
# head's packed copy), which is the runner's choice, not the load's.
model = load_model(sys.argv[1], torch.float32, torch.device('cpu'), prepack=False)
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(size, peak() - base)
"""


def test_load_peak_memory_stays_within_1_3x_of_weights(tmp_path, tiny_qwen3_dir):
    import pathlib
    import subprocess
    import sys

    if not pathlib.Path("/proc/self/status").exists():
        pytest.skip("needs /proc to read peak resident memory")
    path = make_hf_checkpoint(tmp_path / "mid", "qwen3", vocab_size=32000, hidden_size=256, intermediate_size=768,
                              num_hidden_layers=4, head_dim=64)
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), str(tiny_qwen3_dir)], capture_output=True, text=True,
                         check=True, timeout=120)
    size, peak = map(int, out.stdout.split())
    assert size > 40_000_000
    assert peak <= 1.3 * size, f"peak {peak / 1e6:.1f} MB for {size / 1e6:.1f} MB of weights"



def mapped_resident_kib(file) -> int:
    """Resident KiB of this process's mappings of `file` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(str(file))
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


def test_a_tied_head_is_packed_once_and_lookups_read_only_the_rows_they_touch(tmp_path):
    """No second copy of a tied embedding: the head is packed, the lookups read the checkpoint file mapped, and
    only the pages of rows looked up are resident (packing read every row, then dropped them)."""
    from rawserve.engine.models.packed import cpu_prepack_supported
    from rawserve.engine.model_runner import weight_bytes

    if not cpu_prepack_supported(torch.float32):
        pytest.skip("oneDNN weight pre-packing is not available in this torch build")
    path = make_hf_checkpoint(tmp_path / "tied", "qwen3", tied=True, dtype="bfloat16", vocab_size=32768,
                              hidden_size=256)
    file = path / "model.safetensors"
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert model.packed_head is not None and model.embedding_file is not None
    assert mapped_resident_kib(file) == 0
    ids = torch.tensor([5, 30000])
    rows = torch.nn.functional.embedding(ids, model.embed_tokens).to(torch.float32)
    # Two rows' pages, as the page cache maps them: folios of 4 KiB to 2 MiB (ext4 on Linux 6.16+), with 64 KiB
    # of fault-around; not the 16 MiB table.
    assert 0 < mapped_resident_kib(file) <= 2 * 2048 + 64
    embedding = load_file(file)["model.embed_tokens.weight"]  # [32768, 256] bf16: 16 MiB
    assert torch.equal(rows, embedding[ids].float())  # the rows cast after the lookup: exact
    cfg = read_model_config(path)
    others = sum(t.numel() for name, t in load_file(file).items() if name != "model.embed_tokens.weight")
    assert weight_bytes(path, torch.float32, cfg, torch.device("cpu")) == 4 * (others + embedding.numel())


def test_a_dtype_conversion_in_row_chunks_gives_the_same_values(tmp_path, monkeypatch):
    """An untied bf16 head served in float32 converts through a staging buffer of a few rows (chunks that split
    the fused q/k/v and the head many times over), not one of the whole tensor's size, to the same values."""
    from rawserve.engine import loader

    path = make_hf_checkpoint(tmp_path / "untied", "qwen2", dtype="bfloat16")
    monkeypatch.setattr(loader, "STAGING_BYTES", 3 * 64 * 2)  # three 64-wide bf16 rows per chunk
    model = load_model(path, torch.float32, torch.device("cpu"), prepack=False)
    ref = load_file(path / "model.safetensors")
    assert torch.equal(model.lm_head, ref["lm_head.weight"].float())
    assert torch.equal(model.layers[1].qkv_proj[:64], ref["model.layers.1.self_attn.q_proj.weight"].float())
