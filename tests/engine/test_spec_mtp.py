"""Speculative decoding with Qwen3.5's MTP layer (--speculative-config {"method": "mtp"}) on tiny random
checkpoints: greedy and seeded outputs equal plain decoding's (chunked prefill, preemption, mixed batches),
acceptance is high where the MTP block is built to predict the target's next token and low where it is random,
and every block and state slot comes back."""
from __future__ import annotations

import json
import time

import pytest
import torch

from rawserve.engine.types import SamplingParams
from tests.engine.test_qwen35_engine import greedy, make_core, prompt, run
from tests.qwen35_checkpoints import add_mtp_block, make_qwen35_checkpoint


def mtp(k: int = 3) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k, "min_acceptance": 0,
                       "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    return add_mtp_block(make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-mtp"), initializer_range=0.1))


@pytest.fixture(scope="module")
def predicting_mtp(tmp_path_factory):
    directory = make_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-mtp-bigram"), initializer_range=0.1,
                                       bigram=True, tied=False)  # untied: a tied head maps a token to itself
    return add_mtp_block(directory, predicts_next=True)


def assert_all_back(core):
    assert core.blocks.num_free_blocks == core.num_blocks and not core.has_unfinished
    assert core.states.num_free_slots == core.states.num_running


def mean_accepted(core) -> float:
    stats = core.stats().extra["spec"]
    return stats["num_accepted_tokens"] / max(stats["num_drafts"], 1)


def test_greedy_and_seeded_outputs_are_unchanged_by_mtp_drafts(random_mtp):
    requests = [(f"g{i}", prompt(5 + 7 * i, i), greedy(20)) for i in range(3)]
    requests += [(f"s{i}", prompt(9, 10 + i), SamplingParams(temperature=0.8, top_k=8, seed=i, max_tokens=16,
                                                             ignore_eos=True)) for i in range(2)]
    plain = run(make_core(random_mtp), requests)[0]
    core = make_core(random_mtp, speculative_config=mtp())
    assert run(core, requests)[0] == plain
    stats = core.stats().extra["spec"]
    assert stats["num_drafts"] > 10 and stats["num_draft_tokens"] > stats["num_drafts"]
    assert_all_back(core)


@pytest.mark.parametrize("k", [1, 3])
def test_a_predicting_mtp_block_is_accepted_and_a_random_one_is_not(predicting_mtp, random_mtp, k):
    requests = [(f"r{i}", prompt(6 + i, 20 + i), greedy(24)) for i in range(2)]
    plain = run(make_core(predicting_mtp), requests)[0]
    good = make_core(predicting_mtp, speculative_config=mtp(k))
    assert run(good, requests)[0] == plain
    assert mean_accepted(good) > 0.9 * k, good.stats().extra["spec"]
    assert good.stats().extra["spec"]["accepted_per_pos"][k - 1] > 0
    bad = make_core(random_mtp, speculative_config=mtp(k))
    run(bad, requests)
    assert mean_accepted(bad) < 0.3, bad.stats().extra["spec"]
    assert_all_back(good)


def test_unchanged_under_chunked_prefill_and_preemption(predicting_mtp):
    requests = [(f"p{i}", prompt(14 + 3 * i, 30 + i), greedy(24)) for i in range(4)]
    options = dict(max_num_batched_tokens=12, num_kv_blocks=20)  # 4 x 10-12 blocks at full length: some yield
    plain = run(make_core(predicting_mtp, **options), requests)[0]
    core = make_core(predicting_mtp, speculative_config=mtp(3), **options)
    assert run(core, requests)[0] == plain
    assert core.scheduler.num_preemptions > 0 and mean_accepted(core) > 1.0
    assert_all_back(core)


def test_mtp_needs_the_checkpoints_mtp_block(tmp_path):
    partial = make_qwen35_checkpoint(tmp_path / "partial")  # fc and norm only
    with pytest.raises(ValueError, match="method mtp: the checkpoint lacks mtp.layers.0"):
        make_core(partial, speculative_config=mtp())


def test_the_mtp_layer_reads_each_accepted_tokens_target_hidden_state(random_mtp):
    """Every catch-up row the MTP layer computes is (token i + 1, the target's final hidden state at i) at position
    i, against one plain prefill of the whole sequence, through rejections (the hybrid recomputes accepted
    tokens) and chunked prefill; together the rows cover every position once the request has drafted."""
    core = make_core(random_mtp, speculative_config=mtp(3), max_num_batched_tokens=8)
    proposer = core.spec.draft
    rows: dict[int, tuple[int, object]] = {}
    first = [False]
    real_run, real_propose = proposer._run, proposer.propose_batch

    def propose_batch(reqs, ks):
        first[0] = True
        return real_propose(reqs, ks)

    def run_head(seqs, hidden):
        if first[0]:  # the catch-up forward; the further drafts' feed the head's own output back
            (seq,) = seqs
            for j, token in enumerate(seq.token_ids):
                rows[seq.num_computed_tokens + j] = (token, hidden[j].clone())
        first[0] = False
        return real_run(seqs, hidden)

    proposer._run, proposer.propose_batch = run_head, propose_batch
    ids = prompt(11, 3)
    out = run(core, [("r", ids, greedy(30))])[0]["r"]
    stats = core.stats().extra["spec"]
    assert stats["num_drafts"] > 5 and stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    full = ids + out
    reference = make_core(random_mtp)
    reference.runner.keep_hidden = True
    reference.add_request("ref", full, greedy(1))
    chunks = []
    while reference.has_unfinished:  # a hybrid's prefill may stop at a block edge (its saved state)
        reference.step()
        chunks.append(reference.runner.last_hidden)
    hidden = torch.cat(chunks)
    assert hidden.shape[0] == len(full)
    assert sorted(rows) == list(range(max(rows) + 1)) and max(rows) >= len(full) - 6  # no drafts at the end
    for position, (token, row) in rows.items():
        assert token == full[position + 1], position
        assert (row - hidden[position]).abs().max() < 1e-3, position


def test_a_spawned_core_drafting_with_mtp_answers_as_the_plain_server(tmp_path):
    """Through real sockets, the core in its own process: the same completion and usage as a plain server, with
    the MTP drafts accepted (vLLM's spec_decode counters on /metrics)."""
    import shutil
    import urllib.request

    from rawserve.config import EngineConfig, ServerConfig
    from rawserve.demo_model import TOKENIZER_VOCAB_SIZE, ensure_demo_model
    from tests.api.test_openai_server import ServerThread, wait_idle

    # The demo model's tokenizer (2,000 tokens): a server starts in a fraction of a 151k-token vocabulary's time
    directory = make_qwen35_checkpoint(tmp_path / "m", initializer_range=0.1, bigram=True, tied=False,
                                       vocab_size=TOKENIZER_VOCAB_SIZE, max_position_embeddings=256)
    add_mtp_block(directory, predicts_next=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, directory / name)
    common = dict(model_dir=str(directory), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256)
    plain = ServerThread(EngineConfig(**common), ServerConfig(port=0, served_model_name="m", api_key=[]))
    spec = ServerThread(EngineConfig(**common, speculative_config=mtp(3)),
                        ServerConfig(port=0, served_model_name="m", api_key=[], engine_mode="process",
                                     metrics_compat="vllm"))
    try:
        def complete(server) -> dict:
            body = {"model": "m", "prompt": "the cat sat on", "temperature": 0, "max_tokens": 24}
            request = urllib.request.Request(server.base + "/v1/completions", json.dumps(body).encode(),
                                             {"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())

        a, b = complete(plain), complete(spec)
        assert b["choices"][0]["text"] == a["choices"][0]["text"] and b["usage"] == a["usage"]
        assert a["usage"]["completion_tokens"] == 24
        wait_idle(spec)

        def accepted() -> tuple[float, str]:
            with urllib.request.urlopen(spec.base + "/metrics", timeout=30) as response:
                metrics = response.read().decode()
            lines = [line for line in metrics.splitlines()
                     if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
            return (float(lines[0].split()[-1]) if lines else -1.0), metrics

        # The core sends its counters after the outputs (every 0.25 s while busy, and once idle): a request done
        # within 0.25 s has them on their way when its answer comes, and the stats from before it already read idle
        deadline = time.monotonic() + 10
        count, metrics = accepted()
        while count < 15 and time.monotonic() < deadline:
            time.sleep(0.05)
            count, metrics = accepted()
        assert count >= 15, [line for line in metrics.splitlines() if "spec_decode" in line]
    finally:
        plain.stop()
        spec.stop()


def test_the_mtp_kv_pool_comes_out_of_the_kv_budget(random_mtp):
    """--kv-cache-memory-gb buys blocks of the target's KV and the MTP layer's together (its pool has a block for
    each of the target's): fewer blocks than without, and both pools inside the budget."""
    budget_gb = 0.0018  # below what 2 x 1024 tokens can use: the budget decides
    options = dict(num_kv_blocks=None, kv_cache_memory_gb=budget_gb, max_num_seqs=2, max_model_len=1024)
    plain = make_core(random_mtp, **options)
    core = make_core(random_mtp, speculative_config=mtp(), **options)
    mtp_pool = sum(t.numel() * t.element_size() for t in core.spec.draft.kv_cache)
    target_pool = core.num_blocks * core.runner.block_bytes
    states = sum(t.numel() * t.element_size() for pair in core.runner.states for t in pair)
    assert core.num_blocks < plain.num_blocks
    assert target_pool + mtp_pool + states <= budget_gb * (1 << 30)
    assert mtp_pool == core.num_blocks * core.runner.block_bytes // core.runner.num_kv_layers  # one layer's
