"""Qwen3.5's MTP layer on image requests: its rows sit at the target's M-RoPE positions (3-D inside an image, the
rope delta after it), so its drafts there are what a one-shot MTP forward at those positions gives; greedy output
with MTP drafting equals plain decoding's, beside a text request."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rawserve.engine.mm_inputs import ImageInput, MultiModalInputs
from rawserve.engine.multimodal.positions import mrope_positions, rope_delta
from rawserve.engine.step_plan import ForwardBatch, StepInput
from tests.checkpoints import hf_image_processor, make_qwen35_vl_checkpoint
from tests.engine.stepping import greedy, make_core, step_to_end
from tests.qwen35_checkpoints import add_mtp_block

Image = pytest.importorskip("PIL.Image")
BLOCK = 4
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "min_acceptance": 0, "disable_by_batch_size": 64})


@pytest.fixture(scope="module")
def vl_mtp(tmp_path_factory):
    return add_mtp_block(make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl-mtp")))


def image_prompt(directory, seed: int) -> tuple[list[int], MultiModalInputs]:
    """Text, a 64 x 96 noise picture (2 x 3 merged tokens: rope delta 3 - 6), text."""
    config = json.loads((directory / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (96, 64, 3), dtype=torch.uint8, generator=g)
    picture = Image.fromarray(noise.numpy())
    _, gh, gw = hf_image_processor(directory)(images=[picture], return_tensors="pt")["image_grid_thw"][0].tolist()
    ids = torch.randint(10, 5000, (5,), generator=g).tolist() + [config["vision_start_token_id"]]
    rgb = picture.tobytes()
    image = ImageInput(hashlib.sha256(rgb).digest(), picture.width, picture.height, rgb, gh * 16, gw * 16, len(ids),
                       gh * gw // 4)
    ids += [config["image_token_id"]] * image.num_tokens + [config["vision_end_token_id"]]
    return ids + torch.randint(10, 5000, (6,), generator=g).tolist(), MultiModalInputs((image,))


def run(core, requests) -> dict:
    for rid, ids, params, features in requests:
        core.add_request(rid, ids, params, features=features)
    return step_to_end(core)[0]


def test_greedy_with_mtp_on_an_image_request_equals_plain(vl_mtp):
    ids, features = image_prompt(vl_mtp, 1)
    assert rope_delta(features.images, 16, 2) != 0
    requests = [("img", ids, greedy(16), features), ("text", ids[:5] + [11, 12, 13], greedy(12), None)]
    plain = run(make_core(vl_mtp, BLOCK), requests)
    core = make_core(vl_mtp, BLOCK, speculative_config=MTP)
    assert run(core, requests) == plain
    stats = core.stats().extra["spec"]
    assert stats["num_drafts"] > 5
    assert core.blocks.num_free_blocks == core.num_blocks


def test_mtp_rows_of_an_image_request_use_the_targets_mrope_positions(vl_mtp):
    """Every MTP output the proposer computes (its catch-up rows' last, which gives the first draft) equals a
    one-shot MTP forward over the whole sequence at 3-D positions, from the target's hidden states of one plain
    prefill: at 1-D positions the rows past the image would turn by the wrong angles."""
    ids, features = image_prompt(vl_mtp, 2)
    core = make_core(vl_mtp, BLOCK, speculative_config=MTP, max_num_batched_tokens=8)  # chunked through the image
    proposer = core.spec.draft
    outputs: dict[int, tuple[torch.Tensor, int]] = {}  # MTP row position -> (its output, the draft it gave)
    real_run, real_propose = proposer._run, proposer.propose_batch
    first = [False]

    def propose_batch(reqs, ks):
        first[0] = True
        return real_propose(reqs, ks)

    def run_head(seqs, hidden):
        tokens, out = real_run(seqs, hidden)
        if first[0]:  # the catch-up forward; the further drafts' feed the head's own output back
            for seq, token, row in zip(seqs, tokens, out):
                outputs[seq.num_computed_tokens + len(seq.token_ids) - 1] = (row.clone(), token)
        first[0] = False
        return tokens, out

    proposer._run, proposer.propose_batch = run_head, propose_batch
    out = run(core, [("r", ids, greedy(12), features)])["r"]
    full = ids + out
    assert outputs and min(outputs) < len(ids) + 3

    reference = make_core(vl_mtp, BLOCK, num_kv_blocks=64)
    reference.runner.keep_hidden = True
    reference.add_request("ref", full, greedy(1), features=features)
    chunks = []
    while reference.has_unfinished:
        reference.step()
        chunks.append(reference.runner.last_hidden)
    hidden = torch.cat(chunks)[:len(full) - 1]  # rows 0 .. n - 2: (token i + 1, the target's hidden state at i)
    n = len(full) - 1
    runner = core.runner
    blocks = list(range(-(-n // BLOCK)))
    batch = ForwardBatch.last_tokens([StepInput(full[1:], 0, blocks)])
    kv = tuple(torch.zeros_like(t) for t in proposer.kv_cache)
    with torch.inference_mode():
        input_ids, _, meta, _ = runner.step_metadata(batch)
        positions = mrope_positions(features.images, 0, n, 16, 2)
        expected = proposer.head(input_ids, positions, hidden, kv, meta)
        drafts = runner.model.compute_logits(expected).argmax(dim=-1).tolist()
    past_image = [p for p in outputs if p >= features.images[0].offset + features.images[0].num_tokens]
    assert past_image
    for position, (row, token) in outputs.items():
        assert (row - expected[position]).abs().max() < 2e-3, position
        assert token == drafts[position], position
