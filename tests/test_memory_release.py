"""Memory a burst leaves behind: a spawned core and the server hand their heap back once idle (HeapRelease), the core
its KV pages too (release_idle_kv, correct for the requests after it), and a process core starts no helper process."""
from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import pathlib
import random
import sys
import threading
import time

import pytest

from rawserve.config import EngineConfig
from rawserve.engine.core import make_engine_core
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.ipc import make_channel
from rawserve.engine.launch import spawn_context
from rawserve.engine.messages import MsgKind
from rawserve.engine.types import SamplingParams
from rawserve.process_stats import HeapRelease
from tests.echo_child import echo
from tests.test_memory import burst, container_checkpoint

pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="needs /proc")


def status_kib(pid: int, field: str) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/{pid}/status has no {field}")


def children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is `pid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(pathlib.Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                out[int(entry)] = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def settled_rss_kib(pid: int, timeout_s: float = 6.0) -> int:
    """The process's RSS once two readings half a second apart agree within 1 MiB (or the last one)."""
    deadline = time.monotonic() + timeout_s
    last = status_kib(pid, "VmRSS")
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = status_kib(pid, "VmRSS")
        if abs(now - last) < 1024:
            return now
        last = now
    return last


def test_a_spawned_core_gives_a_burst_back_and_runs_no_resource_tracker(tmp_path):
    from tests.test_cli import Server

    model_dir = container_checkpoint(tmp_path, "float32")  # 2 layers, hidden 256, a 152k vocabulary
    command = [sys.executable, "-m", "rawserve", "serve", str(model_dir), "--port", "0",
               "--engine-mode", "process", "--no-log-requests", "--dtype", "float32", "--max-num-seqs", "32",
               "--max-model-len", "256"]
    with Server(command) as server:
        helpers = children(server.proc.pid)
        # The core alone: multiprocessing's resource tracker (a second interpreter, ~15 MiB) is not started.
        assert len(helpers) == 1, helpers
        core = next(iter(helpers))
        idle, api_idle = settled_rss_kib(core), settled_rss_kib(server.proc.pid)
        assert burst(server.port) == [(200, ["length"], 48)] * 32
        # The burst is just over: both releases are HeapRelease.idle_s away.
        end, api_end = status_kib(core, "VmRSS"), status_kib(server.proc.pid, "VmRSS")
        peak = status_kib(core, "VmHWM")
        after, api_after = settled_rss_kib(core), settled_rss_kib(server.proc.pid)
        print(f"core RSS idle {idle / 1024:.0f} MiB, burst peak {peak / 1024:.0f}, at its end {end / 1024:.0f}, "
              f"settled {after / 1024:.0f}; server idle {api_idle / 1024:.0f}, at the end {api_end / 1024:.0f}, "
              f"settled {api_after / 1024:.0f}")
        assert peak - idle > 40 * 1024  # the burst's steps did hold vocabulary-sized rows and activations
        # What the steps freed goes back to the kernel (without the release the core stays at `end` for good). The
        # rest above idle is in use, not free: ~40 MiB of heap that the first burst allocates and later ones reuse.
        assert end - after > 8 * 1024, (idle, peak, end, after)
        assert children(server.proc.pid).keys() == {core}


def test_heap_release_falls_due_once_per_idle_spell_and_not_too_often():
    heap = HeapRelease(idle_s=0.5, min_gap_s=2.0)
    assert not heap.run_if_due(5.0)  # never busy: nothing to hand back
    assert heap.went_idle(10.0) == 0.5
    assert heap.wait_s(10.2, 1.0) == pytest.approx(0.3)
    assert not heap.run_if_due(10.2)
    assert heap.run_if_due(10.5) and not heap.run_if_due(10.6)  # once
    assert heap.went_idle(11.0) == pytest.approx(1.5)  # 2 s after the last one, not 0.5 s after this spell began
    heap.went_busy()  # busy again before it fell due: this spell releases nothing
    assert not heap.run_if_due(13.0) and heap.wait_s(13.0, 1.0) == 1.0


@pytest.mark.parametrize("transport", ["pipe", "queue"])
def test_a_child_spawned_without_the_resource_tracker_talks_over_either_transport(transport):
    context = spawn_context()
    in_tx, in_rx = make_channel(transport, context)
    out_tx, out_rx = make_channel(transport, context)
    child = context.Process(target=echo, args=(in_rx, out_tx), daemon=True)
    child.start()
    try:
        deadline, command = time.monotonic() + 10, ""
        while "spawn_main" not in command and time.monotonic() < deadline:  # empty while the child execs
            command = pathlib.Path(f"/proc/{child.pid}/cmdline").read_bytes().decode(errors="replace")
            time.sleep(0.01)
        assert "tracker_fd=None" in command and "spawn_main" in command, command  # spawn_main gets no tracker; one would start on first use
        in_rx.detach()
        out_tx.detach()
        msgs = [(MsgKind.ABORT, "r1"), (MsgKind.ABORT, "r2")]
        in_tx.send(msgs)
        assert out_rx.recv(30) == msgs
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        if transport == "queue":  # stop the feeder thread this test started
            in_tx._q.close()
            in_tx._q.join_thread()


async def test_the_server_side_releases_once_the_last_stream_is_done(tiny_qwen3_dir):
    from tests.engine.test_async_llm import byte_tokenizer

    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", max_model_len=128, num_kv_blocks=16)
    llm = AsyncLLM(functools.partial(make_engine_core, config), byte_tokenizer())
    await llm.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        streams = [llm.generate([5, 6, 7], params) for _ in range(3)]
        await asyncio.gather(*[_drain(s) for s in streams[:2]])
        assert llm._heap.due is None  # one stream still runs: nothing falls due
        await _drain(streams[2])
        assert llm._heap.due is not None
        deadline = time.monotonic() + 5
        while llm._heap.due is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert llm._heap.due is None and llm._heap.last > float("-inf")  # it ran, half a second into the idle
    finally:
        await llm.stop(0.5)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


_FAULTS_PROBE = """
import resource, sys, torch
from rawserve.process_stats import keep_freed_heap, release_free_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
def step():
    for _ in range(3):  # a layer's large activations: made, used, freed
        torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
for _ in range(4):  # the kept heap settles after a few steps (torch's 64-byte alignment splits freed chunks)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _has_mallopt() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallopt(), reason="glibc's mallopt (musl and macOS have none)")
@pytest.mark.parametrize("policy", ["keep", "default"])
def test_kept_heap_serves_a_steps_large_tensors_without_fresh_pages(policy):
    # 48 MiB is past glibc's largest mmap threshold: by default each such tensor is a fresh mapping the kernel
    # zero-fills page by page (~12k faults apiece); with keep_freed_heap, once settled, freed ones are reused.
    import subprocess

    out = subprocess.run([sys.executable, "-c", _FAULTS_PROBE, policy], capture_output=True, text=True, timeout=120,
                         check=True)
    faults = int(out.stdout.split()[-1])
    pages = 15 * (48 << 20) // os.sysconf("SC_PAGE_SIZE")
    if policy == "keep":
        assert faults < pages // 20
    else:
        assert faults > pages // 2  # what the kept heap saves


def test_idle_kv_release_moves_the_kept_prefix_cache_down_and_later_requests_match_a_fresh_engine(tiny_qwen3_dir):
    from rawserve.engine.kv_cache import extend_block_hashes
    from tests.engine.test_core import BLOCK, greedy, make_core, prompt, run

    core = make_core(tiny_qwen3_dir, num_kv_blocks=256)
    shared = prompt(6 * BLOCK, seed=40)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=16)
    # Older work first, on the low ids; the shared-prefix requests then take fresh, higher ones (plain blocks go
    # before cached ones), and are the newest in the prefix cache when the engine goes idle.
    run(core, [(f"old{i}", prompt(40, seed=30 + i), greedy(24)) for i in range(4)])
    run(core, [(f"a{i}", shared + prompt(5, seed=41 + i), greedy(16)) for i in range(3)])
    hashes: list[bytes] = []
    extend_block_hashes(hashes, shared, BLOCK, b"")
    before = core.blocks.lookup(hashes, len(hashes))
    zeroed = core.runner._num_zeroed
    assert len(before) == 6 and min(before) >= core.runner.idle_cached_blocks

    released = core.release_idle_kv()
    after = core.blocks.lookup(hashes, len(hashes))
    assert len(after) == 6 and max(after) < core.runner.idle_cached_blocks  # kept, and moved to the lowest ids
    top = max(core.blocks.free_cached) + 1  # nothing above the kept blocks is held or cached
    assert top == core.runner.idle_cached_blocks < zeroed
    assert released >= 2 * 2 * (zeroed - top - 8) * BLOCK * 2 * 32 * 4  # K and V of 2 layers, page ends aside
    # What the pool held above `top` is anyone's now: stand in for it with NaN (0 x NaN would spoil a step that
    # read a slot never written since). Blocks handed out from there on are zeroed again first.
    for k_cache, v_cache in core.runner.kv_caches:
        k_cache[top:] = float("nan")
        v_cache[top:] = float("nan")
    later = [("again", shared + prompt(5, seed=41), greedy(16)), ("new", prompt(37, seed=60), greedy(16)),
             ("sampled", shared + prompt(9, seed=61), sampled), ("old0", prompt(40, seed=30), greedy(16))]
    tokens, final, _ = run(core, later)
    assert final["again"].num_cached_tokens >= 6 * BLOCK and final["sampled"].num_cached_tokens >= 6 * BLOCK
    assert final["old0"].num_cached_tokens == 0  # evicted: the idle engine kept only the newest blocks
    fresh, _, _ = run(make_core(tiny_qwen3_dir, num_kv_blocks=256), later)
    assert tokens == fresh


def wide_kv_checkpoint(root: pathlib.Path) -> pathlib.Path:
    """A tiny model whose KV is wide (4 layers x 8 KV heads x 128: 32 KiB a token at float32), with the demo model's
    tokenizer: a burst fills a large pool in a few hundred steps, as a real model's would."""
    import shutil

    from rawserve.demo_model import Qwen3Shape, ensure_demo_model, write_qwen3_checkpoint

    shape = Qwen3Shape(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=1024)
    directory = write_qwen3_checkpoint(root / "wide-kv", shape, seed=0, bos_token_id=None, eos_token_id=2,
                                       generation_config={"eos_token_id": [2]})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_model() / name, directory / name)
    return directory


def _complete(port: int, body: dict, results: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        choices = json.loads(response.read()).get("choices", [])
        results.append((response.status, len(choices)))
    finally:
        conn.close()


def _walk_away(port: int, body: dict, num_events: int, results: list) -> None:
    """Stream `body` and close the connection after `num_events` events, as a client that gives up does."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        seen = 0
        while seen < num_events and (line := response.readline()):
            seen += line.startswith(b"data: {")
        results.append((response.status, seen))
    finally:
        conn.close()


def test_the_core_gives_a_bursts_kv_pages_back_within_30_s(tmp_path):
    from tests.test_cli import Server

    model_dir = wide_kv_checkpoint(tmp_path)
    # auto sizing: what 64 sequences x 128 tokens can use, 256 MiB; an idle engine keeps 1/16 of it cached
    command = [sys.executable, "-m", "rawserve", "serve", str(model_dir), "--port", "0", "--engine-mode", "process",
               "--no-log-requests", "--dtype", "float32", "--max-num-seqs", "64", "--max-model-len", "128"]
    with Server(command) as server:
        assert ("KV cache 8192 tokens (512 blocks of 16, 256.0 MiB, float32) [what 64 sequences x 128 tokens"
                in server.lines[-1])
        (core,) = children(server.proc.pid)
        idle = settled_rss_kib(core)
        rng = random.Random(0)
        results: list = []
        # 48 distinct prompts (their prefill fills the pool fast), and 128 samples as long as the context allows
        # from a client that walks away mid-stream
        threads = [threading.Thread(target=_complete, args=(server.port, {
            "prompt": [rng.randrange(10, 2000) for _ in range(110)], "max_tokens": 16, "ignore_eos": True}, results))
            for _ in range(48)]
        threads.append(threading.Thread(target=_walk_away, args=(server.port, {
            "prompt": "once upon a time", "n": 128, "max_tokens": 120, "ignore_eos": True, "temperature": 1.0},
            256, results)))
        start = time.monotonic()
        for t in threads:
            t.start()
        peak = idle
        while any(t.is_alive() for t in threads):
            peak = max(peak, status_kib(core, "VmRSS"))
            time.sleep(0.05)
        took = time.monotonic() - start
        assert sorted(results) == [(200, 1)] * 48 + [(200, 256)]
        deadline, now = time.monotonic() + 30, status_kib(core, "VmRSS")
        while now > 1.2 * idle and time.monotonic() < deadline:
            time.sleep(0.25)
            now = status_kib(core, "VmRSS")
        print(f"core RSS idle {idle / 1024:.0f} MiB, burst ({took:.1f} s) peak {peak / 1024:.0f}, "
              f"{30 - (deadline - time.monotonic()):.1f} s later {now / 1024:.0f}")
        assert peak - idle > 150 * 1024  # the burst did fill most of the pool
        assert now <= 1.2 * idle, (idle, peak, now)
