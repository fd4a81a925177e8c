"""The decoder over the paged KV cache matches transformers, for every supported family."""
from __future__ import annotations

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.model_runner import ModelRunner
from rawserve.engine.step_plan import ForwardBatch, StepInput
from tests.checkpoints import load_hf_model, make_hf_checkpoint

CASES = [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", True), ("llama", False)]
BLOCK = 4


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{'tied' if c[1] else 'untied'}")
def checkpoint(request, tmp_path_factory):
    family, tied = request.param
    return make_hf_checkpoint(tmp_path_factory.mktemp(f"{family}{tied}"), family, tied=tied)


def make_runner(model_dir, dtype: str = "float32", num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(EngineConfig(model_dir=str(model_dir), dtype=dtype, device="cpu", block_size=BLOCK,
                                    num_kv_blocks=num_blocks))


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def blocks_for(n: int, first: int = 0) -> list[int]:
    # Deliberately not 0..k in order, so a wrong block-table lookup shows up.
    return [first + 2 * i + 1 for i in range(-(-n // BLOCK))]


def prefill_in_chunks(runner: ModelRunner, ids: list[int], table: list[int], cuts: list[int],
                      start: int = 0) -> torch.Tensor:
    """Run ids[start:] through the cache in chunks ending at `cuts`; every token's logits."""
    out = []
    for end in cuts:
        out.append(runner.execute(ForwardBatch.every_token([StepInput(ids[start:end], start, table)])))
        start = end
    return torch.cat(out)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_transformers(checkpoint):
    ids = prompt_ids(23)
    ours = prefill_in_chunks(make_runner(checkpoint), ids, blocks_for(23), [23])
    ref = hf_logits(load_hf_model(checkpoint), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_greedy_decode_through_paged_cache_equals_transformers_generate(checkpoint):
    ids = prompt_ids(9, seed=1)
    runner = make_runner(checkpoint)
    table = blocks_for(9 + 20)
    logits = runner.execute(ForwardBatch.last_tokens([StepInput(ids, 0, table)]))
    tokens = []
    for step in range(20):
        tokens.append(int(logits[-1].argmax()))
        if step < 19:
            logits = runner.execute(ForwardBatch.last_tokens([StepInput([tokens[-1]], len(ids) + step, table)]))
    hf = load_hf_model(checkpoint)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert tokens == ref


def test_prefill_in_three_chunks_equals_single_prefill(checkpoint):
    ids = prompt_ids(30, seed=2)
    runner = make_runner(checkpoint)
    whole = prefill_in_chunks(runner, ids, blocks_for(30), [30])
    chunked = prefill_in_chunks(runner, ids, blocks_for(30, first=20), [7, 18, 30])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_prefill_from_cached_blocks_equals_cold_prefill(checkpoint):
    ids = prompt_ids(21, seed=3)
    runner = make_runner(checkpoint)
    table = blocks_for(21)
    cold = prefill_in_chunks(runner, ids, table, [21])
    # A second sequence reuses the first 3 full blocks (12 tokens) and computes only the rest.
    warm_table = table[:3] + blocks_for(21 - 12, first=40)
    warm = prefill_in_chunks(runner, ids, warm_table, [21], start=12)
    torch.testing.assert_close(warm, cold[12:], atol=1e-5, rtol=1e-5)


def test_batched_mixed_prefill_and_decode_equals_separate_runs(checkpoint):
    runner = make_runner(checkpoint)
    a, b = prompt_ids(10, seed=4), prompt_ids(6, seed=5)
    ta, tb = blocks_for(11), blocks_for(6, first=30)
    runner.execute(ForwardBatch([StepInput(a, 0, ta)], []))
    alone_a = runner.execute(ForwardBatch.last_tokens([StepInput([7], 10, ta)]))
    alone_b = runner.execute(ForwardBatch.last_tokens([StepInput(b, 0, tb)]))
    tb2 = blocks_for(6, first=50)
    both = runner.execute(ForwardBatch.last_tokens([StepInput([7], 10, ta), StepInput(b, 0, tb2)]))
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)


def test_bfloat16_agrees_with_float32(tiny_qwen3_dir):
    ids = prompt_ids(16, seed=6)
    f32 = prefill_in_chunks(make_runner(tiny_qwen3_dir, "float32"), ids, blocks_for(16), [16])
    bf16 = prefill_in_chunks(make_runner(tiny_qwen3_dir, "bfloat16"), ids, blocks_for(16), [16])
    assert bf16.dtype == torch.float32
    # bf16 keeps 8 mantissa bits; through 2 layers the logits stay within a few hundredths.
    torch.testing.assert_close(bf16, f32, atol=5e-2, rtol=5e-2)
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9


def test_bfloat16_decode_agrees_with_prefill_and_float32(tiny_qwen3_dir):
    """A bf16 decode step (CPU attention upcast to float32, see torch_backend) gives the logits a bf16 prefill of
    the same tokens gives, and float32's within bf16's rounding."""
    ids = prompt_ids(16, seed=7)
    last = {}
    for dtype in ("bfloat16", "float32"):
        runner = make_runner(tiny_qwen3_dir, dtype)
        table = blocks_for(16)
        runner.execute(ForwardBatch([StepInput(ids[:15], 0, table)], []))
        last[dtype] = runner.execute(ForwardBatch.last_tokens([StepInput(ids[15:], 15, table)]))
        if dtype == "bfloat16":
            whole = prefill_in_chunks(runner, ids, blocks_for(16, first=30), [16])
            torch.testing.assert_close(last[dtype][0], whole[-1], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(last["bfloat16"], last["float32"], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prepacked_cpu_weights_give_the_same_logits_as_dense(tiny_qwen3_dir, dtype):
    from rawserve.engine.models.packed import cpu_prepack_supported

    if not cpu_prepack_supported(getattr(torch, dtype)):
        pytest.skip(f"oneDNN {dtype} weight pre-packing is not available in this torch build")
    runner = make_runner(tiny_qwen3_dir, dtype)
    assert runner.model.layers[0].packed, f"CPU {dtype} weights should be pre-packed"
    assert runner.model.packed_head is not None
    ids = prompt_ids(12, seed=9)
    packed = prefill_in_chunks(runner, ids, blocks_for(12), [12])
    for layer in runner.model.layers:  # back to dense matmuls on the same weights
        for name, weight in layer.packed.items():
            getattr(layer, name).data = weight.to_dense()
        layer.packed.clear()
    dense = prefill_in_chunks(runner, ids, blocks_for(12, first=20), [12])
    # bf16: the two kernels may sum in another order, each rounding its output to 8 mantissa bits.
    tol = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(packed, dense, atol=tol, rtol=tol)


def test_bf16_tied_checkpoint_in_float32_keeps_its_embedding_narrow_and_matches_transformers(tmp_path):
    """The tied head is packed for the matmul; the dense rows kept for lookups stay at the checkpoint's bf16
    (half the bytes) and the logits still match transformers in float32."""
    from rawserve.engine.models.packed import cpu_prepack_supported

    path = make_hf_checkpoint(tmp_path / "bf16", "qwen3", tied=True, dtype="bfloat16")
    runner = make_runner(path, "float32")
    embed = runner.model.embed_tokens
    if cpu_prepack_supported(torch.float32):
        assert runner.model.packed_head is not None and embed.dtype == torch.bfloat16
    else:  # the dense embedding is the head's matmul weight: it stays float32
        assert embed.dtype == torch.float32
    ids = prompt_ids(17, seed=4)
    ours = prefill_in_chunks(runner, ids, blocks_for(17), [17])
    torch.testing.assert_close(ours, hf_logits(load_hf_model(path, "float32"), ids), atol=1e-4, rtol=1e-4)


def test_single_decode_reads_consecutive_blocks_in_place_and_matches_a_gather(tiny_qwen3_dir):
    ids = prompt_ids(9, seed=3)
    logits = {}
    for kind, table in (("gathered", blocks_for(9 + 12)), ("in place", list(range(7, 7 + -(-(9 + 12) // BLOCK))))):
        runner = make_runner(tiny_qwen3_dir)
        step = runner.execute(ForwardBatch.last_tokens([StepInput(ids, 0, table)]))
        out, token = [], int(step[-1].argmax())
        for i in range(12):
            batch = ForwardBatch.last_tokens([StepInput([token], len(ids) + i, table)])
            meta = runner._metadata(batch)[2]
            assert (meta.decode_block_run is not None) == (kind == "in place") and meta.decode_mask is None
            assert (meta.gather_out is None) == (kind == "in place")  # no buffer for a gather that never runs
            step = runner.execute(batch)
            out.append(step[-1])
            token = int(step[-1].argmax())
        logits[kind] = torch.stack(out)
    torch.testing.assert_close(logits["in place"], logits["gathered"], atol=1e-5, rtol=1e-5)


def test_gathers_reuse_one_buffer_pair_across_layers_and_steps_and_match_fresh_ones(tiny_qwen3_dir, monkeypatch):
    # A step with a chunked prefill (its own blocks gathered) and two decodes (theirs): every gather writes into
    # the runner's one K and V buffer, each used before the next overwrites it; the logits are those of fresh
    # gathers, bit for bit.
    a, b, c = prompt_ids(13, seed=6), prompt_ids(9, seed=7), prompt_ids(11, seed=8)
    ta, tb, tc = blocks_for(20), blocks_for(20, first=50), blocks_for(20, first=100)

    def run(runner: ModelRunner) -> list[torch.Tensor]:
        runner.execute(ForwardBatch([StepInput(a, 0, ta), StepInput(b, 0, tb), StepInput(c[:6], 0, tc)], []))
        steps = []
        for i in range(3):
            steps.append(runner.execute(ForwardBatch.last_tokens(
                [StepInput([7 + i], 13 + i, ta), StepInput([9 + i], 9 + i, tb)]
                + ([StepInput(c[6:], 6, tc)] if i == 0 else [StepInput([5 + i], 10 + i, tc)]))))
        return steps

    reused = make_runner(tiny_qwen3_dir, num_blocks=128)
    got = run(reused)
    assert reused._gathered is not None
    before = reused._gathered[0].data_ptr()
    reused.execute(ForwardBatch.last_tokens([StepInput([3], 16, ta)]))
    assert reused._gathered[0].data_ptr() == before  # a smaller step keeps the buffers it has
    reused.release_buffers()
    assert reused._gathered is None

    monkeypatch.setattr(ModelRunner, "_gather_out", lambda self, num_blocks: None)
    fresh = make_runner(tiny_qwen3_dir, num_blocks=128)
    expected = run(fresh)
    assert fresh._gathered is None
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)
