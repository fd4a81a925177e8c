"""Long-context CPU decode attention (attention/long_decode.py): chunked reads straight from the block pool give
the batched SDPA's result, for consecutive and scattered block tables, beside prefill rows, and keep whole models
(Qwen3, Qwen3.5) equal to transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rawserve.engine.attention import long_decode, torch_backend
from rawserve.engine.step_plan import ForwardBatch, StepInput
from tests.checkpoints import load_hf_model
from tests.engine.test_model import make_runner, prompt_ids
from tests.engine.stepping import greedy, hf_greedy, make_core, step_to_end
from tests.engine.test_qwen35_model import Driver, attention_metadata, blocks_for
from tests.qwen35_checkpoints import load_hf_qwen35, make_qwen35_checkpoint

BLOCK = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 8


@pytest.fixture
def short_chunks(monkeypatch):
    """Every decode takes the long path, in chunks of two blocks: tiny contexts then span several chunks."""
    monkeypatch.setattr(long_decode, "LONG_DECODE_TOKENS", 1)
    monkeypatch.setattr(long_decode, "CHUNK_TOKENS", 2 * BLOCK)


def filled_cache(dtype: torch.dtype, num_blocks: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))


def step(seqs: list[StepInput], k_cache, v_cache, q: torch.Tensor) -> torch.Tensor:
    meta = attention_metadata(seqs, BLOCK)[0]
    return torch_backend.paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5), meta


def reference(q: torch.Tensor, k_cache, v_cache, table: list[int], seq_len: int) -> torch.Tensor:
    """One decode row's attention in float64 over its blocks, GQA expanded: [heads, D]."""
    k = k_cache[table].flatten(0, 1)[:seq_len].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:seq_len].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.double().unsqueeze(1), k, v, scale=HEAD_DIM ** -0.5).squeeze(1)


def test_chunked_decodes_beside_a_prefill_equal_the_batched_sdpa(monkeypatch):
    # A prefill chunk and four decodes: one on consecutive blocks (one view of the pool), one scattered (gathered
    # a chunk at a time), one whose blocks are consecutive but for its last chunk, one whose runs of consecutive
    # blocks alternate with single blocks; lengths end mid-block and mid-chunk.
    k_cache, v_cache = filled_cache(torch.float32)
    seqs = [StepInput([1], 37, list(range(3, 13))),
            StepInput([5, 6, 7], 10, [40, 41, 42, 43]),
            StepInput([2], 29, [50, 20, 48, 13, 31, 22, 24, 60]),
            StepInput([9], 22, [14, 15, 16, 17, 30, 2]),
            StepInput([4], 30, [8, 33, 34, 35, 36, 61, 52, 53])]
    q = torch.randn(7, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(long_decode, "LONG_DECODE_TOKENS", 10 ** 9)
    batched, meta = step(seqs, k_cache, v_cache, q)
    assert meta.long_decodes is None
    monkeypatch.setattr(long_decode, "LONG_DECODE_TOKENS", 38)
    monkeypatch.setattr(long_decode, "CHUNK_TOKENS", 2 * BLOCK)
    chunked, meta = step(seqs, k_cache, v_cache, q)
    assert [plan.token for plan in meta.long_decodes] == [0, 4, 5, 6]
    kinds = [[c.first_block is not None for c in plan.chunks] for plan in meta.long_decodes]
    assert kinds == [[True], [False] * 4, [True, False], [False, True, False, True]]
    assert [sum(c.num_tokens for c in plan.chunks) for plan in meta.long_decodes] == [38, 30, 23, 31]
    torch.testing.assert_close(chunked, batched, atol=1e-5, rtol=1e-5)
    for row, seq in zip((0, 4, 5, 6), (seqs[0], seqs[2], seqs[3], seqs[4])):
        expected = reference(q[row], k_cache, v_cache, seq.block_table, seq.num_computed_tokens + 1)
        torch.testing.assert_close(chunked[row].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(params=[1, 2], ids=["one-thread", "split-with-helper"])
def threads(request, monkeypatch):
    """With two intra-op threads the decodes' tokens are split between this thread and the helper (at any
    length here)."""
    monkeypatch.setattr(long_decode, "SPLIT_TOKENS", 1)
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_a_decode_only_step_returns_the_decodes_in_batch_order(short_chunks, threads):
    # Two threads: the 42 tokens are cut at 21, inside the second decode (at its block edge after 7 tokens, 8),
    # so the first decode is this thread's, the third the helper's, and the second is merged from both.
    k_cache, v_cache = filled_cache(torch.float32, seed=2)
    seqs = [StepInput([1], 13, [7, 8, 9, 10]), StepInput([1], 21, [40, 41, 42, 43, 44, 45]),
            StepInput([1], 5, [30, 2])]
    q = torch.randn(3, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    out, _ = step(seqs, k_cache, v_cache, q)
    assert torch.get_num_threads() == threads  # given back after the single-threaded chunk loop
    for row, seq in enumerate(seqs):
        expected = reference(q[row], k_cache, v_cache, seq.block_table, seq.num_computed_tokens + 1)
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5)


def test_a_batch_of_shorter_decodes_takes_the_long_path_by_its_padded_size(monkeypatch):
    # Below LONG_DECODE_TOKENS, decodes x longest context decides: the batched SDPA would attend over every
    # decode's context padded to the longest.
    monkeypatch.setattr(long_decode, "LONG_DECODE_TOKENS", 10 ** 9)
    monkeypatch.setattr(long_decode, "BATCH_LONG_TOKENS", 80)
    monkeypatch.setattr(long_decode, "BATCH_MIN_TOKENS", 16)
    k_cache, v_cache = filled_cache(torch.float32, seed=6)
    seqs = [StepInput([1], 19, [3, 4, 5, 6, 7]), StepInput([1], 9, [20, 22, 21]), StepInput([1], 15, [30, 31, 9, 10]),
            StepInput([1], 12, [50, 51, 52, 53])]
    q = torch.randn(4, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    out, meta = step(seqs, k_cache, v_cache, q)  # 4 decodes x 20 tokens: 80
    assert [plan.token for plan in meta.long_decodes] == [0, 1, 2, 3]
    for row, seq in enumerate(seqs):
        expected = reference(q[row], k_cache, v_cache, seq.block_table, seq.num_computed_tokens + 1)
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5)
    _, meta = step(seqs[1:], k_cache, v_cache, q[1:])  # 3 x 16: 48
    assert meta.long_decodes is None
    monkeypatch.setattr(long_decode, "BATCH_MIN_TOKENS", 21)  # 80, but the longest is under the minimum
    _, meta = step(seqs, k_cache, v_cache, q)
    assert meta.long_decodes is None


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3"])
def test_a_narrow_cache_rounds_only_the_scores_to_bf16(monkeypatch, threads, cache_dtype):
    # bf16 products straight over the pool: each q.k is rounded to bf16 once (as transformers' eager attention
    # does in bf16), then the softmax and its normaliser run in float32. So the output is that rounding's float64
    # answer to within bf16 steps of the V products, where the float32 upcast this path once did is off by the
    # whole rounding (0.021 here, peaky scores: q is 3 x randn).
    k_cache, v_cache = filled_cache(cache_dtype, num_blocks=260, seed=4)
    table = list(range(1, 257))
    q = (3 * torch.randn(1, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(5))).bfloat16()
    seqs = [StepInput([1], 1020, table)]
    k = k_cache[table].flatten(0, 1)[:1021].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:1021].double().repeat_interleave(GROUP, 1).transpose(0, 1)
    scores = (q[0].double().unsqueeze(1) @ k.transpose(1, 2)).bfloat16().double() * HEAD_DIM ** -0.5
    expected = (scores.softmax(-1) @ v).squeeze(1)  # [heads, D]
    monkeypatch.setattr(long_decode, "LONG_DECODE_TOKENS", 1)
    chunked = step(seqs, k_cache, v_cache, q)[0][0]
    assert chunked.dtype == torch.bfloat16
    torch.testing.assert_close(chunked.double(), expected, atol=6e-3, rtol=8e-3)
    exact = reference(q[0], k_cache, v_cache, table, 1021)
    torch.testing.assert_close(chunked.double(), exact, atol=3e-2, rtol=3e-2)


def test_qwen3_greedy_decode_through_the_chunked_path_equals_transformers(tiny_qwen3_dir, short_chunks):
    ids = prompt_ids(9, seed=1)
    runner = make_runner(tiny_qwen3_dir)
    table = [5, 6, 7, 2, 11, 12, 13, 14]  # runs and a break: views and gathers both
    logits = runner.execute(ForwardBatch.last_tokens([StepInput(ids, 0, table)]))
    tokens = []
    for i in range(20):
        tokens.append(int(logits[-1].argmax()))
        if i < 19:
            batch = ForwardBatch.last_tokens([StepInput([tokens[-1]], len(ids) + i, table)])
            assert runner._metadata(batch)[2].long_decodes is None  # planned by the first layer that reads it
            logits = runner.execute(batch)
    hf = load_hf_model(tiny_qwen3_dir, "float32")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert tokens == ref


def test_qwen35_greedy_decode_through_the_chunked_path_equals_transformers(tmp_path, short_chunks):
    path = make_qwen35_checkpoint(tmp_path)
    hf = load_hf_qwen35(path, conditional=False)
    ids = prompt_ids(19, seed=2)
    driver = Driver(path)
    table = blocks_for(19 + 16)
    logits = driver.prefill(ids, [11, 19], table, slot=1)
    tokens = []
    for step_index in range(16):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.run([StepInput([tokens[-1]], len(ids) + step_index, table, state_slot=1)])
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert tokens == ref


def test_engine_core_decodes_of_different_lengths_through_the_chunked_path_equal_transformers(tmp_path,
                                                                                             short_chunks):
    # Through the real EngineCore (scheduler, block allocator, state cache, runner): three Qwen3.5 requests decode
    # together, their tables interleaved by the allocator, every decode on the chunked path.
    path = make_qwen35_checkpoint(tmp_path, initializer_range=0.1)
    hf = load_hf_qwen35(path)
    core = make_core(path, BLOCK)
    prompts = {f"r{i}": prompt_ids(n, seed=10 + i) for i, n in enumerate((5, 13, 22))}
    for rid, ids in prompts.items():
        core.add_request(rid, ids, greedy(10))
    tokens, _ = step_to_end(core)
    for rid, ids in prompts.items():
        assert tokens[rid] == hf_greedy(hf, ids, 10), rid
