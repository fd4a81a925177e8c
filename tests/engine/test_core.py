"""EngineCore end to end on a tiny random Qwen3 (CPU, float32): batching, prefix cache, preemption, chunking,
abort, priority, stop conditions, logprobs and validation."""
from __future__ import annotations

import functools
import pickle

import pytest
import torch

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore, make_engine_core
from rawserve.engine.types import SamplingParams
from tests.checkpoints import load_hf_model

BLOCK = 4
EOS = 2  # the tiny checkpoint's generation_config.json eos_token_id list


def make_core(model_dir, **options) -> EngineCore:
    defaults = dict(model_dir=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=256,
                    max_num_batched_tokens=256, max_num_seqs=32, max_model_len=256)
    return EngineCore(EngineConfig(**{**defaults, **options}))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def run(core: EngineCore, requests, joins=None, max_steps=5000):
    """Add requests (rid, ids, params[, priority[, options]]), at step joins[rid] when given; step to the end.

    Returns ({rid: output ids}, {rid: final RequestOutput}, [rids in finishing order]).
    """
    joins = joins or {}
    pending = list(requests)
    tokens: dict[str, list[int]] = {}
    final = {}
    order = []
    for step in range(max_steps):
        for item in [r for r in pending if joins.get(r[0], 0) <= step]:
            core.add_request(*item[:4], **(item[4] if len(item) > 4 else {}))
            pending.remove(item)
        if not pending and not core.has_unfinished:
            return tokens, final, order
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
                order.append(out.request_id)
    raise AssertionError("engine did not finish")


def assert_no_leak(core: EngineCore):
    assert core.blocks.num_free_blocks == core.num_blocks
    assert set(core.blocks.ref_counts) == {0}
    assert not core.has_unfinished and core.stats().num_running == 0 and core.stats().num_waiting == 0


def test_greedy_output_matches_transformers_generate(tiny_qwen3_dir):
    ids = prompt(11, seed=3)
    tokens, final, _ = run(make_core(tiny_qwen3_dir), [("a", ids, greedy(10, ignore_eos=True))])
    model = load_hf_model(tiny_qwen3_dir)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 11:].tolist()
    assert tokens["a"] == ref
    assert final["a"].finish_reason == "length" and final["a"].num_output_tokens == 10


def test_greedy_output_alone_equals_output_in_a_mixed_batch_of_16(tiny_qwen3_dir):
    requests = [(f"r{i}", prompt(3 + 7 * i % 40, seed=i), greedy(6 + i % 9)) for i in range(16)]
    alone = {}
    for rid, ids, params in requests:
        alone.update(run(make_core(tiny_qwen3_dir), [(rid, ids, params)])[0])
    joins = {f"r{i}": (i * 3) % 11 for i in range(16)}  # join at different steps, mid-decode of others
    batched, _, _ = run(make_core(tiny_qwen3_dir, max_num_batched_tokens=64), requests, joins)
    assert batched == alone


def test_seeded_sampling_is_identical_across_batch_compositions(tiny_qwen3_dir):
    mine = ("mine", prompt(9, seed=100), SamplingParams(seed=77, temperature=1.0, top_p=0.9, max_tokens=16))
    alone, _, _ = run(make_core(tiny_qwen3_dir), [mine])
    others = [(f"o{i}", prompt(5 + 3 * i, seed=i), SamplingParams(seed=i if i % 2 else None, max_tokens=10))
              for i in range(6)]
    batched, _, _ = run(make_core(tiny_qwen3_dir), others[:3] + [mine] + others[3:], {"o1": 2, "o4": 5})
    late, _, _ = run(make_core(tiny_qwen3_dir), others + [mine], {"mine": 4})
    assert batched["mine"] == alone["mine"] == late["mine"]
    assert len(set(alone["mine"])) > 3


def test_shared_three_block_prefix_is_cached_and_gives_the_cold_output(tiny_qwen3_dir):
    prefix = prompt(3 * BLOCK, seed=5)
    first, second = prefix + prompt(3, seed=6), prefix + prompt(2, seed=7)
    core = make_core(tiny_qwen3_dir)
    _, final, _ = run(core, [("first", first, greedy())])
    assert final["first"].num_cached_tokens == 0
    tokens, final, _ = run(core, [("second", second, greedy())])
    assert final["second"].num_cached_tokens == 3 * BLOCK
    cold, cold_final, _ = run(make_core(tiny_qwen3_dir, enable_prefix_caching=False), [("second", second, greedy())])
    assert tokens["second"] == cold["second"] and cold_final["second"].num_cached_tokens == 0
    stats = core.stats()
    assert stats.prefix_cache_hits == 3 * BLOCK and stats.prefix_cache_queries == len(first) + len(second)


def test_fully_cached_prompt_recomputes_its_last_block_and_matches(tiny_qwen3_dir):
    ids = prompt(4 * BLOCK, seed=8)
    core = make_core(tiny_qwen3_dir)
    first, _, _ = run(core, [("a", ids, greedy())])
    again, final, _ = run(core, [("b", ids, greedy())])
    assert final["b"].num_cached_tokens == 3 * BLOCK  # at most prompt_len - 1, on a block boundary
    assert again["b"] == first["a"]


def test_different_cache_salts_never_share_blocks(tiny_qwen3_dir):
    ids = prompt(3 * BLOCK + 1, seed=9)
    core = make_core(tiny_qwen3_dir)
    run(core, [("alice1", ids, greedy(), 0, {"cache_salt": "alice"})])
    _, final, _ = run(core, [("bob", ids, greedy(), 0, {"cache_salt": "bob"})])
    assert final["bob"].num_cached_tokens == 0
    _, final, _ = run(core, [("anon", ids, greedy())])
    assert final["anon"].num_cached_tokens == 0
    _, final, _ = run(core, [("alice2", ids, greedy(), 0, {"cache_salt": "alice"})])
    assert final["alice2"].num_cached_tokens == 3 * BLOCK


def test_features_on_a_model_without_a_vision_tower_fail_that_request_alone(tiny_qwen3_dir):
    # (images and the prefix cache: tests/engine/test_vision_engine.py)
    ids = prompt(3 * BLOCK + 1, seed=10)
    core = make_core(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="takes no images"):
        core.add_request("image", ids, greedy(2), features={"image": 1})
    _, final, _ = run(core, [("plain", ids, greedy(2))])
    assert final["plain"].num_output_tokens == 2


def test_small_pool_preempts_and_gives_exactly_the_large_pool_outputs(tiny_qwen3_dir):
    requests = [(f"r{i}", prompt(6 + 3 * i, seed=20 + i), greedy(20, ignore_eos=True)) for i in range(8)]
    requests.append(("seeded", prompt(7, seed=40), SamplingParams(seed=5, max_tokens=20, ignore_eos=True)))
    big, _, _ = run(make_core(tiny_qwen3_dir), requests)
    small_core = make_core(tiny_qwen3_dir, num_kv_blocks=14)  # the longest request alone needs 11 blocks
    small, _, _ = run(small_core, requests)
    assert small == big
    assert small_core.stats().num_preemptions > 0
    assert_no_leak(small_core)


def test_preemption_mid_prefill_restarts_prompt_logprobs_cleanly(tiny_qwen3_dir):
    def go(**options):
        core = make_core(tiny_qwen3_dir, max_num_batched_tokens=6, enable_prefix_caching=False, **options)
        core.add_request("decoder", prompt(15, 1), greedy(20, ignore_eos=True))
        core.add_request("scored", prompt(26, 2), greedy(3, prompt_logprobs=1, ignore_eos=True))
        outs = []
        while core.has_unfinished:
            outs += core.step()
        return core, outs

    big_core, big = go()
    # 10 blocks: the decoder holds 4-9 of them, so the scored prompt (7 blocks) cannot finish beside it and
    # is preempted part-way through its prefill.
    small_core, small = go(num_kv_blocks=10)
    assert small_core.stats().num_preemptions > 0
    def by_request(outs):
        return {rid: [t for o in outs if o.request_id == rid for t in o.new_token_ids] for rid in ("decoder", "scored")}

    assert by_request(small) == by_request(big)
    first = [o for o in small if o.request_id == "scored"][0]
    reference = [o for o in big if o.request_id == "scored"][0]
    assert len(first.prompt_logprobs) == 26 and first.prompt_logprobs[0] is None
    for got, want in zip(first.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        # Chunk boundaries differ between the runs, so values may differ in the last float bits.
        assert got[0] == want[0] and got[2] == want[2] and [t for t, _ in got[3]] == [t for t, _ in want[3]]
        assert got[1] == pytest.approx(want[1], abs=1e-5)
    assert_no_leak(small_core)


def test_chunked_prefill_gives_the_unchunked_outputs(tiny_qwen3_dir):
    requests = [(f"r{i}", prompt(30 + 11 * i, seed=50 + i), greedy(8)) for i in range(4)]
    whole, _, _ = run(make_core(tiny_qwen3_dir, max_num_batched_tokens=256), requests)
    core = make_core(tiny_qwen3_dir, max_num_batched_tokens=7)
    chunked, _, _ = run(core, requests)
    assert chunked == whole
    assert core.steps > 60 // 7  # the prompts really were spread over many steps


def test_abort_mid_prefill_and_mid_decode_returns_every_block(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    core.add_request("decoding", prompt(5, seed=1), greedy(50))
    core.add_request("prefilling", prompt(60, seed=2), greedy(50))
    core.add_request("waiting", prompt(5, seed=3), greedy(50))
    for _ in range(3):
        core.step()
    req = core.requests["prefilling"]
    assert 0 < req.num_computed_tokens < 60  # mid-prefill
    assert core.requests["decoding"].num_output_tokens > 0  # mid-decode
    out = core.abort_request("prefilling")
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == []
    assert core.abort_request("decoding").num_output_tokens > 0
    assert core.abort_request("waiting").finish_reason == "abort"
    assert core.abort_request("waiting") is None  # already gone: aborts race with completion
    assert_no_leak(core)
    assert core.step() == []


def test_priority_order_holds_under_contention(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir, max_num_seqs=1)
    requests = [("low", prompt(4, 1), greedy(3, ignore_eos=True), 10),
                ("high", prompt(4, 2), greedy(3, ignore_eos=True), -5),
                ("mid-a", prompt(4, 3), greedy(3, ignore_eos=True), 0),
                ("mid-b", prompt(4, 4), greedy(3, ignore_eos=True), 0)]
    _, _, order = run(core, requests)
    assert order == ["high", "mid-a", "mid-b", "low"]


def test_preemption_victim_is_the_lowest_priority_latest_request(tiny_qwen3_dir):
    # 6 blocks: three 8-token prompts fill them; the first decode step must preempt one.
    core = make_core(tiny_qwen3_dir, num_kv_blocks=6, enable_prefix_caching=False)
    core.add_request("old-low", prompt(8, 1), greedy(4, ignore_eos=True), 5)
    core.add_request("new-high", prompt(8, 2), greedy(4, ignore_eos=True), 0)
    core.add_request("new-low", prompt(8, 3), greedy(4, ignore_eos=True), 5)
    core.step()
    core.step()
    assert core.stats().num_preemptions == 1
    assert core.requests["new-low"].num_computed_tokens == 0


def test_eos_from_generation_config_stops_with_no_stop_reason(tiny_qwen3_dir):
    params = greedy(10, logit_bias={EOS: 100.0})
    tokens, final, _ = run(make_core(tiny_qwen3_dir), [("a", prompt(5, 1), params)])
    assert tokens["a"] == [EOS]
    assert final["a"].finish_reason == "stop" and final["a"].stop_reason is None


def test_stop_token_ids_stop_and_report_the_id(tiny_qwen3_dir):
    params = greedy(10, logit_bias={77: 100.0}, stop_token_ids=(77,))
    tokens, final, _ = run(make_core(tiny_qwen3_dir), [("a", prompt(5, 1), params)])
    assert tokens["a"] == [77] and final["a"].stop_reason == 77 and final["a"].finish_reason == "stop"


def test_min_tokens_and_ignore_eos_keep_generating(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir)
    tokens, final, _ = run(core, [
        ("min", prompt(5, 1), greedy(10, logit_bias={EOS: 100.0}, min_tokens=3)),
        ("ignore", prompt(5, 1), greedy(6, logit_bias={EOS: 100.0}, ignore_eos=True))])
    assert len(tokens["min"]) == 4 and tokens["min"][-1] == EOS and EOS not in tokens["min"][:3]
    assert final["min"].finish_reason == "stop"
    assert tokens["ignore"] == [EOS] * 6 and final["ignore"].finish_reason == "length"


def test_length_at_max_tokens_and_at_max_model_len(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir, max_model_len=20)
    tokens, final, _ = run(core, [("a", prompt(15, 1), greedy(5, ignore_eos=True))])
    assert len(tokens["a"]) == 5 and final["a"].finish_reason == "length"
    assert final["a"].num_prompt_tokens + final["a"].num_output_tokens == 20


def test_logprobs_and_prompt_logprobs_match_the_model_even_when_chunked(tiny_qwen3_dir):
    ids = prompt(13, seed=4)
    params = greedy(3, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    core = make_core(tiny_qwen3_dir, max_num_batched_tokens=5)
    core.add_request("a", ids, params)
    outs = []
    while core.has_unfinished:
        outs += core.step()
    model = load_hf_model(tiny_qwen3_dir)
    generated = [t for o in outs for t in o.new_token_ids]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + generated])).logits[0].float(), dim=-1)
    first = outs[0]
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]  # sent once
    plp = first.prompt_logprobs
    assert len(plp) == 13 and plp[0] is None
    for pos in range(1, 13):
        token, value, rank, top = plp[pos]
        assert token == ids[pos]
        assert value == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert rank == int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        assert [t for t, _ in top] == ref[pos - 1].topk(2).indices.tolist()
    for k, out in enumerate(outs):
        token, value, rank, top = out.logprobs[0]
        row = ref[len(ids) - 1 + k]
        assert token == generated[k] and rank == 1 and len(top) == 3
        assert value == pytest.approx(row[token].item(), abs=1e-4)


def test_max_tokens_0_scores_the_prompt_samples_nothing_and_frees_its_blocks(tiny_qwen3_dir):
    ids = prompt(13, seed=4)
    core = make_core(tiny_qwen3_dir, max_num_batched_tokens=5)  # the prompt spans three chunks
    tokens, final, _ = run(core, [("score", ids, greedy(0, prompt_logprobs=1)), ("plain", ids, greedy(0)),
                                  ("gen", prompt(6, 1), greedy(4, ignore_eos=True))])
    assert tokens["score"] == tokens["plain"] == [] and len(tokens["gen"]) == 4
    for rid in ("score", "plain"):
        assert final[rid].finish_reason == "length" and final[rid].num_output_tokens == 0
    assert final["plain"].prompt_logprobs is None
    _, reference, _ = run(core, [("ref", ids, greedy(1, prompt_logprobs=1))])
    assert final["score"].prompt_logprobs == reference["ref"].prompt_logprobs
    assert len(final["score"].prompt_logprobs) == 13
    assert_no_leak(core)


def test_prompt_logprobs_skip_the_prefix_cache_but_still_publish(tiny_qwen3_dir):
    ids = prompt(3 * BLOCK + 1, seed=12)
    core = make_core(tiny_qwen3_dir)
    run(core, [("a", ids, greedy(2, prompt_logprobs=1))])
    _, final, _ = run(core, [("b", ids, greedy(2))])
    assert final["b"].num_cached_tokens == 3 * BLOCK  # a's prompt blocks were published
    first, final, _ = run(core, [("c", ids, greedy(2, prompt_logprobs=1))])
    assert final["c"].num_cached_tokens == 0  # cached tokens have no logits to report, so c computes all
    outs = []
    core.add_request("d", ids, greedy(2, prompt_logprobs=1))
    while core.has_unfinished:
        outs += core.step()
    assert len(outs[0].prompt_logprobs) == len(ids)


def mutated(**fields) -> SamplingParams:
    """Params changed after construction (as a frontend could send them): the core must re-check."""
    params = SamplingParams()
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("change, message", [
    (dict(rid="dup"), "already in use"),
    (dict(ids=[]), "prompt: must hold at least one token"),
    (dict(ids=[3, 256]), "prompt: token id 256 is outside the vocabulary"),
    (dict(ids=[3, -1]), "prompt: token id -1 is outside the vocabulary"),
    (dict(ids=[3, 4.5]), "prompt: token ids must be integers"),
    (dict(params=SamplingParams(n=2)), "n: the engine core runs one sample per request"),
    (dict(params=SamplingParams(logit_bias={999: 1.0})), "logit_bias: token id 999 is outside the vocabulary"),
    (dict(params=SamplingParams(stop_token_ids=(300,))), "stop_token_ids: token id 300 is outside"),
    (dict(params=mutated(logit_bias={"5": 1.0})), "logit_bias: token ids must be integers"),
    (dict(params=SamplingParams(max_tokens=250)), "max_tokens: the prompt's 10 tokens plus max_tokens 250"),
    (dict(params=mutated(seed=1 << 70)), "seed: out of range"),
    (dict(params=mutated(temperature=1e-300)), "temperature: 1e-300 is below float32's smallest normal"),
    (dict(priority="high"), "priority: must be an integer"),
    (dict(params={"max_tokens": 3}), "params: expected SamplingParams"),
])
def test_add_request_rejections_say_what_is_wrong(tiny_qwen3_dir, change, message):
    core = make_core(tiny_qwen3_dir)
    core.add_request("dup", prompt(10, 1), greedy())
    args = dict(rid="new", ids=prompt(10, 1), params=greedy(), priority=0) | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        core.add_request(args["rid"], args["ids"], args["params"], args["priority"])
    assert list(core.requests) == ["dup"]  # a rejection fails that request alone


def test_request_needing_more_blocks_than_the_pool_is_rejected(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir, num_kv_blocks=4)  # 16 tokens of KV
    with pytest.raises(ValueError, match="needs 5 KV blocks .* the pool holds only 4"):
        core.add_request("big", prompt(10, 1), greedy(8))
    core.add_request("fits", prompt(10, 1), greedy(7))  # 16 KV tokens: the last sample needs no KV


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
                          (dict(max_tokens=-1), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
                          (dict(logprobs=21), "logprobs")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            SamplingParams(**kwargs)


def test_stats_and_factory(tiny_qwen3_dir):
    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", dtype="float32", block_size=BLOCK,
                          num_kv_blocks=32, max_model_len=128)
    factory = pickle.loads(pickle.dumps(functools.partial(make_engine_core, config)))
    core = factory()
    assert core.num_blocks == 32 and core.max_model_len == 128 and core.vocab_size == 256 and core.steps == 0
    core.add_request("a", prompt(9, 1), greedy(30, ignore_eos=True))
    core.add_request("b", prompt(9, 2), greedy(30, ignore_eos=True))
    core.step()
    stats = core.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0 and stats.steps == 1
    assert stats.num_blocks == 32 and stats.num_free_blocks == 32 - 6
    assert stats.kv_cache_usage == pytest.approx(6 / 32)


def test_bf16_core_reuses_one_float32_logits_buffer_and_gives_it_back_when_idle(tiny_qwen3_dir, monkeypatch):
    core = make_core(tiny_qwen3_dir, dtype="bfloat16")
    runner = core.runner
    requests = [(f"r{i}", prompt(6 + i, i), greedy(8)) for i in range(3)]
    fresh, _, _ = run(make_core(tiny_qwen3_dir, dtype="bfloat16"), requests)
    seen = []
    execute = runner.execute

    def spy(batch):  # the buffer each step's logits live in (a spy: the real forward runs)
        logits = execute(batch)
        seen.append((logits.data_ptr(), runner._logits is not None and logits.data_ptr() == runner._logits.data_ptr()))
        return logits

    monkeypatch.setattr(runner, "execute", spy)
    monkeypatch.setattr(runner, "_logits_out", lambda n: None)  # first: fresh float32 logits every step
    assert run(core, [(f"a{rid}", ids, p) for rid, ids, p in requests])[0] == {f"a{k}": v for k, v in fresh.items()}
    monkeypatch.undo()
    monkeypatch.setattr(runner, "execute", spy)
    seen.clear()
    out, _, _ = run(core, requests)
    assert out == fresh  # the same tokens as fresh logits, step after step through one buffer
    assert all(in_buffer for _, in_buffer in seen) and len({ptr for ptr, _ in seen[1:]}) == 1
    assert runner._logits is None  # the last request finished: the engine is idle and the buffer is gone
