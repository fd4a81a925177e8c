"""AsyncLLM against the real EngineCore on a tiny random checkpoint, in thread and process modes."""
from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import tokenizers

from rawserve.config import EngineConfig
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.core import EngineCore, make_engine_core
from rawserve.engine.types import SamplingParams
from rawserve.errors import EngineDead, Overloaded
from rawserve.text.tokenizer import CHAR_TO_BYTE, Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = dict(temperature=0, ignore_eos=True)


def byte_tokenizer() -> Tokenizer:
    """256 ids, one per byte, matching the random checkpoint's vocabulary of 256."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=dict(CHAR_TO_BYTE), merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(tok)


def engine_config(model_dir, **overrides) -> EngineConfig:
    return EngineConfig(**{"model_dir": str(model_dir), "device": "cpu", "max_model_len": 512,
                           "num_kv_blocks": 48, "block_size": 16, **overrides})


class ExplodingCore(EngineCore):
    """The real core, whose third step raises: a fault inside step() must kill the whole engine."""

    def step(self):
        if self.steps == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


def make_exploding_core(config: EngineConfig) -> ExplodingCore:
    return ExplodingCore(config)


@pytest.fixture(autouse=True)
def nothing_left_running():
    """Every test stops what it starts: no pump, core or writer thread and no core process outlives it."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        threads = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        children = multiprocessing.active_children()
        if not threads and not children:
            break
        assert time.monotonic() < deadline, (threads, children)
        time.sleep(0.01)


@pytest.fixture
def tokenizer() -> Tokenizer:
    return byte_tokenizer()


@pytest.fixture
async def make_llm(tiny_qwen3_dir, tokenizer):
    """Start an AsyncLLM on the tiny checkpoint; every one started is stopped at teardown."""
    started = []

    async def make(mode: str = "thread", factory=None, start: bool = True, **kwargs) -> AsyncLLM:
        factory = factory or functools.partial(make_engine_core, engine_config(tiny_qwen3_dir))
        llm = AsyncLLM(factory, tokenizer, mode=mode, **kwargs)
        started.append(llm)
        if start:
            await llm.start()
        return llm

    yield make
    for llm in started:
        await llm.stop(0.5)


async def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval_s)


async def collect(stream) -> list:
    return [out async for out in stream]


async def test_thread_mode_streams_text_that_matches_a_full_decode(make_llm, tokenizer):
    llm = await make_llm()
    outs = await collect(llm.generate(tokenizer.encode("hello"), SamplingParams(max_tokens=24, **GREEDY)))
    ids = [t for o in outs for t in o.new_token_ids]
    assert len(ids) == 24 and outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert "".join(o.text for o in outs) == tokenizer.decode(ids)
    assert outs[-1].num_prompt_tokens == 5 and outs[-1].num_output_tokens == 24
    assert llm.num_in_flight == 0
    m = llm.metrics
    assert m.histogram_count("time_to_first_token_seconds") == 1
    assert m.histogram_count("inter_token_latency_seconds") >= 1
    assert m.histogram_count("e2e_request_latency_seconds") == 1
    assert m.histogram_count("request_queue_time_seconds") == 1
    assert m.counter_value("request_success_total", "length") == 1
    assert m.counter_value("generation_tokens_total") == 24 and m.counter_value("prompt_tokens_total") == 5
    await wait_for(lambda: llm.core_stats.prefix_cache_queries > 0)
    assert 'rawserve:request_success_total{model_name="rawserve",finished_reason="length"} 1' \
        in llm.render_metrics()


@pytest.mark.parametrize("how", ["cancel", "break", "aclose"])
async def test_leaving_a_500_token_stream_frees_the_core_within_a_few_steps(make_llm, tokenizer, how):
    llm = await make_llm()
    params = SamplingParams(max_tokens=500, **GREEDY)
    seen = asyncio.get_running_loop().create_future()

    async def consume():
        if how == "break":  # the stream is dropped when the loop is left, as an async generator would be
            async for out in llm.generate(tokenizer.encode("once"), params):
                seen.set_result(out)
                break
        else:
            stream = llm.generate(tokenizer.encode("once"), params)
            async for out in stream:
                if not seen.done():
                    seen.set_result(out)
                if how == "aclose":
                    await stream.aclose()
        await asyncio.sleep(3600)  # a client that keeps its connection but no longer reads

    task = asyncio.create_task(consume())
    first = await seen
    if how == "cancel":
        task.cancel()
    await wait_for(lambda: llm.num_in_flight == 0)
    # Fresh stats only (steps >= ...): the core reports when it goes idle, carrying its step count.
    await wait_for(lambda: llm.core_stats.steps >= first.num_output_tokens and llm.core_stats.num_running == 0
                   and llm.core_stats.num_free_blocks == llm.core_stats.num_blocks)
    # One request: one output per step. The abort landed a few steps after the output we read.
    lag = llm.core_stats.steps - first.num_output_tokens
    print("steps between the output read and the abort:", lag)
    assert lag <= 10, llm.core_stats
    assert llm.core_stats.steps < 100
    assert llm.metrics.counter_value("request_success_total", "abort") == 1
    task.cancel()


async def test_invalid_request_fails_alone_while_others_finish(make_llm, tokenizer):
    llm = await make_llm()
    ok = SamplingParams(max_tokens=8, **GREEDY)
    good = [collect(llm.generate(tokenizer.encode(p), ok)) for p in ("a", "bc")]
    too_long = collect(llm.generate(list(range(200)), SamplingParams(max_tokens=400)))
    results = await asyncio.gather(*good, too_long, return_exceptions=True)
    assert [r[-1].finish_reason for r in results[:2]] == ["length", "length"]
    assert isinstance(results[2], ValueError) and "max_model_len" in str(results[2])
    assert not llm.is_dead and llm.num_in_flight == 0


async def test_step_failure_fails_every_request_and_every_new_one(make_llm, tokenizer, tiny_qwen3_dir):
    llm = await make_llm(factory=functools.partial(make_exploding_core, engine_config(tiny_qwen3_dir)))
    params = SamplingParams(max_tokens=50, **GREEDY)
    results = await asyncio.gather(*(collect(llm.generate(tokenizer.encode(p), params)) for p in ("x", "yz")),
                                   return_exceptions=True)
    assert all(isinstance(r, EngineDead) for r in results), results
    assert llm.is_dead and "illegal memory access" in llm.dead_reason
    with pytest.raises(EngineDead):
        llm.generate([1, 2], params)


async def test_stop_string_ends_the_request_and_aborts_it_in_the_core(make_llm, tokenizer):
    llm = await make_llm()
    prompt = tokenizer.encode("stop me")
    full = await collect(llm.generate(prompt, SamplingParams(max_tokens=60, **GREEDY)))
    text = "".join(o.text for o in full)
    stop = next(ch for ch in text[2:12] if ch != "\ufffd")  # greedy repeats itself: this will match again
    cut = text.index(stop)
    await wait_for(lambda: llm.core_stats.steps >= 60 and llm.core_stats.num_running == 0)
    steps_before = llm.core_stats.steps
    outs = await collect(llm.generate(prompt, SamplingParams(max_tokens=60, stop=(stop,), **GREEDY)))
    assert "".join(o.text for o in outs) == text[:cut]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert outs[-1].num_output_tokens <= 12
    await wait_for(lambda: llm.core_stats.steps > steps_before and llm.core_stats.num_running == 0
                   and llm.core_stats.num_free_blocks == llm.core_stats.num_blocks)
    print("steps run for the stopped request:", llm.core_stats.steps - steps_before)
    assert llm.core_stats.steps - steps_before < 40  # aborted in the core, not run to max_tokens=60


async def test_max_pending_gives_overloaded_until_a_slot_frees(make_llm, tokenizer):
    llm = await make_llm(max_pending=2)
    params = SamplingParams(max_tokens=4, **GREEDY)
    first, second = llm.generate([1], params), llm.generate([2], params)
    with pytest.raises(Overloaded):
        llm.generate([3], params)
    await collect(first)
    third = llm.generate([3], params)
    assert len(await collect(second)) >= 1 and len(await collect(third)) >= 1


async def test_abort_ends_the_stream_with_finish_reason_abort(make_llm, tokenizer):
    llm = await make_llm()
    stream = llm.generate([7], SamplingParams(max_tokens=480, **GREEDY), request_id="r-abort")
    first = await stream.__anext__()
    llm.abort("r-abort")
    rest = [out async for out in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert rest[-1].num_output_tokens >= first.num_output_tokens
    assert llm.num_in_flight == 0
    await wait_for(lambda: llm.core_stats.steps > 0 and llm.core_stats.num_running == 0)
    assert llm.core_stats.steps < 480


async def test_admission_rejects_duplicate_ids_and_n_above_one(make_llm):
    llm = await make_llm()
    stream = llm.generate([1], SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        llm.generate([1], SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="n:"):
        llm.generate([1], SamplingParams(n=2, max_tokens=2))
    assert llm.num_in_flight == 1
    await collect(stream)


async def test_non_consuming_client_holds_one_coalesced_output(make_llm, tokenizer):
    llm = await make_llm()
    params = SamplingParams(max_tokens=200, logprobs=1, prompt_logprobs=0, **GREEDY)
    stream = llm.generate(tokenizer.encode("idle"), params)
    await wait_for(lambda: llm.metrics.counter_value("request_success_total", "length") == 1)
    outs = await collect(stream)
    assert len(outs) == 1  # 200 steps of deltas were merged into the one unread output
    out = outs[0]
    assert len(out.new_token_ids) == 200 and out.finished and out.num_output_tokens == 200
    assert out.text == tokenizer.decode(out.new_token_ids)
    assert [entry[0] for entry in out.logprobs] == out.new_token_ids
    assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None


async def test_request_timeout_ends_the_stream_at_length_and_frees_the_core(make_llm, tokenizer):
    llm = await make_llm(request_timeout_s=5)
    stream = llm.generate([1, 2], SamplingParams(max_tokens=480, **GREEDY), timeout_s=0.05)
    outs = []
    async for out in stream:
        outs.append(out)
        await asyncio.sleep(0.02)  # a slow reader: the deadline must still apply
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    ids = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].num_output_tokens == len(ids) < 480
    assert "".join(o.text for o in outs) == tokenizer.decode(ids)  # nothing held back is lost
    assert llm.num_in_flight == 0
    # Fresh stats (steps > 0) with nothing running: the core went idle after the abort, short of 480.
    await wait_for(lambda: llm.core_stats.steps > 0 and llm.core_stats.num_running == 0)
    assert llm.core_stats.steps < 480
    assert llm.metrics.counter_value("request_success_total", "length") == 1


async def test_stop_drains_in_flight_requests_and_refuses_new_ones(make_llm, tokenizer):
    llm = await make_llm()
    tasks = [asyncio.create_task(collect(llm.generate([i + 1], SamplingParams(max_tokens=30, **GREEDY))))
             for i in range(3)]
    await wait_for(lambda: llm.metrics.counter_value("generation_tokens_total") > 0)
    stopping = asyncio.create_task(llm.stop(drain_timeout_s=30))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded):
        llm.generate([9], SamplingParams(max_tokens=2))
    await stopping
    results = [t.result() for t in tasks]
    assert all(r[-1].finish_reason == "length" and r[-1].num_output_tokens == 30 for r in results)
    assert not llm._client.worker.is_alive()


async def test_stop_past_the_drain_deadline_fails_what_is_left(make_llm, tokenizer):
    llm = await make_llm()
    stream = llm.generate([5], SamplingParams(max_tokens=480, **GREEDY))
    await stream.__anext__()
    started = time.monotonic()
    await llm.stop(drain_timeout_s=0.2)
    assert time.monotonic() - started < 5
    with pytest.raises(EngineDead):
        async for _ in stream:
            pass
    assert not llm._client.worker.is_alive()


async def test_thread_core_that_fails_to_load_is_a_clear_error_at_start(make_llm):
    llm = await make_llm(factory=functools.partial(make_engine_core, EngineConfig(model_dir="/nonexistent")),
                         start=False)
    with pytest.raises(EngineDead, match="engine failed to start"):
        await llm.start()
    assert llm.is_dead


async def test_process_mode_end_to_end(make_llm, tokenizer):
    llm = await make_llm(mode="process")
    assert llm.info["pid"] != os.getpid() and llm.info["num_blocks"] == 48
    params = SamplingParams(max_tokens=16, **GREEDY)
    results = await asyncio.gather(*(collect(llm.generate(tokenizer.encode(p), params)) for p in ("a", "bb", "c")))
    for outs in results:
        ids = [t for o in outs for t in o.new_token_ids]
        assert len(ids) == 16 and outs[-1].finish_reason == "length"
        assert "".join(o.text for o in outs) == tokenizer.decode(ids)
    # Greedy is deterministic: the same prompt gives the same tokens in both modes' cores.
    thread_llm = await make_llm()
    again = await collect(thread_llm.generate(tokenizer.encode("a"), params))
    assert [t for o in again for t in o.new_token_ids] == [t for o in results[0] for t in o.new_token_ids]
    worker = llm._client.worker
    await llm.stop(5)
    assert worker.exitcode == 0


async def test_process_core_that_fails_to_load_is_a_clear_error_at_start(make_llm):
    llm = await make_llm(mode="process", start=False,
                         factory=functools.partial(make_engine_core, EngineConfig(model_dir="/nonexistent")))
    started = time.monotonic()
    with pytest.raises(EngineDead, match="engine failed to start"):
        await llm.start()
    assert time.monotonic() - started < 60


async def test_sigkilled_core_process_is_detected_within_a_second(make_llm, tokenizer):
    llm = await make_llm(mode="process")
    stream = llm.generate(tokenizer.encode("x"), SamplingParams(max_tokens=480, **GREEDY))
    await stream.__anext__()
    os.kill(llm.info["pid"], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDead):
        async for _ in stream:
            pass
    assert time.monotonic() - killed < 1.0
    assert llm.is_dead and "-9" in llm.dead_reason
    with pytest.raises(EngineDead):
        llm.generate([1], SamplingParams(max_tokens=2))


EXIT_SCRIPT = """
import asyncio, functools, sys
sys.path.insert(0, {root!r})
from rawserve.config import EngineConfig
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.core import make_engine_core
from rawserve.engine.types import SamplingParams
from tests.engine.test_async_llm import byte_tokenizer

async def main():
    config = EngineConfig(model_dir={model_dir!r}, device="cpu", max_model_len=512, num_kv_blocks=48)
    llm = AsyncLLM(functools.partial(make_engine_core, config), byte_tokenizer(), mode={mode!r})
    await llm.start()
    stream = llm.generate([1, 2, 3], SamplingParams(max_tokens=480, temperature=0, ignore_eos=True))
    await stream.__anext__()
    print("started", flush=True)  # and return with the core busy, without stop()

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_process_exits_within_5s_without_calling_stop(tiny_qwen3_dir, tmp_path, mode):
    script = tmp_path / "exit_without_stop.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT.format(root=ROOT, model_dir=str(tiny_qwen3_dir), mode=mode)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "started", proc.stderr.read()
        started = time.monotonic()
        proc.wait(timeout=5)
        assert time.monotonic() - started < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
