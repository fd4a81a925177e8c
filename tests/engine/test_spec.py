"""Speculative decoding through EngineCore on the tiny random Qwen3 (CPU, float32): greedy and seeded outputs
token-for-token those of plain decoding, with chunked prefill, prefix hits, preemption, stops and max_tokens;
rollback frees every block; the sampled distribution is the target's (chi-square)."""
from __future__ import annotations

import json
import math

import pytest

from rawserve.config import EngineConfig
from rawserve.engine.types import SamplingParams
from tests.engine.test_core import assert_no_leak, greedy, make_core, prompt, run

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3, "min_acceptance": 0, "disable_by_batch_size": 64})


def repetitive(i: int, n: int = 24) -> list[int]:
    """A prompt that repeats a short random phrase, so the n-gram proposer finds matches from the start."""
    return (prompt(5, i) * n)[:n]


def both(model_dir, requests, spec=NGRAM, **options):
    """The same requests on a plain core and on a speculative one -> (plain run, spec run, spec core)."""
    plain = run(make_core(model_dir, **options), requests)
    core = make_core(model_dir, speculative_config=spec, **options)
    return plain, run(core, requests), core


def finals(result) -> dict:
    return {rid: (out.finish_reason, out.stop_reason, out.num_output_tokens) for rid, out in result[1].items()}


def accepted(core) -> int:
    return core.stats().extra["spec"]["num_accepted_tokens"]


def test_greedy_is_identical_with_ngram_drafts_in_a_mixed_batch(tiny_qwen3_dir):
    # Repetitive prompts draft from the first decode; random ones rarely: both kinds of row share steps
    requests = [(f"rep{i}", repetitive(i), greedy(40)) for i in range(4)]
    requests += [(f"rnd{i}", prompt(9, 100 + i), greedy(30)) for i in range(4)]
    plain, spec, core = both(tiny_qwen3_dir, requests)
    assert spec[0] == plain[0]
    assert finals(spec) == finals(plain)
    stats = core.stats().extra["spec"]
    assert stats["num_accepted_tokens"] > 20 and stats["num_drafts"] > 0
    assert core.steps < make_steps(tiny_qwen3_dir, requests)  # accepted drafts saved steps
    assert_no_leak(core)


def make_steps(model_dir, requests) -> int:
    core = make_core(model_dir)
    run(core, requests)
    return core.steps


def test_greedy_is_identical_under_chunked_prefill_prefix_hits_and_preemption(tiny_qwen3_dir):
    shared = repetitive(7, 16)  # four full blocks of 4: later requests hit them in the prefix cache
    requests = [(f"p{i}", shared + prompt(3, i), greedy(36)) for i in range(6)]
    requests += [(f"long{i}", repetitive(20 + i, 60), greedy(20)) for i in range(2)]
    # 16 tokens a step: prompts are chunked while other rows decode with their drafts; 40 blocks force preemption
    options = dict(max_num_batched_tokens=16, num_kv_blocks=40)
    plain, spec, core = both(tiny_qwen3_dir, requests, **options)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert core.scheduler.num_preemptions > 0 and core.blocks.prefix_cache_hits > 0 and accepted(core) > 0
    assert_no_leak(core)


def test_seeded_sampling_is_identical_with_drafts_under_every_parameter(tiny_qwen3_dir):
    """Each verified position draws with the request's generator's next uniform after the same processors, so a
    seeded request's tokens do not change with speculation at all (a stronger check than the distribution's)."""
    kinds = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.9, top_p=0.8),
             dict(temperature=1.0, min_p=0.2), dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4,
                                                    frequency_penalty=0.3),
             dict(temperature=0.6, logit_bias={5: 3.0, 9: -2.0}, min_tokens=4)]
    requests = [(f"s{i}", repetitive(i), SamplingParams(max_tokens=32, seed=40 + i, **kw))
                for i, kw in enumerate(kinds)]
    plain, spec, core = both(tiny_qwen3_dir, requests)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert accepted(core) > 0
    assert_no_leak(core)


def test_logprobs_of_accepted_tokens_are_the_targets(tiny_qwen3_dir):
    requests = [(f"l{i}", repetitive(i), greedy(24, logprobs=2)) for i in range(3)]
    plain, spec, core = both(tiny_qwen3_dir, requests)
    assert accepted(core) > 0
    for rid, out in plain[1].items():
        assert spec[0][rid] == plain[0][rid]
    plain_lp = collect_logprobs(tiny_qwen3_dir, requests, None)
    spec_lp = collect_logprobs(tiny_qwen3_dir, requests, NGRAM)
    for rid in plain_lp:
        assert len(spec_lp[rid]) == len(plain_lp[rid]) == len(plain[0][rid])
        for a, b in zip(spec_lp[rid], plain_lp[rid]):
            assert a[0] == b[0] and a[2] == b[2] and math.isclose(a[1], b[1], abs_tol=1e-4)
            assert [t for t, _ in a[3]] == [t for t, _ in b[3]]


def collect_logprobs(model_dir, requests, spec) -> dict:
    core = make_core(model_dir, speculative_config=spec)
    for rid, ids, params in requests:
        core.add_request(rid, ids, params)
    entries: dict[str, list] = {rid: [] for rid, _, _ in requests}
    while core.has_unfinished:
        for out in core.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            entries[out.request_id] += out.logprobs
    return entries


def test_stop_ids_eos_and_max_tokens_land_where_plain_decoding_puts_them(tiny_qwen3_dir):
    base = [(f"r{i}", repetitive(i), greedy(40)) for i in range(4)]
    plain = run(make_core(tiny_qwen3_dir), base)[0]
    requests = []
    for i, (rid, ids, _) in enumerate(base):
        out = plain[rid]
        requests.append((f"stop{i}", ids, greedy(40, stop_token_ids=(out[10 + i],))))  # deep inside the output
        requests.append((f"eos{i}", ids, greedy(40, logit_bias={2: 3.0 + i})))  # EOS somewhere, maybe mid-run
        requests.append((f"len{i}", ids, greedy(7 + i)))
    plain, spec, core = both(tiny_qwen3_dir, requests)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    for i in range(4):
        assert spec[1][f"stop{i}"].finish_reason == "stop" and spec[1][f"len{i}"].finish_reason == "length"
        assert len(spec[0][f"len{i}"]) == 7 + i
    assert accepted(core) > 0
    assert_no_leak(core)


def test_a_run_never_writes_past_max_model_len(tiny_qwen3_dir):
    requests = [(f"m{i}", repetitive(i, 40), greedy(12)) for i in range(3)]  # exactly to the limit
    plain, spec, core = both(tiny_qwen3_dir, requests, max_model_len=52)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert all(len(ids) == 12 for ids in spec[0].values())
    assert_no_leak(core)


def test_aborts_in_the_middle_of_verified_runs_leak_no_block(tiny_qwen3_dir):
    core = make_core(tiny_qwen3_dir, speculative_config=NGRAM, num_kv_blocks=64)
    for i in range(6):
        core.add_request(f"a{i}", repetitive(i), greedy(60))
    drafted = 0
    for step in range(12):
        core.step()
        drafted = core.stats().extra["spec"]["num_drafts"]
    assert drafted > 0
    # Mid-run: rows hold blocks for drafts just verified and blocks past their end trimmed
    held = [r for r in core.requests.values() if r.block_ids]
    assert held and all(len(r.block_ids) == core.blocks.blocks_for(r.num_computed_tokens) for r in held)
    for i in range(6):
        core.abort_request(f"a{i}")
    assert_no_leak(core)
    assert all(count == 0 for count in core.blocks.ref_counts)


def test_rejected_positions_are_never_published_to_the_prefix_cache(tiny_qwen3_dir):
    """Every cached block's key must be the hash of tokens the request really holds: a rejected draft written
    into a block and published would poison later prompts with the same prefix."""
    core = make_core(tiny_qwen3_dir, speculative_config=NGRAM)
    requests = [(f"c{i}", repetitive(i), greedy(40)) for i in range(4)]
    out = run(core, requests)[0]
    assert accepted(core) > 0
    cached_keys = set(core.blocks.cached)
    from rawserve.engine.kv_cache import extend_block_hashes
    legit = set()
    for rid, ids, _ in requests:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, ids + out[rid], 4, b"")
        legit.update(hashes)
    assert cached_keys and cached_keys <= legit
    # A second identical request hits those blocks and gives the same output
    again = run(core, [("again", requests[0][1], greedy(40))])[0]["again"]
    assert again == out["c0"]


def test_batch_size_turns_drafting_off_and_low_acceptance_pauses_a_row(tiny_qwen3_dir):
    off = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4})
    core = make_core(tiny_qwen3_dir, speculative_config=off)
    run(core, [(f"b{i}", repetitive(i), greedy(20)) for i in range(4)])
    stats = core.stats().extra["spec"]
    assert stats["num_drafts"] == 0 and stats["num_steps_off_by_batch"] > 0
    # Synthetic drafts at L = 1 are always rejected: the row pauses after its warm-up steps
    never = json.dumps({"method": "synthetic", "num_speculative_tokens": 3, "acceptance_length": 1,
                        "min_acceptance": 0.5})
    core = make_core(tiny_qwen3_dir, speculative_config=never)
    run(core, [("p", prompt(6, 1), greedy(60))])
    stats = core.stats().extra["spec"]
    assert stats["num_pauses"] >= 1 and stats["num_drafts"] < 30


@pytest.mark.parametrize("length", [1.0, 2.5, 4.0])
def test_synthetic_acceptance_has_the_mean_asked_for(tiny_qwen3_dir, length):
    spec = json.dumps({"method": "synthetic", "num_speculative_tokens": 3, "acceptance_length": length,
                       "min_acceptance": 0, "seed": 3})
    core = make_core(tiny_qwen3_dir, speculative_config=spec)
    out = run(core, [("s", prompt(6, 2), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))])[0]
    stats = core.stats().extra["spec"]
    mean = 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    assert abs(mean - length) < 0.35, mean
    assert len(out["s"]) == 200  # max_tokens holds under forced runs too
    assert_no_leak(core)


def test_speculative_config_is_checked_at_start(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="--speculative-config: method 'eagle' is not supported"):
        EngineConfig(speculative_config=json.dumps({"method": "eagle", "num_speculative_tokens": 1}))
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer in 1..16"):
        EngineConfig(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 0}))
    with pytest.raises(ValueError, match="prompt_lookup_min .* must be <= prompt_lookup_max"):
        EngineConfig(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_min": 4, "prompt_lookup_max": 2}))
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2, "k": 1}))


def test_guided_greedy_is_identical_and_drafts_pass_through_the_grammar(large_vocab_model_dir):
    """Each verified position is masked by the grammar's state after the tokens accepted before it: a draft the
    grammar forbids is rejected there, and the state moves only on emitted tokens."""
    from rawserve.engine.guided.grammar import Grammar
    from rawserve.engine.guided.nfa import compile_grammar
    from rawserve.engine.guided.regex import parse_regex
    from rawserve.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(large_vocab_model_dir)
    compiled = compile_grammar(Grammar({"root": parse_regex(r"(ab |cd ){10,30}\.")}), "abcd")
    requests = [(f"g{i}", tok.encode("ab cd ab cd ab ab cd " * 3) + [100 + i], SamplingParams(
        temperature=0, max_tokens=40, guided=compiled)) for i in range(3)]
    requests.append(("free", tok.encode("ab cd ab cd ab ab cd " * 3), greedy(20)))
    options = dict(block_size=16, num_kv_blocks=128, max_model_len=512)
    plain, spec, core = both(large_vocab_model_dir, requests, **options)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert accepted(core) > 0
    for i in range(3):
        text = tok.decode([t for t in spec[0][f"g{i}"] if t < 151643])
        assert text.startswith(("ab ", "cd ")) and set(text) <= set("abcd .")


def test_lora_rows_verify_against_their_adapter(tiny_qwen3_dir, tmp_path):
    peft = pytest.importorskip("peft")  # noqa: F841 - the adapter is written by peft
    from tests.engine.test_lora import make_adapter

    adapter = make_adapter(tiny_qwen3_dir, tmp_path / "a", 4, 8, ["q_proj", "v_proj", "gate_proj"])
    requests = [(f"l{i}", repetitive(i), greedy(30), 0, {"lora": "a"} if i % 2 else {}) for i in range(4)]
    plain, spec, core = both(tiny_qwen3_dir, requests, lora_modules=[f"a={adapter}"], max_lora_rank=4)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert accepted(core) > 0 and plain[0]["l0"] != plain[0]["l1"]
    assert_no_leak(core)


def test_ngram_proposer_takes_the_longest_latest_match_and_only_whole_ids():
    from rawserve.engine.spec.proposers import NgramProposer

    lookup = NgramProposer(1, 3)
    # [7, 8] occurs twice before the end: the latest occurrence's continuation; the 3-gram [9, 7, 8] wins over it
    assert lookup.propose([9, 7, 8, 1, 2, 7, 8, 3, 4, 9, 7, 8], 2).tokens == [1, 2]
    assert lookup.propose([5, 7, 8, 1, 2, 7, 8, 3, 4, 9, 7, 8], 2).tokens == [3, 4]
    assert lookup.propose([1, 2, 3], 4).tokens == []
    # 256 and 0 pack as bytes 00 01 00 00 00 00 00 00, which hold token 1's 01 00 00 00 one byte off: no match
    assert lookup.propose([256, 0, 5, 1], 2).tokens == []
    assert NgramProposer(2, 2).propose([4, 1, 6, 1, 6], 3).tokens == [1, 6]


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory):
    """A 1-layer draft of the tiny Qwen3's vocabulary with other weights: its drafts are mostly rejected."""
    from tests.checkpoints import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("draft"), "qwen3", seed=5, num_hidden_layers=1, hidden_size=32,
                              intermediate_size=64, head_dim=16)


def draft_spec(model_dir) -> str:
    return json.dumps({"model": str(model_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 64})


def test_a_draft_model_equal_to_the_target_has_every_draft_accepted(tiny_qwen3_dir):
    """The draft's KV pool follows the target's block ids through chunked prefill, prefix hits and preemption:
    a draft with the target's own weights must then draft exactly the target's tokens."""
    shared = repetitive(7, 16)
    requests = [(f"d{i}", shared + prompt(3, i), greedy(30)) for i in range(5)]
    options = dict(max_num_batched_tokens=16, num_kv_blocks=28)
    plain, spec, core = both(tiny_qwen3_dir, requests, spec=draft_spec(tiny_qwen3_dir), **options)
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    stats = core.stats().extra["spec"]
    assert core.scheduler.num_preemptions > 0 and core.blocks.prefix_cache_hits > 0
    assert stats["num_draft_tokens"] > 60 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert_no_leak(core)
    # Seeded sampled rows beside greedy ones: accepted where the draw agrees, the same tokens as plain decoding
    requests = requests[:2] + [(f"s{i}", prompt(8, 30 + i), SamplingParams(temperature=0.8, top_k=6, seed=i,
                                                                          max_tokens=24)) for i in range(2)]
    plain, spec, core = both(tiny_qwen3_dir, requests, spec=draft_spec(tiny_qwen3_dir))
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    assert_no_leak(core)


def test_a_different_draft_model_changes_nothing_but_acceptance(tiny_qwen3_dir, small_draft_dir):
    requests = [(f"r{i}", prompt(9, i), greedy(24)) for i in range(3)]
    plain, spec, core = both(tiny_qwen3_dir, requests, spec=draft_spec(small_draft_dir))
    assert spec[0] == plain[0] and finals(spec) == finals(plain)
    stats = core.stats().extra["spec"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert_no_leak(core)


def test_a_draft_model_is_checked_at_start(tiny_qwen3_dir, tmp_path, large_vocab_model_dir):
    with pytest.raises(ValueError, match="needs \"model\": a checkpoint directory"):
        EngineConfig(speculative_config=json.dumps({"model": str(tmp_path / "none"), "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="the draft model's vocabulary \\(151936\\) is not the target's \\(256\\)"):
        make_core(tiny_qwen3_dir, speculative_config=draft_spec(large_vocab_model_dir))


def test_the_draft_models_kv_pool_comes_out_of_the_kv_budget(tiny_qwen3_dir, small_draft_dir):
    """--kv-cache-memory-gb buys blocks of the target's KV and the draft's together (the draft's pool has a block
    for each of the target's): fewer blocks than without, and both pools inside the budget."""
    probe = make_core(tiny_qwen3_dir, max_model_len=64)
    seq_blocks = probe.blocks.blocks_for(64)
    budget = 3 * seq_blocks * probe.runner.block_bytes  # 3 sequences' worth of the target's KV alone, of 4 asked
    options = dict(num_kv_blocks=None, kv_cache_memory_gb=budget / (1 << 30), max_num_seqs=4, max_model_len=64)
    plain = make_core(tiny_qwen3_dir, **options)
    core = make_core(tiny_qwen3_dir, speculative_config=draft_spec(small_draft_dir), **options)
    draft_pool = sum(t.numel() * t.element_size() for pair in core.spec.draft.runner.kv_caches for t in pair)
    assert plain.num_blocks == budget // probe.runner.block_bytes
    assert seq_blocks <= core.num_blocks < plain.num_blocks
    assert core.num_blocks * core.runner.block_bytes + draft_pool <= budget
