"""Qwen3.5 (hybrid) through the real EngineCore on a tiny random checkpoint (CPU, float32): greedy ids equal
transformers' generate in mixed batches, chunked prefill, preemption, n = 2 and prefix-cache hits; prompt logprobs
equal transformers'; the state cache gives every slot back after every kind of ending, restores exactly the state a
cold run reaches, bounds admission by its slots and shares the KV cache's memory budget."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine import memory
from rawserve.engine.core import EngineCore
from rawserve.engine.rules import samples
from rawserve.engine.types import SamplingParams
from tests.engine import stepping
from tests.engine.stepping import greedy, hf_greedy, prompt_logprobs_against_hf, step_to_end
from tests.qwen35_checkpoints import load_hf_qwen35, make_qwen35_checkpoint

BLOCK = 4
VOCAB = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # a larger init than transformers' 0.02, so greedy outputs vary from token to token (a stuck id proves little)
    return make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35"), initializer_range=0.1)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf_qwen35(ckpt)


def make_core(model_dir, **options) -> EngineCore:
    return stepping.make_core(model_dir, BLOCK, **options)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(core: EngineCore, requests, max_steps: int = 2000, on_step=None):
    """Add (rid, ids, params) requests, step to the end -> ({rid: ids}, {rid: final output})."""
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    return step_to_end(core, max_steps, on_step)


def assert_no_leak(core: EngineCore) -> None:
    states = core.states
    assert states.num_free_slots == states.num_running, "a state slot was not given back"
    assert sorted(states.free_running) == list(range(states.num_running))
    assert core.blocks.num_free_blocks == core.num_blocks and set(core.blocks.ref_counts) == {0}
    assert not core.has_unfinished


def slot_state(core: EngineCore, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for pair in core.runner.states for t in pair]


def test_prompts_of_different_lengths_in_one_batch_equal_transformers_generate(ckpt, hf):
    lengths = [1, 5, 13, 23, 40]
    requests = [(f"r{n}", prompt(n, n), greedy(8)) for n in lengths]
    core = make_core(ckpt)
    assert core.runner.is_hybrid and len(core.runner.kv_caches) == 2  # KV for the 2 full-attention layers only
    tokens, final = run(core, requests)
    assert tokens == {rid: hf_greedy(hf, ids) for rid, ids, _ in requests}
    assert all(out.finish_reason == "length" for out in final.values())
    assert_no_leak(core)


def test_chunked_prefill_with_edges_inside_conv_windows_and_delta_chunks(ckpt, hf):
    # 150 tokens in steps of 37 beside a short request's prompt, then its decodes: edges at odd positions, inside
    # the conv's 3-token window and inside the delta rule's 64-token chunks (then 148, the prompt's save edge).
    requests = [("short", prompt(6, 2), greedy(12)), ("long", prompt(150, 1), greedy(6))]
    core = make_core(ckpt, max_num_batched_tokens=37)
    chunks = []
    tokens, _ = run(core, requests, on_step=lambda c: chunks.append(c.requests["long"].num_computed_tokens)
                    if "long" in c.requests else None)
    assert chunks[:6] == [33, 68, 104, 140, 148, 150]  # the short prompt cut at its save edge (4) first
    assert tokens == {rid: hf_greedy(hf, ids, p.max_tokens) for rid, ids, p in requests}
    assert_no_leak(core)


def test_preempted_sequences_are_recomputed_and_equal_transformers(ckpt, hf):
    requests = [(f"p{i}", prompt(14 + 3 * i, 10 + i), greedy(14)) for i in range(3)]
    core = make_core(ckpt, num_kv_blocks=18)  # 3 x 7-8 blocks at full length: someone must yield
    tokens, _ = run(core, requests)
    assert core.scheduler.num_preemptions > 0
    assert tokens == {rid: hf_greedy(hf, ids, 14) for rid, ids, _ in requests}
    assert_no_leak(core)


def test_n_2_samples_each_equal_transformers(ckpt, hf):
    ids = prompt(19, 4)
    children = samples(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))
    core = make_core(ckpt)
    tokens, final = run(core, [(f"s{j}", ids, params) for j, params in enumerate(children)])
    assert tokens["s0"] == tokens["s1"] == hf_greedy(hf, ids)
    # The second sample waits for the first's prefill and resumes from its state, saved at the prompt's last
    # block edge: the prompt is computed once, not twice
    assert final["s0"].num_cached_tokens == 0 and final["s1"].num_cached_tokens == 16
    assert core.states.num_restores == 1
    assert_no_leak(core)


def test_a_prompt_sharing_only_part_of_a_prefill_does_not_wait_for_it(ckpt):
    # No state is saved where the two part (block 2 of 5), so waiting for the first would gain the second nothing
    first = prompt(23, 5)
    second = first[:8] + prompt(15, 6)
    core = make_core(ckpt)
    core.add_request("a", first, greedy(2))
    core.add_request("b", second, greedy(2))
    core.step()
    assert core.requests["a"].num_computed_tokens > 0 and core.requests["b"].num_computed_tokens > 0
    step_to_end(core)
    assert_no_leak(core)


def test_prefix_hit_restores_a_saved_state_and_gives_the_cold_output(ckpt, hf):
    ids = prompt(23, 5)
    core = make_core(ckpt)
    cold, _ = run(core, [("cold", ids, greedy(8))])
    assert core.states.num_restores == 0
    hit, final = run(core, [("hit", ids, greedy(8))])
    assert hit["hit"] == cold["cold"] == hf_greedy(hf, ids)
    assert final["hit"].num_cached_tokens == 20  # the prompt's last full block edge: (23 - 1) // 4 * 4
    assert core.states.num_restores == 1
    assert_no_leak(core)


def test_multi_turn_prompt_extending_the_last_output_hits_past_the_first_prompt(ckpt, hf):
    core = make_core(ckpt)
    first = prompt(18, 6)
    out, _ = run(core, [("t1", first, greedy(11))])
    second = first + out["t1"] + prompt(7, 7)  # the next turn: history, the answer, a new message
    turn2, final = run(core, [("t2", second, greedy(8))])
    assert turn2["t2"] == hf_greedy(hf, second)
    # The decode's rolling save at its last block edge: 28 of the 29 tokens the first turn computed
    assert final["t2"].num_cached_tokens == 28 and core.states.num_restores == 1
    assert_no_leak(core)


def test_a_hit_restores_exactly_the_state_a_cold_run_reaches(ckpt):
    ids = prompt(27, 8)
    edge = (len(ids) - 1) // BLOCK * BLOCK  # 24
    cold = make_core(ckpt, enable_prefix_caching=False)
    run(cold, [("c", ids[:edge], SamplingParams(temperature=0, max_tokens=1))])
    expected = slot_state(cold, 0)  # the state after exactly `edge` tokens, computed from zeros

    core = make_core(ckpt)
    run(core, [("first", ids, greedy(3))])
    restored = []
    execute = core.runner.execute

    def spy(batch):  # the state the forward starts from, after the restore's copy
        if "second" in core.requests and core.requests["second"].num_computed_tokens == edge:
            restored.append(slot_state(core, core.requests["second"].state_slot))
        return execute(batch)

    core.runner.execute = spy
    run(core, [("second", ids, greedy(3))])
    assert core.states.num_restores == 1 and len(restored) == 1
    for got, want in zip(restored[0], expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_missing_kv_block_makes_its_saved_state_go(ckpt):
    core = make_core(ckpt)
    ids = prompt(23, 9)
    run(core, [("a", ids, greedy(2))])
    slots = set(core.states.saved.values())
    assert slots
    core.blocks.compact(0)  # the idle engine's compaction, keeping nothing: every cached block is evicted
    assert not core.blocks.cached and not core.states.saved
    assert slots <= set(core.states.free_saved)
    _, final = run(core, [("b", ids, greedy(2))])
    assert final["b"].num_cached_tokens == 0 and core.states.num_restores == 0


def test_prompt_logprobs_and_logprobs_equal_transformers(ckpt, hf):
    ids = prompt(21, 11)
    core = make_core(ckpt, max_num_batched_tokens=9)  # chunked: the logprob rows span several steps
    outs, ref = prompt_logprobs_against_hf(core, hf, ids)
    generated = [t for out in outs for t in out.new_token_ids]
    assert generated == ref[len(ids) - 1:-1].argmax(-1).tolist()
    token, value, rank, top = outs[-1].logprobs[0]
    assert token == generated[-1] and rank == 1 and len(top) == 2
    assert value == pytest.approx(ref[-2, token].item(), abs=1e-4)
    assert_no_leak(core)


class FaultyGrammar:
    """A grammar state whose mask raises: the request fails alone (EngineCore._fail_alone)."""

    is_complete = False

    def mask(self):
        raise RuntimeError("broken grammar")

    def advance(self, token_id: int) -> None:
        pass


def test_no_state_slot_leaks_after_finish_abort_preemption_and_errors(ckpt):
    core = make_core(ckpt, max_num_batched_tokens=10, num_kv_blocks=16)
    for i in range(4):
        core.add_request(f"d{i}", prompt(12 + i, 20 + i), greedy(12))
    core.add_request("mid-prefill", prompt(40, 30), greedy(4))
    core.add_request("bad", prompt(6, 31), greedy(4))
    core.requests["bad"].guided = FaultyGrammar()
    failed = []
    for step in range(400):
        if not core.has_unfinished:
            break
        req = core.requests.get("mid-prefill")
        if req is not None and 0 < req.num_computed_tokens < 40:
            core.abort_request("mid-prefill")  # abort in the middle of its prompt
        decoding = core.requests.get("d3")
        if decoding is not None and decoding.num_output_tokens == 3:
            core.abort_request("d3")  # abort in the middle of its decode
        failed += [out.request_id for out in core.step() if out.finish_reason == "error"]
        running = [r for r in core.scheduler.running if r.status.name == "RUNNING"]
        assert len({r.state_slot for r in running}) == len(running) and all(r.state_slot >= 0 for r in running)
        assert core.states.num_free_slots == core.states.num_running - len(running)
    assert failed == ["bad"] and core.scheduler.num_preemptions > 0
    assert_no_leak(core)


def test_admission_waits_for_a_free_state_slot(ckpt, hf):
    # A budget whose states get half: 4 slots of 48,480 bytes, 2 running and 2 saved, though --max-num-seqs is 8
    state_bytes = make_core(ckpt, num_kv_blocks=64).runner.model.state_bytes_per_slot()
    budget = 8 * state_bytes
    core = make_core(ckpt, num_kv_blocks=None, kv_cache_memory_gb=budget / (1 << 30), max_model_len=64)
    assert (core.states.num_running, core.states.num_saved) == (2, 2)
    assert "4 state slots" in core.runner.kv_plan.reason
    requests = [(f"q{i}", prompt(5 + i, 40 + i), greedy(6)) for i in range(4)]
    most = []
    tokens, _ = run(core, requests, on_step=lambda c: most.append(c.scheduler.num_running))
    assert max(most) == 2
    assert tokens == {rid: hf_greedy(hf, ids, 6) for rid, ids, _ in requests}
    assert_no_leak(core)


def test_plan_puts_states_and_kv_in_one_budget():
    common = dict(block_bytes=1000, block_size=16, max_num_seqs=4, max_model_len=160, num_kv_blocks=None,
                  room=None, margin_bytes=0, share=0.8)
    roomy = memory.plan_kv_cache(memory_gb=1.0, state_bytes=10_000, save_states=True, **common)
    assert (roomy.num_state_slots, roomy.num_saved_states, roomy.num_blocks) == (4, 4, 40)
    assert roomy.num_bytes == 40 * 1000 + 8 * 10_000 and roomy.kv_bytes == 40 * 1000  # the startup line's KV
    tight = memory.plan_kv_cache(memory_gb=60_000 / (1 << 30), state_bytes=10_000, save_states=True, **common)
    assert (tight.num_state_slots, tight.num_saved_states) == (2, 1)  # at most half the budget: 3 slots
    assert tight.num_blocks == 30 and tight.num_bytes <= 60_000
    plain = memory.plan_kv_cache(memory_gb=60_000 / (1 << 30), state_bytes=10_000, save_states=False, **common)
    assert (plain.num_state_slots, plain.num_saved_states) == (3, 0)


def test_offline_llm_generates_transformers_ids_for_n_2(ckpt, hf):
    from rawserve.engine.frontend.llm import LLM

    llm = LLM(ckpt, device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_model_len=256,
              max_num_seqs=4)
    ids = prompt(17, 12)
    [result] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
    assert [c.token_ids for c in result.outputs] == [hf_greedy(hf, ids, 6)] * 2
    assert_no_leak(llm.core)
