"""Qwen3-MoE, Qwen3.5-MoE and gpt-oss through the real EngineCore on tiny random checkpoints (CPU, float32): greedy
ids equal transformers' generate in batches of different lengths, with chunked prefill, preemption and prefix-cache
hits; prompt logprobs equal transformers'; the stacked expert form loads as the per-expert one does; the offline
LLM generates transformers' ids."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.core import EngineCore
from rawserve.engine.types import SamplingParams
from tests.checkpoints import MOE_FAMILIES, load_hf_moe, make_moe_checkpoint
from tests.engine import stepping
from tests.engine.stepping import greedy, hf_greedy, prompt_logprobs_against_hf, step_to_end

BLOCK = 4
VOCAB = 256


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def hf(ckpt, family):
    return load_hf_moe(ckpt, family)


def make_core(model_dir, **options) -> EngineCore:
    return stepping.make_core(model_dir, BLOCK, **options)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(core: EngineCore, requests, max_steps: int = 2000):
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    return step_to_end(core, max_steps)


def test_prompts_of_different_lengths_in_one_batch_equal_transformers(ckpt, hf):
    requests = [(f"r{n}", prompt(n, n), greedy(8)) for n in (1, 5, 13, 23)]
    tokens, _ = run(make_core(ckpt), requests)
    assert tokens == {rid: hf_greedy(hf, ids) for rid, ids, _ in requests}


def test_chunked_prefill_equals_transformers(ckpt, hf):
    # cuts at 7-token steps: inside blocks, and (gpt-oss) across the 6-token sliding window
    requests = [("short", prompt(6, 2), greedy(10)), ("long", prompt(40, 1), greedy(6))]
    tokens, _ = run(make_core(ckpt, max_num_batched_tokens=7), requests)
    assert tokens == {rid: hf_greedy(hf, ids, p.max_tokens) for rid, ids, p in requests}


def test_preempted_sequences_are_recomputed_and_equal_transformers(ckpt, hf):
    requests = [(f"p{i}", prompt(14 + 3 * i, 10 + i), greedy(14)) for i in range(3)]
    core = make_core(ckpt, num_kv_blocks=18)  # 3 x 7-8 blocks at full length: someone must yield
    tokens, _ = run(core, requests)
    assert core.scheduler.num_preemptions > 0
    assert tokens == {rid: hf_greedy(hf, ids, 14) for rid, ids, _ in requests}


def test_prefix_hit_gives_the_cold_output(ckpt, hf):
    ids = prompt(23, 5)
    core = make_core(ckpt)
    cold, _ = run(core, [("cold", ids, greedy(8))])
    hit, final = run(core, [("hit", ids, greedy(8))])
    assert hit["hit"] == cold["cold"] == hf_greedy(hf, ids)
    assert final["hit"].num_cached_tokens == 20


def test_prompt_logprobs_equal_transformers(ckpt, hf):
    # chunked: the logprob rows span several steps
    prompt_logprobs_against_hf(make_core(ckpt, max_num_batched_tokens=9), hf, prompt(21, 11))


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_stacked_expert_tensors_load_as_per_expert_ones(family, tmp_path):
    per_expert = make_moe_checkpoint(tmp_path / "a", family, seed=3)
    stacked = make_moe_checkpoint(tmp_path / "b", family, seed=3, stacked=True)
    requests = [("s", prompt(17, 4), greedy(8))]
    assert run(make_core(per_expert), requests)[0] == run(make_core(stacked), requests)[0] == \
        {"s": hf_greedy(load_hf_moe(per_expert, family), requests[0][1])}


def test_offline_llm_generates_transformers_ids(ckpt, hf):
    from rawserve.engine.frontend.llm import LLM

    llm = LLM(ckpt, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4)
    ids = prompt(17, 12)
    [result] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    assert [c.token_ids for c in result.outputs] == [hf_greedy(hf, ids, 6)] * 2
