"""A constrained row whose mask is not built when its logits are keeps them and sits the next steps out (KV and
place kept) while the guided helper thread builds it, then samples; unconstrained rows decode every step
meanwhile. Outputs equal the blocking path's; aborts, preemption and failing builds mid-way leave nothing behind.

Slowness is faked by timing alone: GrammarRuntime.build sleeps before building the real mask, for grammars
whose key starts "slow".
"""
from __future__ import annotations

import time

import pytest

from rawserve.config import EngineConfig
from rawserve.engine.core import EngineCore
from rawserve.engine.guided.grammar import Grammar
from rawserve.engine.guided.matcher import GrammarRuntime
from rawserve.engine.guided.nfa import compile_grammar
from rawserve.engine.guided.regex import parse_regex
from rawserve.engine.types import SamplingParams
from rawserve.text.tokenizer import Tokenizer

DELAY_S = 0.25


@pytest.fixture(scope="module")
def tok(large_vocab_model_dir):
    return Tokenizer.from_dir(large_vocab_model_dir)


@pytest.fixture
def slow_masks(monkeypatch):
    """Every mask of a grammar keyed "slow…" takes DELAY_S more to build; "bad…" grammars' builds raise."""
    real = GrammarRuntime.build

    def build(self, cid):
        if self.key.startswith("slow") and not self.has_mask(cid):
            time.sleep(DELAY_S)
        if self.key.startswith("bad"):
            raise RuntimeError("this grammar's mask cannot be built")
        return real(self, cid)

    monkeypatch.setattr(GrammarRuntime, "build", build)


def make_core(model_dir) -> EngineCore:
    core = EngineCore(EngineConfig(model_dir=str(model_dir), device="cpu", num_kv_blocks=256, max_model_len=512))
    core.guided_registry().wait_idle(30)  # the vocabulary's lazy parts: start-up, not a step's cost
    return core


def digits(key: str):
    return compile_grammar(Grammar({"root": parse_regex(r"[0-9]{6}")}), key)


def run_steps(core: EngineCore, limit_s: float = 60.0) -> tuple[list[set[str]], dict[str, list[int]], dict[str, str]]:
    """Step until done -> (the rids that got a token, per step), tokens per rid, finish reason per rid."""
    per_step, tokens, reasons = [], {}, {}
    deadline = time.monotonic() + limit_s
    while core.has_unfinished:
        assert time.monotonic() < deadline, "the engine never finished"
        outs = core.step()
        per_step.append({o.request_id for o in outs if o.new_token_ids})
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
    return per_step, tokens, reasons


def test_a_row_whose_mask_is_slow_sits_out_while_an_unconstrained_row_decodes_every_step(
        large_vocab_model_dir, tok, slow_masks):
    core = make_core(large_vocab_model_dir)
    prompt = tok.encode("Six digits:")
    core.add_request("free", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    core.add_request("slow", prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=5, guided=digits("slow-a")))
    per_step, tokens, reasons = run_steps(core)
    free_steps = [i for i, rids in enumerate(per_step) if "free" in rids]
    # the unconstrained row got a token in every step from its first to its last: never held up
    assert free_steps == list(range(free_steps[0], free_steps[-1] + 1)) and len(free_steps) == 30
    # while the constrained one sat some of those steps out, and still ended as its grammar says
    assert any("free" in rids and "slow" not in rids for rids in per_step[free_steps[0] + 1:])
    assert core._guided.num_sat_out > 0
    assert reasons["slow"] == "stop" and tok.decode(tokens["slow"]).isdigit() and len(tok.decode(tokens["slow"])) == 6


def test_a_row_alone_waits_for_its_mask_without_spinning(large_vocab_model_dir, tok, slow_masks):
    core = make_core(large_vocab_model_dir)
    core.add_request("slow", tok.encode("Digits:"), SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                                                                   guided=digits("slow-b")))
    per_step, tokens, reasons = run_steps(core)
    empty = sum(1 for rids in per_step if not rids)
    built = core._guided._worker.num_built
    # every empty step blocked on the helper (wait_for_masks: at most 50 ms each), so the DELAY_S builds cost a
    # bounded number of them; a spin would step thousands of times
    assert built >= 2 and empty <= built * (DELAY_S / 0.05 + 3)
    assert core._guided.idle_wait_s >= 0.5 * DELAY_S
    assert reasons["slow"] == "stop" and len(tok.decode(tokens["slow"])) == 6


def test_outputs_with_slow_masks_equal_the_blocking_path(large_vocab_model_dir, tok, monkeypatch):
    schemas = [r"[0-9]{6}", r"(yes|no|maybe) [a-z]{2,8}\.", r"\{\"k\": [0-9]{1,4}\}"]
    prompt = tok.encode("Answer:")

    def batch(core: EngineCore, tag: str) -> dict[str, tuple[list[int], str]]:
        for i, pattern in enumerate(schemas):
            compiled = compile_grammar(Grammar({"root": parse_regex(pattern)}), f"{tag}-{i}")
            core.add_request(f"g{i}", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=11 + i,
                                                             guided=compiled))
        core.add_request("free", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True))
        _, tokens, reasons = run_steps(core)
        return {rid: (tokens[rid], reasons[rid]) for rid in tokens}

    blocking = make_core(large_vocab_model_dir)
    # the blocking path (as with speculative decoding): every row samples in its step, which waits for its mask
    blocking._deferred, blocking.scheduler.ready = None, None
    expected = batch(blocking, "fast")
    assert blocking._guided.num_sat_out == 0

    real = GrammarRuntime.build

    def slow_build(self, cid):
        if not self.has_mask(cid):
            time.sleep(0.05)
        return real(self, cid)

    monkeypatch.setattr(GrammarRuntime, "build", slow_build)
    sitting = make_core(large_vocab_model_dir)
    got = batch(sitting, "slow")
    assert sitting._guided.num_sat_out > 0
    assert got == expected


def test_an_abort_while_its_mask_builds_leaves_nothing_behind(large_vocab_model_dir, tok, slow_masks):
    core = make_core(large_vocab_model_dir)
    registry = core._guided
    prompt = tok.encode("Digits:")
    core.add_request("free", prompt, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    for name in ("slow-c", "slow-d"):
        core.add_request(name, prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=1, guided=digits(name)))
    worker = registry._worker
    deadline = time.monotonic() + 30
    num_free = 0
    while True:  # one slow row's mask under way on the helper, the other's queued behind it
        building = worker._building
        if building is not None:
            queued = [r for r in ("slow-c", "slow-d") if r in core.requests and worker.is_pending(core.requests[r].guided)
                      and core.requests[r].guided is not building]
            if queued:
                break
        assert time.monotonic() < deadline
        num_free += sum(len(o.new_token_ids) for o in core.step() if o.request_id == "free")
    num_queued = worker.num_queued
    assert core.abort_request(queued[0]) is not None  # its queued mask is dropped
    assert worker.num_queued == num_queued - 1
    built = {"slow-c", "slow-d"} - {queued[0]}
    assert core.abort_request(built.pop()) is not None  # its mask finishes on the helper and is dropped
    _, tokens, reasons = run_steps(core)
    assert reasons == {"free": "length"} and num_free + len(tokens["free"]) == 400
    assert registry.wait_idle(10) and worker.num_queued == 0 and not core.requests


def test_a_mask_that_fails_on_the_helper_fails_its_request_alone(large_vocab_model_dir, tok, slow_masks):
    core = make_core(large_vocab_model_dir)
    prompt = tok.encode("Digits:")
    core.add_request("bad", prompt, SamplingParams(max_tokens=10, temperature=0, guided=digits("bad-a")))
    core.add_request("good", prompt, SamplingParams(max_tokens=10, temperature=0, guided=digits("good-a")))
    core.add_request("free", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    _, tokens, reasons = run_steps(core)
    assert reasons == {"bad": "error", "good": "stop", "free": "length"}
    assert len(tok.decode(tokens["good"])) == 6 and not tokens["bad"]


def test_rows_waiting_for_slow_masks_survive_preemption_with_the_same_outputs(large_vocab_model_dir, tok,
                                                                               monkeypatch):
    """Rows holding a deferred sample can be preempted (their KV dropped): they compute their tokens again and
    sample the same position once; six rows share one grammar, so they also wait on each other's builds."""
    real = GrammarRuntime.build

    def slow_build(self, cid):
        if not self.has_mask(cid):
            time.sleep(0.02)
        return real(self, cid)

    monkeypatch.setattr(GrammarRuntime, "build", slow_build)
    prompt = tok.encode("Once upon a time there was a")

    def go(num_blocks: int, key: str) -> tuple[dict, int, int]:
        core = EngineCore(EngineConfig(model_dir=str(large_vocab_model_dir), device="cpu", block_size=4,
                                       num_kv_blocks=num_blocks, max_model_len=256))
        core.guided_registry().wait_idle(30)
        compiled = compile_grammar(Grammar({"root": parse_regex(r"[a-z ]{30,40}\.")}), key)
        for i in range(6):
            core.add_request(f"p{i}", prompt + [i + 100], SamplingParams(max_tokens=45, temperature=1.0, seed=i,
                                                                         guided=compiled))
        _, tokens, reasons = run_steps(core, limit_s=120)
        return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, core.scheduler.num_preemptions, \
            core._guided.num_sat_out

    big, _, _ = go(256, "slow-big")
    tight, preemptions, sat_out = go(22, "slow-tight")
    assert preemptions > 0 and sat_out > 0
    assert tight == big


def test_a_row_that_samples_before_and_after_the_forward_gets_one_output_with_both_tokens():
    from rawserve.engine.guided.deferred import merge_outputs
    from rawserve.engine.types import RequestOutput

    early = [RequestOutput("a", [5], logprobs=["la"], prompt_logprobs=[None]), RequestOutput("b", [7], finished=True,
                                                                                            finish_reason="stop")]
    later = [RequestOutput("c", [1]), RequestOutput("a", [6], logprobs=["lb"], num_output_tokens=2)]
    merged = merge_outputs(early, later)
    assert [(o.request_id, o.new_token_ids) for o in merged] == [("b", [7]), ("c", [1]), ("a", [5, 6])]
    assert merged[2].logprobs == ["la", "lb"] and merged[2].prompt_logprobs == [None]
    assert merged[2].num_output_tokens == 2 and merged[0].finished


def test_a_row_that_sits_out_hands_its_grammar_to_the_helper_before_the_step_ends(large_vocab_model_dir, tok):
    """split claims every constrained row's grammar; one whose rows all sit out goes back at once, so its mask
    builds while the step samples the others (and the row can make the next forward); a grammar a sampling row
    uses stays the step's until end_step, even for its other rows that sit out."""
    import torch

    from rawserve.engine.request import Request, RequestStatus

    core = make_core(large_vocab_model_dir)
    registry, worker = core._guided, core._guided._worker
    shared, alone = digits("hand-back-shared"), digits("hand-back-alone")
    ready, twin, late = registry.state_for(shared), registry.state_for(shared), registry.state_for(alone)
    assert registry.wait_idle(30) and ready.has_mask and late.has_mask
    seven = tok.encode("7", add_special_tokens=False)[0]
    late.advance(seven)  # configurations whose masks nobody built yet
    twin.advance(seven)
    assert not late.has_mask and not twin.has_mask
    reqs = []
    for name, state in (("ready", ready), ("twin", twin), ("late", late)):
        req = Request(name, tok.encode("Digits:"), SamplingParams(max_tokens=6))
        req.guided, req.status = state, RequestStatus.RUNNING
        reqs.append(req)
    rows, sampling = core._deferred.split(torch.zeros(3, core.vocab_size), reqs, registry)
    try:
        assert [r.rid for r in sampling] == ["ready"] and rows.shape[0] == 1
        assert core._deferred.holds(reqs[1]) and core._deferred.holds(reqs[2])
        worker.wait_until(lambda: late.has_mask, 10)  # built with the step still under way (no end_step yet)
        assert late.has_mask
        time.sleep(0.2)
        assert not twin.has_mask  # its grammar is the step's: "ready" samples with it
        registry.end_step()
        worker.wait_until(lambda: twin.has_mask, 10)
        assert twin.has_mask
    finally:
        registry.end_step()
        core.close()
