"""A vision tower's forward spread over engine steps (multimodal/encode_job.py, encode_queue.py): the sliced
encoding equals the one-shot forward; greedy ids still equal transformers' when a tiny budget spreads an image
over many steps; a decoding text stream gets a token every step while an image encodes; an image's tokens never
run before its encoding is complete; the slice takes what the step's budget leaves, and all of an image when
nothing else runs; one job in flight; abort, preemption and a cache hit leave no job, no held encoding, no block."""
from __future__ import annotations

import pytest
import torch

from rawserve.engine.loader import VisionConfig
from rawserve.engine.models.vision import VisionTower
from rawserve.engine.multimodal.encode_job import EncodeJob, encode_flops
from tests.checkpoints import make_qwen3_vl_checkpoint, make_qwen35_vl_checkpoint
from tests.engine.stepping import greedy, step_to_end
from tests.engine.test_vision_engine import Model, picture

pytest.importorskip("PIL.Image")

TOWER = VisionConfig(depth=3, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=16,
                     hidden_act="gelu_pytorch_tanh", rope_theta=10000.0, image_token_id=7, deepstack_indexes=(0, 2))


@pytest.fixture(scope="module")
def tower() -> VisionTower:
    tower = VisionTower(TOWER, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in tower.parameters():
            param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return tower.eval()


@pytest.mark.parametrize("num_slices", [1, 7, 200])
def test_sliced_encoding_equals_the_one_shot_forward(tower, num_slices):
    grid = (6, 10)
    patches = torch.randn(60, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(1))
    embeds, deepstack = tower(patches, [grid])
    job = EncodeJob(tower, patches, grid)
    share = job.remaining_flops / num_slices  # the patch embedding ran as the job was made
    calls = 1
    while not job.advance(share):
        calls += 1
    # each call ran its share, no more, but at least one merge group's rows (4 of 60, in 2 passes a block)
    assert min(num_slices, 2 * TOWER.depth * 60 // 4) <= calls <= max(num_slices + 1, 2 * TOWER.depth * 60 // 4)
    result = job.result()
    torch.testing.assert_close(result.embeds, embeds, rtol=1e-5, atol=1e-6)
    assert len(result.deepstack) == len(deepstack) == 2
    for ours, theirs in zip(result.deepstack, deepstack):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert job.flops_spent == pytest.approx(job.total_flops) == pytest.approx(encode_flops(TOWER, 60))
    assert job.x is None and job.q is None  # the activations went with the last slice


@pytest.fixture(scope="module")
def qwen3vl(tmp_path_factory):
    return Model(make_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3vl"), initializer_range=0.3))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return Model(make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35vl")))


class Watch:
    """After each step: whether a job was in flight, how many, and which requests got a token."""

    def __init__(self, core) -> None:
        self.jobs: list[int] = []
        self.wanted: list[int] = []
        self.outputs: list[set[str]] = []
        step = core.step

        def watched():
            outputs = step()
            self.jobs.append(core.multimodal.encodes.num_jobs)
            self.wanted.append(core.multimodal.encodes.num_wanted)
            self.outputs.append({out.request_id for out in outputs if out.new_token_ids})
            return outputs

        core.step = watched


def test_a_tiny_budget_spreads_an_image_over_many_steps_with_transformers_ids(qwen3vl):
    ids, features, out = qwen3vl.prompt([picture(120, 120, 3)], seed=11)
    text_ids, _, _ = qwen3vl.prompt([], seed=12)
    core = qwen3vl.core(max_num_batched_tokens=7, enable_prefix_caching=False)
    watch = Watch(core)
    core.add_request("img", ids, greedy(), features=features)
    core.add_request("text", text_ids, greedy(max_tokens=40))
    held_while_decoding = []

    def on_step(core) -> None:
        req = core.requests.get("img")
        if req is not None and req.num_output_tokens >= 2:  # its prompt passed the image a step ago
            held_while_decoding.append(core.multimodal.encodes.num_held)

    tokens, _ = step_to_end(core, on_step=on_step)
    assert sum(watch.jobs) >= 5  # the image's encoding spanned many steps
    assert tokens["img"] == qwen3vl.reference(ids, out)
    stats = core.stats().extra
    assert stats["mm_images_encoded"] == 1 and stats["mm_encoder_seconds"] > stats["mm_preprocess_seconds"] > 0
    assert held_while_decoding and not any(held_while_decoding)  # let go once passed, not at the request's end


def test_a_decoding_stream_gets_a_token_every_step_while_an_image_encodes(qwen35):
    ids, features, _ = qwen35.prompt([picture(180, 150, 4)], seed=13)
    core = qwen35.core(max_num_batched_tokens=4)
    core.add_request("text", qwen35.prompt([], seed=14)[0], greedy(max_tokens=200))
    while not core.requests["text"].num_output_tokens:
        core.step()
    watch = Watch(core)
    core.add_request("img", ids, greedy(max_tokens=1), features=features)
    image = features.images[0]
    placeholders_run_early = []
    schedule = core.scheduler.schedule

    def checked():
        scheduled = schedule()
        for req, num_new in scheduled:  # no chunk reaches an image whose encoding is under way
            if req.rid == "img" and req.num_computed_tokens + num_new > image.offset:
                placeholders_run_early.append(core.multimodal.encodes.num_wanted)
        return scheduled

    core.scheduler.schedule = checked
    encodes = core.multimodal.encodes
    slices = []  # (FLOPs charged, FLOPs run) per step with a job under way
    advance = encodes.advance

    def measured() -> None:
        planned, job = encodes._planned_flops, next(iter(encodes._wanted.values())).job if encodes.num_wanted else None
        before = job.flops_spent if job is not None else 0.0
        advance()
        if job is not None and encodes.num_jobs:
            slices.append((planned, job.flops_spent - before))

    encodes.advance = measured
    while "img" in core.requests:
        core.step()
    encoding_steps = [i for i, jobs in enumerate(watch.jobs) if jobs]
    assert len(encoding_steps) >= 3
    # each slice ran about the FLOPs of the 3 tokens the decode left: within one slice (a merge group's rows)
    assert slices and all(planned == 3 * encodes.text_flops_per_token for planned, _ in slices)
    assert all(abs(ran - planned) < 0.5 * planned for planned, ran in slices)
    assert all("text" in watch.outputs[i] for i in range(len(watch.outputs)))  # a token every step, throughout
    assert placeholders_run_early and not any(placeholders_run_early)


def test_a_lone_image_takes_the_whole_budget_a_step_not_its_whole_forward(qwen35):
    ids, features, out = qwen35.prompt([picture(180, 150, 4)], seed=13)
    core = qwen35.core(max_num_batched_tokens=4, enable_prefix_caching=False)
    encodes = core.multimodal.encodes
    planned = []  # FLOPs charged to each step's slice while the image waits for its encoding
    advance = encodes.advance

    def measured() -> None:
        if encodes.num_wanted:
            planned.append(encodes._planned_flops)
        advance()

    encodes.advance = measured
    watch = Watch(core)
    core.add_request("img", ids, greedy(max_tokens=2), features=features)
    tokens, _ = step_to_end(core)
    # nothing else runs, so each slice gets the step's whole budget (4 tokens' worth; the first, what the text
    # before the image leaves), but no more: a request arriving meanwhile waits one slice, not the whole forward
    full = 4 * encodes.text_flops_per_token
    assert len(planned) >= 3 and all(p == full for p in planned[1:-1]) and all(0 < p <= full for p in planned)
    assert sum(watch.jobs) >= 2 and tokens["img"] == qwen35.reference(ids, out, max_tokens=2)


def test_one_job_in_flight_and_a_cache_hit_needs_none(qwen35):
    a = qwen35.prompt([picture(180, 150, 5)], seed=15)
    b = qwen35.prompt([picture(150, 180, 6)], seed=16)
    core = qwen35.core(max_num_batched_tokens=40, enable_prefix_caching=False)
    encodes = core.multimodal.encodes
    seen = []  # (images wanted, jobs) as each step's slice starts and ends
    advance = encodes.advance

    def watched() -> None:
        seen.append((encodes.num_wanted, encodes.num_jobs))
        advance()
        seen.append((encodes.num_wanted, encodes.num_jobs))

    encodes.advance = watched
    core.add_request("a", a[0], greedy(max_tokens=2), features=a[1])
    core.add_request("b", b[0], greedy(max_tokens=2), features=b[1])
    first, _ = step_to_end(core)
    assert max(wanted for wanted, _ in seen) == 2 and max(jobs for _, jobs in seen) == 1
    assert core.stats().extra["mm_images_encoded"] == 2
    watch = Watch(core)
    core.add_request("again", a[0], greedy(max_tokens=2), features=a[1])
    again, _ = step_to_end(core)
    assert not any(watch.wanted) and core.stats().extra["mm_images_encoded"] == 2
    assert core.stats().extra["mm_encoder_cache_hits"] == 1
    assert again["again"] == first["a"]


def _started(core, rid: str, ids, features):
    """Add an image request beside a decoding stream and step until its image's job is under way."""
    core.add_request(rid, ids, greedy(max_tokens=2), features=features)
    for _ in range(20):
        core.step()
        if core.multimodal.encodes.num_jobs:
            return
    raise AssertionError("the image's encoding never started")


def _assert_nothing_left(core) -> None:
    encodes = core.multimodal.encodes
    assert (encodes.num_wanted, encodes.num_jobs, encodes.num_held) == (0, 0, 0)
    assert not encodes._holding
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


def test_abort_mid_encoding_drops_the_job_and_leaks_nothing(qwen35):
    ids, features, _ = qwen35.prompt([picture(180, 150, 4)], seed=13)
    core = qwen35.core(max_num_batched_tokens=8, enable_prefix_caching=False)
    core.add_request("text", qwen35.prompt([], seed=14)[0], greedy(max_tokens=100))
    _started(core, "img", ids, features)
    core.abort_request("img")
    assert core.multimodal.encodes.num_jobs == 0
    core.abort_request("text")
    _assert_nothing_left(core)
    assert core.stats().extra["mm_images_encoded"] == 0


def test_a_job_two_requests_wait_on_outlives_one_abort(qwen35):
    ids, features, out = qwen35.prompt([picture(180, 150, 4)], seed=13)
    core = qwen35.core(max_num_batched_tokens=8, enable_prefix_caching=False)
    core.add_request("text", qwen35.prompt([], seed=14)[0], greedy(max_tokens=60))
    core.add_request("other", ids, greedy(), features=features)
    _started(core, "img", ids, features)
    core.abort_request("img")
    assert core.multimodal.encodes.num_jobs == 1  # "other" still waits on it
    tokens, _ = step_to_end(core)
    assert tokens["other"] == qwen35.reference(ids, out)
    assert core.stats().extra["mm_images_encoded"] == 1
    _assert_nothing_left(core)


def test_preemption_mid_encoding_drops_the_job_and_the_request_resumes(qwen35):
    ids, features, out = qwen35.prompt([picture(180, 150, 4)], seed=13)
    core = qwen35.core(max_num_batched_tokens=8, enable_prefix_caching=False)
    core.add_request("text", qwen35.prompt([], seed=14)[0], greedy(max_tokens=60))
    _started(core, "img", ids, features)
    core.scheduler._preempt(core.requests["img"])  # as running out of KV blocks would
    assert core.multimodal.encodes.num_wanted == core.multimodal.encodes.num_jobs == 0
    tokens, _ = step_to_end(core)
    assert tokens["img"] == qwen35.reference(ids, out, max_tokens=2)
    _assert_nothing_left(core)
