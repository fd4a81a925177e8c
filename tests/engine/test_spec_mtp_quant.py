"""Qwen3.5's MTP layer under --quantization int8/int4: its linears quantized as the target's, greedy output equal
to plain quantized decoding's, its drafts still accepted where the block predicts the target's next token.

Token-for-token equality is checked on the checkpoint whose mixers add nothing (bigram: the next token a function
of the last one), the one whose output no float noise in the hybrid's state path can move. On a random Qwen3.5,
quantized verification of any method (synthetic drafts all rejected included, so not the MTP layer's doing) can
part from plain quantized decoding at a near-tie: a drafted row runs the delta rule chunked where a plain decode
runs it step by step, and the quantized kernels' bf16 activations turn that 1e-7 difference into 1e-3. Dynamic
W8A8 (int8's kernel where the start-up probe finds it) also quantizes activations per tensor, so a row's logits
move with whatever shares its matmul (another request in plain decoding as much as a verified run): under it
the test checks quantized drafting, acceptance and no leak.
"""
from __future__ import annotations

import pytest

from rawserve.engine import quant
from tests.engine.test_qwen35_engine import greedy, make_core, prompt, run
from tests.engine.test_spec_mtp import mean_accepted, mtp, predicting_mtp, random_mtp  # noqa: F401 (fixtures)

REQUESTS = [(f"q{i}", prompt(6 + 5 * i, 40 + i), greedy(20)) for i in range(3)]


def assert_head_quantized(core, kernels: tuple[str, ...]) -> None:
    head = core.spec.draft.head
    # fc and the layer's four linears, quantized as the target's (every shape fits int4 at group 32 here)
    assert set(head.quant) == {"fc"} and set(head.layer.quant) == set(head.layer.linear_names)
    assert all(q.kernel in kernels for q in (*head.quant.values(), *head.layer.quant.values()))
    assert not head.packed and not head.layer.packed


@pytest.mark.parametrize("scheme, group, kernel", [("int8", 128, "int8"), ("int4", 32, "int4")])
def test_quantized_mtp_drafts_leave_quantized_greedy_output_unchanged(predicting_mtp, random_mtp,  # noqa: F811
                                                                        monkeypatch, scheme, group, kernel):
    monkeypatch.setattr(quant, "_probe_w8a8", lambda: None)  # a CPU without W8A8: weight-only int8
    options = dict(quantization=scheme, quantization_group_size=group)
    plain = run(make_core(predicting_mtp, **options), REQUESTS)[0]
    core = make_core(predicting_mtp, speculative_config=mtp(3), **options)
    assert_head_quantized(core, (kernel,))
    assert run(core, REQUESTS)[0] == plain
    assert mean_accepted(core) > 1.5, core.stats().extra["spec"]
    assert core.blocks.num_free_blocks == core.num_blocks
    # A random block on a random model: drafted, rarely accepted, every request to its length, nothing leaked
    core = make_core(random_mtp, speculative_config=mtp(3), **options)
    assert_head_quantized(core, (kernel,))
    assert all(len(ids) == 20 for ids in run(core, REQUESTS)[0].values())
    assert core.stats().extra["spec"]["num_drafts"] > 10
    assert core.blocks.num_free_blocks == core.num_blocks


def test_w8a8_mtp_drafts_are_quantized_and_accepted(predicting_mtp):  # noqa: F811
    if quant._probe_w8a8() is None:
        pytest.skip("no dynamic W8A8 on this CPU")
    core = make_core(predicting_mtp, speculative_config=mtp(3), quantization="int8")
    assert_head_quantized(core, ("w8a8",))
    out = run(core, REQUESTS)[0]
    assert all(len(ids) == 20 for ids in out.values())
    assert mean_accepted(core) > 1.5, core.stats().extra["spec"]
    assert core.blocks.num_free_blocks == core.num_blocks
