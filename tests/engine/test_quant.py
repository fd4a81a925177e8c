"""--quantization int8/int4: accuracy on the trained stories260k model, what is quantized, memory planning and
peak memory while loading, and clean refusals."""
from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine import quant
from rawserve.engine.core_summary import describe_core
from rawserve.engine.model_runner import ModelRunner, weight_bytes
from rawserve.engine.step_plan import ForwardBatch, StepInput
from tests.conftest import fixture_path

GOLDEN_40 = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
             411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426]

# Held-out text: written for this test in TinyStories' style (simple words, short sentences); not taken from the
# TinyStories data the model was trained on.
HELD_OUT = [
    "Once upon a time, there was a small dog named Max. Max liked to run in the big green park.",
    "Tom had a red kite. He went to the hill with his dad to fly it in the wind.",
    "One day, a little bird fell out of its nest. A kind girl named Sue helped it go home.",
    "The cat sat by the window and looked at the rain. She wanted to go outside and play.",
    "Lily and her mom baked a cake. It was yummy and they shared it with their friends.",
    "Ben found a shiny rock in the garden. He showed it to his sister and she smiled.",
    "There was a big bear who lived in the woods. He was sad because he had no friends.",
    "Anna wanted to climb the tall tree. Her brother said it was not safe, so she stayed down.",
    "The sun was hot, so the kids went to the pool. They splashed and laughed all day.",
    "A little boy named Jack lost his toy car. He looked under the bed and found it there.",
    "Mia loved to draw pictures of flowers. One day she drew a very big yellow flower for her mom.",
    "The duck swam in the pond with her babies. They followed her in a long line.",
    "Sam was scared of the dark. His dad gave him a small light, and then he was happy.",
    "The old man had a garden with many carrots. A bunny came every night to eat them.",
    "Sara and Tim played with a ball in the yard. The ball went over the fence and they laughed.",
    "It was a cold day, so Lucy put on her warm hat. She went out to play in the snow.",
    "A frog lived near a little river. He liked to jump on the rocks and sing songs.",
    "Joe wanted a new friend. He said hello to the boy next door, and they played together.",
    "The girl gave her teddy bear a hug. She said good night and went to sleep.",
    "One morning, the farmer saw a little lamb in the field. It was lost, so he took it home.",
]

# stories260k: hidden 64, 5 layers, q 64 + k 32 + v 32 rows, intermediate 172. With group 32 int4 fits qkv
# (128 x 64) and o (64 x 64); gate_up (344 rows, not a multiple of 16) and down (in 172, not a multiple of 32)
# stay dense. Every scheme holds the LM head (the tied embedding's copy) in int8.
NUM_LAYERS = 5
EXPECTED_QUANTIZED = {("int8", 128): 4 * NUM_LAYERS + 1, ("int4", 32): 2 * NUM_LAYERS + 1,
                      ("int4", 128): 1}


def stories_runner(scheme: str, group: int = 128) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=str(fixture_path("stories260k")), dtype="float32", device="cpu",
                                    num_kv_blocks=64, quantization=scheme, quantization_group_size=group))


def held_out_ids() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fixture_path("stories260k", "tokenizer.json")))
    return [tok.encode(text).ids for text in HELD_OUT]


def perplexity(runner: ModelRunner, texts: list[list[int]]) -> float:
    """exp(mean NLL) of every next token of every text (the first, BOS, is only context)."""
    nll, count = 0.0, 0
    for ids in texts:
        table = list(range(-(-len(ids) // runner.block_size)))
        logits = runner.execute(ForwardBatch.every_token([StepInput(ids, 0, table)]))  # [len, vocab]
        logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
        nll -= logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
    return math.exp(nll / count)


def greedy(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    table = list(range(-(-(len(prompt) + num_tokens) // runner.block_size)))
    logits = runner.execute(ForwardBatch.last_tokens([StepInput(ids, 0, table)]))
    for _ in range(num_tokens):
        ids.append(int(logits[-1].argmax()))
        if len(ids) - len(prompt) == num_tokens:
            break
        logits = runner.execute(ForwardBatch.last_tokens([StepInput([ids[-1]], len(ids) - 1, table)]))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def fp32_perplexity() -> float:
    return perplexity(stories_runner("none"), held_out_ids())


@pytest.mark.parametrize("scheme, group, tolerance", [("int8", 128, 0.01), ("int4", 32, 0.05)])
def test_held_out_perplexity_stays_near_fp32(scheme, group, tolerance, fp32_perplexity):
    runner = stories_runner(scheme, group)
    assert runner.model.num_quantized == EXPECTED_QUANTIZED[scheme, group]
    ppl = perplexity(runner, held_out_ids())
    assert 2 < fp32_perplexity < 50  # a trained model on text of its kind (random weights: about 512)
    assert abs(ppl / fp32_perplexity - 1) <= tolerance, (scheme, ppl, fp32_perplexity)


@pytest.mark.parametrize("scheme, group", [("int8", 128), ("int4", 32)])
def test_greedy_from_the_golden_prompt_agrees_on_all_40_tokens(scheme, group):
    # "Once upon a time" with BOS; the fp32 golden continuation (../shared/fixtures/stories260k/GOLDEN.md).
    assert greedy(stories_runner(scheme, group), [1, 403, 407, 261, 378], 40) == GOLDEN_40


@pytest.mark.parametrize("scheme, group", [("int8", 128), ("int4", 32), ("int4", 128)])
def test_layers_are_quantized_where_the_kernels_allow_and_dense_elsewhere(scheme, group):
    runner = stories_runner(scheme, group)
    model = runner.model
    assert model.num_quantized == EXPECTED_QUANTIZED[scheme, group]
    assert model.quant_head is not None and model.quant_head.kernel in ("w8a8", "int8")
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            dense = getattr(layer, name)
            if name in layer.quant:
                assert dense.numel() == 0 and name not in layer.packed  # the dense copy is gone
                assert layer.quant[name].kernel == (scheme if scheme == "int4" else runner.quant.int8_kernel)
            else:
                assert scheme == "int4" and (dense.numel() or name in layer.packed)
    # Memory planning counts what was actually kept: dense parameters plus the quantized forms.
    held = sum(p.numel() * p.element_size() for p in model.parameters()
               if not (p is model.embed_tokens and model.embedding_file is not None))  # served from the file
    held += sum(w.numel() * w.element_size() for layer in model.layers for w in layer.packed.values())
    held += sum(q.num_bytes for layer in model.layers for q in layer.quant.values()) + model.quant_head.num_bytes
    assert weight_bytes(runner.config.model_dir, runner.dtype, runner.model_config, runner.device,
                        runner.quant) == held
    # The startup summary's parameter count is the checkpoint's, quantized or pre-packed weights included.
    assert describe_core(types.SimpleNamespace(runner=runner))["num_params"] == 260032


def test_int8_matmul_tracks_the_float_matmul_at_every_batch_size():
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    plan = quant.probe_plan("int8", 128, torch.device("cpu"))
    weight_only = quant.QuantPlan("int8", 128, "int8", False)
    for layer in (quant.quantize(weight, plan), quant.quantize(weight, weight_only)):
        for rows in (1, 8, 32, 256):
            x = torch.randn(rows, 128)
            expected = x @ weight.T
            got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (rows, 96)
            assert (got - expected).norm() / expected.norm() < 0.03, (layer.kernel, rows)
            assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_int4_refuses_shapes_its_kernel_cannot_take():
    plan = quant.QuantPlan("int4", 32, "int8", False)
    assert quant.quantize(torch.randn(24, 64), plan) is None  # rows not a multiple of 16
    assert quant.quantize(torch.randn(32, 48), plan) is None  # inputs not a multiple of the group
    assert quant.quantize(torch.randn(32, 64), plan).kernel == "int4"


def test_quantization_is_refused_on_cuda_and_bad_values_name_the_flag():
    with pytest.raises(quant.QuantError, match="--quantization int8: only CPU kernels"):
        quant.probe_plan("int8", 128, torch.device("cuda"))
    with pytest.raises(ValueError, match="--quantization: must be one of none|int8|int4"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="--quantization-group-size: must be 32 or 128"):
        EngineConfig(quantization="int4", quantization_group_size=64)


ROOT = pathlib.Path(__file__).resolve().parents[2]
# Loads float32 first, so the quantized load's rise leaves out what any first load adds beyond its weights
# (kernel libraries' first use, thread pools: about 40 MB here).
PEAK_SCRIPT = """
import gc, sys, torch
from rawserve.engine import memory
from rawserve.engine.model_runner import load_model
from rawserve.engine.quant import probe_plan
from rawserve.process_stats import release_free_heap
for scheme in ("none", "int8"):
    plan = probe_plan(scheme, 128, torch.device("cpu")) if scheme != "none" else None
    gc.collect()
    release_free_heap()
    memory.reset_peak_rss()
    before = memory.rss_bytes()
    model = load_model(sys.argv[1], torch.float32, torch.device("cpu"), quant=plan)
    print(memory.rss_bytes("VmHWM") - before, model.num_quantized)
    del model
"""


def test_quantized_load_peaks_near_the_quantized_size_not_the_dense_one(tmp_path):
    """A bf16 checkpoint of 128 MB of float32 weights (8 layers of 1-8 MB matrices; bf16 only to write it
    faster): loading it as int8 must never hold it dense."""
    from rawserve.demo_model import Qwen3Shape, write_qwen3_checkpoint

    shape = Qwen3Shape(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=256,
                       tie_word_embeddings=True)
    path = write_qwen3_checkpoint(tmp_path / "ckpt", shape, seed=0, dtype="bfloat16", bos_token_id=None,
                                  eos_token_id=2, generation_config={})
    dense_bytes = 2 * (path / "model.safetensors").stat().st_size  # as float32
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True,
                         timeout=300, check=True, cwd=ROOT)
    (dense_rise, _), (int8_rise, num_quantized) = (map(int, line.split()) for line in out.stdout.splitlines())
    assert num_quantized == 4 * 8 + 1
    assert dense_rise > 0.9 * dense_bytes  # the measure sees a load
    # int8 keeps a quarter of the float32 bytes (32 MB); one fused float32 matrix (gate_up, 8 MB) and the
    # quantizer's chunk temporaries come on top while loading.
    assert int8_rise < 0.5 * dense_bytes, (int8_rise, dense_rise, dense_bytes)


def test_lora_deltas_add_on_top_of_quantized_weights(tmp_path):
    pytest.importorskip("peft")
    from rawserve.engine.lora import read_adapter
    from tests.checkpoints import make_hf_checkpoint
    from tests.engine.test_lora import make_adapter

    base = make_hf_checkpoint(tmp_path / "base", "qwen3")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_dir = make_adapter(base, tmp_path / "adapter", 8, 16, targets)
    ids = [5, 17, 99, 3, 42, 7, 120, 64, 11]

    def logits(scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
        runner = ModelRunner(EngineConfig(model_dir=str(base), dtype="float32", device="cpu", num_kv_blocks=8,
                                          enable_lora=True, max_lora_rank=8, quantization=scheme))
        runner.lora.load(0, read_adapter("a", str(adapter_dir), runner.model_config, 8))
        return tuple(runner.execute(ForwardBatch.every_token([StepInput(ids, 0, [0], lora_slot=slot)]))
                     for slot in (-1, 0))

    base_fp32, adapted_fp32 = logits("none")
    base_int8, adapted_int8 = logits("int8")
    delta_fp32, delta_int8 = adapted_fp32 - base_fp32, adapted_int8 - base_int8
    assert delta_fp32.norm() > 0.1 * base_fp32.norm()  # the adapter matters
    # The adapter's delta runs unquantized on top of the int8 base: what it adds barely changes.
    assert (delta_int8 - delta_fp32).norm() < 0.1 * delta_fp32.norm()
    assert not torch.equal(base_int8, base_fp32)  # and the base really is quantized
