"""run_core and the transports: message protocol, failure isolation, idle blocking, wire encoding."""
from __future__ import annotations

import functools
import multiprocessing
import threading
import time

import pytest

from rawserve.engine.core_loop import run_core
from rawserve.engine.ipc import decode, encode, make_channel
from rawserve.engine.messages import MsgKind
from rawserve.engine.types import AddRequest, EngineStats, RequestOutput, SamplingParams


class FakeCore:
    """EngineCore's interface without a model (the core is outside the unit under test here):
    one token per running request per step; an empty prompt is rejected; step number `fail_at` raises."""

    def __init__(self, fail_at: int | None = None, step_s: float = 0.0) -> None:
        self.fail_at = fail_at
        self.step_s = step_s
        self.max_model_len = 128
        self.num_blocks = 32
        self.vocab_size = 100
        self.steps = 0
        self.running: dict[str, list[int]] = {}

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def add_request(self, rid, prompt_ids, params, priority=0, *, lora=None, features=None, cache_salt=None):
        if not prompt_ids:
            raise ValueError("prompt: must hold at least one token")
        self.running[rid] = [params.max_tokens, 0]

    def abort_request(self, rid):
        self.running.pop(rid, None)

    def take_queue_times(self) -> list[tuple[str, float]]:
        return []

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("kernel exploded")
        time.sleep(self.step_s)
        outs = []
        for rid, counts in list(self.running.items()):
            counts[1] += 1
            done = counts[1] >= counts[0]
            outs.append(RequestOutput(rid, [counts[1]], done, "length" if done else None, num_output_tokens=counts[1]))
            if done:
                del self.running[rid]
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_blocks=self.num_blocks,
                           num_free_blocks=self.num_blocks - len(self.running), steps=self.steps)


def broken_factory():
    raise OSError("no such checkpoint: /nowhere")


class Loop:
    """run_core in a thread on local channels, as AsyncLLM's thread mode runs it."""

    def __init__(self, factory) -> None:
        self.tx, in_rx = make_channel(None, None)
        out_tx, self.rx = make_channel(None, None)
        self.thread = threading.Thread(target=run_core, args=(factory, in_rx, out_tx),
                                       kwargs={"stats_interval_s": 3600.0}, daemon=True)
        self.thread.start()
        self.log: list[tuple[str, object]] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3) -> None:
        self.tx.send([(MsgKind.ADD, AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens)))])

    def until(self, predicate, timeout_s: float = 10.0) -> list[tuple[str, object]]:
        """Messages received until one satisfies predicate (inclusive)."""
        got = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msgs = self.rx.recv(0.05)
            except EOFError:
                break
            for msg in msgs:
                got.append(msg)
                self.log.append(msg)
                if predicate(msg):
                    return got
        raise AssertionError(f"condition not met; got {got}")

    def finished(self) -> set[str]:
        return {o.request_id for kind, p in self.log if kind == MsgKind.OUTPUTS for o in p if o.finished}

    def stop(self) -> None:
        self.tx.send([(MsgKind.SHUTDOWN, None)])
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def loop():
    loops = []

    def start(factory):
        loops.append(Loop(factory))
        return loops[-1]

    yield start
    for lp in loops:
        if lp.thread.is_alive():
            lp.stop()


def test_ready_carries_max_model_len_and_block_count_then_stats(loop):
    lp = loop(FakeCore)
    msgs = lp.until(lambda m: m[0] == MsgKind.STATS)
    assert msgs[0][0] == MsgKind.READY
    assert msgs[0][1]["max_model_len"] == 128 and msgs[0][1]["num_blocks"] == 32
    assert msgs[1][1].num_blocks == 32


def test_rejected_request_fails_alone_while_others_finish(loop):
    lp = loop(FakeCore)
    lp.add("a", [1, 2], max_tokens=3)
    lp.add("bad", [], max_tokens=3)
    lp.add("b", [3], max_tokens=2)
    lp.until(lambda m: m[0] == MsgKind.OUTPUTS and {"a", "b"} <= lp.finished(), timeout_s=5)
    errors = [p for kind, p in lp.log if kind == MsgKind.ERROR]
    assert errors == [("bad", "prompt: must hold at least one token")]
    tokens = {}
    for kind, payload in lp.log:
        if kind == MsgKind.OUTPUTS:
            for out in payload:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {"a": [1, 2, 3], "b": [1, 2]}
    assert not any(kind == MsgKind.FATAL for kind, _ in lp.log)


def test_exception_in_step_is_fatal_and_ends_the_loop(loop):
    lp = loop(functools.partial(FakeCore, fail_at=2))
    lp.add("a", [1], max_tokens=10)
    lp.until(lambda m: m[0] == MsgKind.FATAL)
    assert "kernel exploded" in lp.log[-1][1]
    lp.thread.join(5)
    assert not lp.thread.is_alive()
    with pytest.raises(EOFError):  # the loop closed its side
        lp.rx.recv(1.0)


def test_stats_follow_a_request_that_finished_in_its_first_step(loop):
    lp = loop(FakeCore)
    lp.until(lambda m: m[0] == MsgKind.STATS)
    lp.add("one", [1], max_tokens=1)
    msgs = lp.until(lambda m: m[0] == MsgKind.STATS, timeout_s=5)
    assert msgs[0][0] == MsgKind.OUTPUTS and msgs[-1][1].steps == 1 and msgs[-1][1].num_running == 0


class StatsFailCore(FakeCore):
    def stats(self) -> EngineStats:
        if self.steps:
            raise KeyError("block pool accounting broke")
        return super().stats()


def test_fault_outside_step_is_fatal_too(loop):
    lp = loop(StatsFailCore)
    lp.add("a", [1], max_tokens=1)
    msgs = lp.until(lambda m: m[0] == MsgKind.FATAL)
    assert "block pool accounting broke" in msgs[-1][1]
    lp.thread.join(5)
    assert not lp.thread.is_alive()


def test_factory_failure_is_a_fatal_message_not_a_hang(loop):
    lp = loop(broken_factory)
    msgs = lp.until(lambda m: m[0] == MsgKind.FATAL, timeout_s=5)
    assert msgs[0][0] == MsgKind.FATAL and "engine failed to start" in msgs[0][1] and "/nowhere" in msgs[0][1]
    lp.thread.join(5)
    assert not lp.thread.is_alive()


def test_idle_core_blocks_without_stepping(loop):
    core = FakeCore()
    lp = loop(lambda: core)
    lp.until(lambda m: m[0] == MsgKind.STATS)
    time.sleep(0.3)
    assert core.steps == 0
    lp.add("a", [1], max_tokens=2)
    lp.until(lambda m: m[0] == MsgKind.OUTPUTS and "a" in lp.finished())
    steps = core.steps
    time.sleep(0.3)
    assert core.steps == steps == 2


def test_busy_core_admits_new_requests_at_the_next_step(loop):
    core = FakeCore(step_s=0.02)
    lp = loop(lambda: core)
    lp.add("long", [1], max_tokens=60)
    lp.until(lambda m: m[0] == MsgKind.OUTPUTS)
    lp.add("late", [1], max_tokens=1)
    sent_at_step = core.steps
    lp.until(lambda m: m[0] == MsgKind.OUTPUTS and any(o.request_id == "late" for o in m[1]))
    # Its add was taken while "long" was running: at most the step then in progress passed first.
    assert core.steps <= sent_at_step + 2
    assert "long" not in lp.finished()


def test_abort_while_busy_stops_the_request_and_reports_idle_stats(loop):
    lp = loop(functools.partial(FakeCore, step_s=0.01))
    lp.add("a", [1], max_tokens=1000)
    lp.until(lambda m: m[0] == MsgKind.OUTPUTS)
    lp.tx.send([(MsgKind.ABORT, "a")])
    msgs = lp.until(lambda m: m[0] == MsgKind.STATS and m[1].num_running == 0)
    assert msgs[-1][1].num_free_blocks == 32
    assert "a" not in lp.finished()


def test_shutdown_ends_the_loop(loop):
    lp = loop(FakeCore)
    lp.until(lambda m: m[0] == MsgKind.READY)
    lp.stop()


def test_closed_input_ends_the_loop(loop):
    lp = loop(FakeCore)
    lp.until(lambda m: m[0] == MsgKind.READY)
    lp.tx.close()
    lp.thread.join(5)
    assert not lp.thread.is_alive()


def test_real_engine_rejects_one_request_and_reports_queue_time(loop, tiny_qwen3_dir):
    from rawserve.config import EngineConfig
    from rawserve.engine.core import make_engine_core

    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", max_model_len=64, num_kv_blocks=16,
                          max_num_seqs=1)
    lp = loop(functools.partial(make_engine_core, config))
    lp.until(lambda m: m[0] == MsgKind.READY, timeout_s=60)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lp.tx.send([(MsgKind.ADD, AddRequest("first", [5, 6, 7], params)),
                (MsgKind.ADD, AddRequest("too-long", list(range(100)), params)),
                (MsgKind.ADD, AddRequest("second", [8, 9], params))])
    lp.until(lambda m: {"first", "second"} <= lp.finished(), timeout_s=30)
    errors = dict(p for kind, p in lp.log if kind == MsgKind.ERROR)
    assert list(errors) == ["too-long"] and "max_model_len" in errors["too-long"]
    queued = dict(entry for kind, p in lp.log if kind == MsgKind.QUEUED for entry in p)
    assert set(queued) == {"first", "second"}
    # max_num_seqs=1: "second" waited for all 8 of "first"'s steps before its own first step.
    assert queued["second"] > queued["first"]
    counts = {o.request_id: o.num_output_tokens for kind, p in lp.log if kind == MsgKind.OUTPUTS for o in p if o.finished}
    assert counts == {"first": 8, "second": 8}


# ----- transports


def test_wire_encoding_round_trips_every_message_kind():
    params = SamplingParams(max_tokens=7, stop=("x",), logit_bias={3: 1.5}, seed=11)
    logprob = (5, -0.25, 1, ((5, -0.25), (6, -2.0)))
    msgs = [
        (MsgKind.READY, {"max_model_len": 64, "num_blocks": 9}),
        (MsgKind.ADD, AddRequest("r1", [1, 2, 3], params, 2, None, None, "salt")),
        (MsgKind.OUTPUTS, [RequestOutput("r1", [4], True, "stop", 4, [logprob], [None, logprob], 3, 1, 0),
                     RequestOutput("r2", [], num_prompt_tokens=5)]),
        (MsgKind.STATS, EngineStats(num_running=2, kv_cache_usage=0.5, extra={"k": 1})),
        (MsgKind.ERROR, ("r3", "bad")),
        (MsgKind.ABORT, "r1"),
        (MsgKind.QUEUED, [("r1", 0.25)]),
    ]
    assert decode(encode(msgs)) == msgs


@pytest.mark.parametrize("transport", ["pipe", "queue"])
def test_process_transports_deliver_batches_in_order_then_eof(transport):
    context = multiprocessing.get_context("spawn")
    tx, rx = make_channel(transport, context, threaded_sender=True)
    assert rx.recv(0.05) == []
    batches = [[(MsgKind.OUTPUTS, [RequestOutput(f"r{i}", [i], num_output_tokens=i)])] for i in range(200)]
    for batch in batches:
        tx.send(batch)
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 200 and time.monotonic() < deadline:
        got.extend(rx.recv(0.1))
    assert got == [msg for batch in batches for msg in batch]
    tx.close()
    with pytest.raises(EOFError):
        for _ in range(50):
            rx.recv(0.1)
    rx.close()
    if transport == "queue":  # stop the Queue's feeder thread, which this test started
        tx._q.close()
        tx._q.join_thread()
