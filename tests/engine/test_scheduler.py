"""Scheduler without a model: priority order, token budget, chunked prefill, preemption, prefix hits, no leaks.

`advance` plays the core's part after a step (mark tokens computed, append a token where a chunk reached the
end); the scheduler and the block manager are the real ones.
"""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from rawserve.engine.kv_cache import KVCacheManager
from rawserve.engine.request import Request, RequestStatus
from rawserve.engine.scheduler import Scheduler
from rawserve.engine.types import SamplingParams

_arrivals = itertools.count()


def make(rid, prompt_len=4, max_tokens=4, priority=0, first_token=10, block_size=4, salt=None):
    req = Request(rid, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens),
                  priority=priority, arrival=next(_arrivals), cache_salt=salt)
    req.update_block_hashes(block_size)
    return req


def advance(sched: Scheduler, plan, token=7):
    """The core's bookkeeping after a step; returns the requests that finished."""
    kv = sched.kv
    done = []
    for req, n in plan:
        req.num_computed_tokens += n
        req.num_published_blocks = kv.publish_full_blocks(req.block_ids, req.block_hashes, req.num_published_blocks,
                                                          req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(token)
            req.num_output_tokens += 1
            req.update_block_hashes(kv.block_size)
            if req.num_output_tokens >= req.params.max_tokens:
                sched.finish(req, "length")
                done.append(req)
    return done


def scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, caching=True):
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget)


def run_to_completion(sched, max_steps=10_000, on_plan=None):
    order = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return order
        plan = sched.schedule()
        assert plan, "unfinished work but nothing scheduled: deadlock"
        if on_plan:
            on_plan(plan)
        order += [r.rid for r in advance(sched, plan)]
    raise AssertionError("did not finish")


def test_waiting_queue_runs_lower_priority_value_first_then_arrival():
    sched = scheduler(max_num_seqs=1)
    for rid, prio in [("late-low", 5), ("a-high", 0), ("b-high", 0), ("mid", 2)]:
        sched.add(make(rid, priority=prio))
    assert run_to_completion(sched) == ["a-high", "b-high", "mid", "late-low"]


def test_token_budget_and_max_num_seqs_hold_every_step():
    sched = scheduler(budget=10, max_num_seqs=3)
    for i in range(6):
        sched.add(make(f"r{i}", prompt_len=7, max_tokens=3))

    def check(plan):
        assert sum(n for _, n in plan) <= 10
        assert len(plan) <= 3 and sched.num_running <= 3

    run_to_completion(sched, on_plan=check)


def test_long_prompt_is_chunked_and_running_decodes_are_never_starved():
    sched = scheduler(budget=8, num_blocks=64)
    decoders = [make(f"d{i}", prompt_len=2, max_tokens=30) for i in range(3)]
    for d in decoders:
        sched.add(d)
    advance(sched, sched.schedule())  # all three prefilled, now decoding
    long = make("long", prompt_len=50, max_tokens=1)
    sched.add(long)
    chunks = []
    while long.status is not RequestStatus.FINISHED:
        plan = dict(sched.schedule())
        assert all(plan.get(d) == 1 for d in decoders), "a decode was starved by the prefill"
        chunks.append(plan.get(long, 0))
        advance(sched, list(plan.items()))
    assert sum(chunks) == 50 and max(chunks) == 5  # 8 tokens of budget minus 3 decodes, every step


def test_preemption_picks_lowest_priority_latest_and_it_resumes_with_its_tokens():
    # 6 blocks of 4: three requests of 8 prompt tokens take 2 blocks each; the first decode needs a 3rd block.
    sched = scheduler(num_blocks=6, block_size=4, budget=64)
    a, b, c = make("a", 8, 4, first_token=10), make("b", 8, 4, first_token=30), make("c", 8, 4, first_token=50)
    b.priority = -1  # b outranks a despite arriving later; c is last and lowest
    for r in (a, b, c):
        sched.add(r)
    advance(sched, sched.schedule())
    assert all(r.num_output_tokens == 1 for r in (a, b, c))
    plan = dict(sched.schedule())
    assert c.status is RequestStatus.PREEMPTED and c not in plan
    assert sched.num_preemptions == 1
    assert c.token_ids == list(range(50, 58)) + [7]  # its output so far is kept
    assert c.num_computed_tokens == 0 and c.block_ids == []
    advance(sched, list(plan.items()))
    order = run_to_completion(sched)
    assert order[-1] == "c" and c.num_output_tokens == 4
    assert sched.kv.num_free_blocks == 6


def test_no_admission_in_a_step_that_preempted():
    sched = scheduler(num_blocks=4, block_size=4, budget=64, max_num_seqs=8)
    a, b = make("a", 8, 8), make("b", 8, 8, first_token=40)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    sched.add(make("newcomer", 1, 1, first_token=90))
    plan = dict(sched.schedule())  # a needs a 3rd block: b is preempted
    assert b.status is RequestStatus.PREEMPTED
    assert [r.rid for r in plan] == ["a"]


def test_prefix_hit_sets_num_cached_tokens_and_leaves_the_last_token_to_compute():
    sched = scheduler(block_size=4)
    first = make("first", prompt_len=12, max_tokens=1)
    sched.add(first)
    run_to_completion(sched)
    same = make("same", prompt_len=12, max_tokens=1)  # whole prompt cached: recompute its last block
    longer = make("longer", prompt_len=14, max_tokens=1)
    sched.add(same)
    sched.add(longer)
    plan = dict(sched.schedule())
    assert same.num_cached_tokens == 8 and plan[same] == 4
    assert longer.num_cached_tokens == 12 and plan[longer] == 2
    assert sched.kv.prefix_cache_hits == 20 and sched.kv.prefix_cache_queries == 12 + 12 + 14


def test_a_prompt_another_request_is_prefilling_waits_and_continues_from_its_cached_prefix():
    sched = scheduler(block_size=4, budget=14)
    other = make("other", prompt_len=6, max_tokens=2, first_token=500)
    first, same = make("first", prompt_len=14, max_tokens=2), make("same", prompt_len=14, max_tokens=2)
    for req in (other, first, same):
        sched.add(req)
    plan = dict(sched.schedule())
    assert plan == {other: 6, first: 8}  # "same" would compute the blocks "first" is computing
    advance(sched, list(plan.items()))
    plan = dict(sched.schedule())
    assert same not in plan and plan[first] == 6  # "first" was still prefilling when the queue was read
    advance(sched, list(plan.items()))
    plan = dict(sched.schedule())
    assert same.num_cached_tokens == 12 and plan[same] == 2  # only its last 2 tokens are computed
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 64 and set(sched.kv.ref_counts) == {0}


def test_a_request_waiting_on_a_prefill_that_is_aborted_runs_on_from_what_it_published():
    sched = scheduler(block_size=4, budget=8)
    first, same = make("first", prompt_len=14, max_tokens=2), make("same", prompt_len=14, max_tokens=2)
    sched.add(first)
    sched.add(same)
    advance(sched, sched.schedule())
    sched.finish(first, "abort")
    plan = dict(sched.schedule())
    assert plan[same] == 6 and same.num_cached_tokens == 8  # the two blocks "first" published before its abort
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 64 and set(sched.kv.ref_counts) == {0}


def test_salted_request_does_not_hit_unsalted_cache():
    sched = scheduler(block_size=4)
    sched.add(make("plain", prompt_len=12, max_tokens=1))
    run_to_completion(sched)
    salted = make("salted", prompt_len=12, max_tokens=1, salt="tenant")
    sched.add(salted)
    sched.schedule()
    assert salted.num_cached_tokens == 0


def test_finish_of_waiting_and_running_requests_frees_everything():
    sched = scheduler(num_blocks=8, budget=6, max_num_seqs=1)
    running, waiting = make("run", 10, 5), make("wait", 4, 5)
    sched.add(running)
    sched.add(waiting)
    advance(sched, sched.schedule())  # mid-prefill: 6 of 10
    assert running.status is RequestStatus.RUNNING and running.block_ids
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert not sched.has_unfinished
    assert sched.kv.num_free_blocks == 8 and set(sched.kv.ref_counts) == {0}


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=10),
    num_blocks=st.integers(14, 40),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    shared_prefix=st.booleans(),
)
def test_any_workload_that_fits_finishes_without_leaks(lens, num_blocks, budget, max_num_seqs, shared_prefix):
    block_size = 4
    sched = scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, budget=budget)
    reqs = []
    for i, (prompt_len, max_tokens, prio) in enumerate(lens):
        if -(-(prompt_len + max_tokens - 1) // block_size) > num_blocks:
            continue  # EngineCore rejects these at add_request
        req = make(f"r{i}", prompt_len, max_tokens, priority=prio, first_token=0 if shared_prefix else 100 * i)
        reqs.append(req)
        sched.add(req)

    def check(plan):
        assert sum(n for _, n in plan) <= budget
        assert len(plan) <= max_num_seqs
        for req, n in plan:
            assert n >= 1 and len(req.block_ids) * block_size >= req.num_computed_tokens + n

    run_to_completion(sched, on_plan=check)
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert sched.kv.num_free_blocks == num_blocks and set(sched.kv.ref_counts) == {0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_queue_time_runs_from_queued_to_first_scheduled_and_is_reported_once():
    clock = FakeClock()
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, clock=clock)
    first, second = make("first", 4, 2), make("second", 4, 2, first_token=40)
    sched.add(first)
    clock.now += 0.5
    sched.add(second)
    clock.now += 1.0
    advance(sched, sched.schedule())
    assert sched.take_queue_times() == [("first", 1.5)]
    assert sched.take_queue_times() == []  # taken once
    clock.now += 2.0
    advance(sched, sched.schedule())  # first finishes (max_tokens=2); second still waits for the seat
    assert sched.take_queue_times() == []
    clock.now += 0.25
    sched.schedule()
    assert sched.take_queue_times() == [("second", 3.25)]


def test_queue_times_not_taken_are_dropped_by_the_next_schedule():
    sched = scheduler()
    sched.add(make("a"))
    sched.schedule()
    sched.schedule()  # nobody took a's: the list holds the last step's admissions only
    assert sched.take_queue_times() == []


def test_a_preempted_request_resuming_reports_no_second_queue_time():
    sched = scheduler(num_blocks=6, block_size=4, budget=64)
    a, b, c = make("a", 8, 4, first_token=10), make("b", 8, 4, first_token=30), make("c", 8, 4, first_token=50)
    for r in (a, b, c):
        sched.add(r)
    advance(sched, sched.schedule())
    assert [rid for rid, _ in sched.take_queue_times()] == ["a", "b", "c"]
    reported = []
    for _ in range(100):
        if not sched.has_unfinished:
            break
        advance(sched, sched.schedule())
        reported += sched.take_queue_times()
    assert sched.num_preemptions >= 1 and reported == []


def test_an_aborted_waiting_request_reports_no_queue_time():
    sched = scheduler(max_num_seqs=1)
    running, waiting = make("run"), make("wait", first_token=40)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    assert [rid for rid, _ in sched.take_queue_times()] == ["run"]
    sched.finish(waiting, "abort")
    sched.schedule()
    assert sched.take_queue_times() == []
