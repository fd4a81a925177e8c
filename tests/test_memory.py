"""Memory: the limits the KV pool is sized from (cgroup v1/v2, host), the sizing and its refusals, the process_*
metrics, and the server in a 600 MiB container (a child cgroup of this test's own, where the machine allows it)."""
from __future__ import annotations

import http.client
import json
import os
import pathlib
import re
import shutil
import sys
import threading
import time

import pytest

from rawserve.engine import memory
from rawserve.engine.memory import Headroom, plan_kv_cache
from rawserve.process_stats import read_process, render_process_metrics

MIB = 1 << 20


def fake_cgroups(tmp_path: pathlib.Path, version: str, cgroup_path: str, mount_root: str = "/") -> pathlib.Path:
    """A /proc/self and a cgroup mount as a container shows them: proc/self/{cgroup,mountinfo}, sys/..."""
    proc_self = tmp_path / "proc" / "self"
    proc_self.mkdir(parents=True)
    if version == "v2":
        (proc_self / "cgroup").write_text(f"0::{cgroup_path}\n")
        mount = f"35 24 0:30 {mount_root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    else:
        (proc_self / "cgroup").write_text(f"5:cpu,cpuacct:/\n4:memory:{cgroup_path}\n0::/\n")
        mount = (f"32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
                 f"34 31 0:31 {mount_root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    (proc_self / "mountinfo").write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + mount)
    return proc_self


def write(directory: pathlib.Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)


def test_cgroup_v2_limit_less_its_working_set(tmp_path):
    proc_self = fake_cgroups(tmp_path, "v2", "/kubepods/pod1/ctr")
    leaf = tmp_path / "sys/fs/cgroup/kubepods/pod1/ctr"
    write(leaf, memory__max=f"{600 * MIB}\n", memory__current=f"{250 * MIB}\n",
          memory__stat=f"anon {200 * MIB}\ninactive_file {50 * MIB}\n")
    write(leaf.parent, memory__max="max\n")
    room = memory.cgroup_headroom(proc_self, tmp_path)
    # page cache it may drop (inactive_file) does not count as used
    assert (room.limit_bytes, room.used_bytes, room.available_bytes) == (600 * MIB, 200 * MIB, 400 * MIB)
    assert "cgroup v2 limit 600 MiB" in room.source


def test_cgroup_v1_takes_the_tightest_ancestor_and_strips_a_container_root(tmp_path):
    # In a container the mount's root is the container's own cgroup; /proc/self/cgroup names the full path.
    proc_self = fake_cgroups(tmp_path, "v1", "/docker/abc/inner", mount_root="/docker/abc")
    top = tmp_path / "sys/fs/cgroup/memory"
    write(top, memory__limit_in_bytes=f"{300 * MIB}\n", memory__usage_in_bytes=f"{100 * MIB}\n",
          memory__stat="total_inactive_file 0\n")
    write(top / "inner", memory__limit_in_bytes="9223372036854771712\n", memory__usage_in_bytes=f"{90 * MIB}\n")
    room = memory.cgroup_headroom(proc_self, tmp_path)
    assert (room.limit_bytes, room.available_bytes) == (300 * MIB, 200 * MIB)


def test_no_cgroup_limit_means_the_host_decides(tmp_path):
    proc_self = fake_cgroups(tmp_path, "v2", "/")
    write(tmp_path / "sys/fs/cgroup", memory__max="max\n")
    assert memory.cgroup_headroom(proc_self, tmp_path) is None
    write(tmp_path / "proc", meminfo="MemTotal: 8000000 kB\nMemFree: 100 kB\nMemAvailable: 4000000 kB\n")
    assert memory.headroom(tmp_path / "proc", tmp_path).available_bytes == 4000000 * 1024


BLOCK = 16 * 2 * 2 * 2 * 64 * 4  # 16 tokens x K,V x 2 layers x 2 heads x 64 x float32: 32 KiB


def plan(**overrides):
    kwargs = dict(block_bytes=BLOCK, block_size=16, max_num_seqs=32, max_model_len=256, num_kv_blocks=None,
                  memory_gb="auto", room=Headroom(1000 * MIB, "cgroup v1 limit 1200 MiB"), margin_bytes=100 * MIB,
                  share=0.8)
    return plan_kv_cache(**{**kwargs, **overrides})


def test_auto_sizes_by_need_when_the_limit_allows_and_by_the_limit_when_not():
    by_need = plan()
    assert (by_need.num_blocks, by_need.num_bytes) == (32 * 16, 32 * 16 * BLOCK)
    assert by_need.reason.startswith("what 32 sequences x 256 tokens can use; the cap was 720 MiB = 0.8 x (")
    by_limit = plan(max_num_seqs=4096)  # 4096 x 256 tokens would take 2 GiB
    assert by_limit.num_blocks == int(0.8 * 900 * MIB) // BLOCK
    assert "capped at 720 MiB = 0.8 x (1000 MiB left under the cgroup v1 limit 1200 MiB, less 100 MiB" in by_limit.reason


def test_a_pool_that_cannot_hold_one_full_sequence_is_refused_with_the_numbers():
    with pytest.raises(ValueError) as error:
        plan(max_model_len=40960, room=Headroom(150 * MIB, "cgroup v2 limit 600 MiB"))
    message = str(error.value)
    assert message == ("not enough memory for the KV cache: 20480 tokens (40 MiB) fit, capped at 40 MiB = 0.8 x "
                       "(150 MiB left under the cgroup v2 limit 600 MiB, less 100 MiB of measured step working "
                       "memory), but one --max-model-len 40960 sequence needs 40960 tokens (80 MiB); lower "
                       "--max-model-len, or give the server more memory")


def test_explicit_budgets_beyond_the_host_are_refused_and_num_kv_blocks_wins():
    with pytest.raises(ValueError, match=r"--kv-cache-memory-gb: 2 GiB is more than this host can back .*900 MiB"):
        plan(memory_gb=2.0)
    with pytest.raises(ValueError, match=r"--num-kv-blocks: 40000 blocks need 1250 MiB"):
        plan(num_kv_blocks=40000)
    assert plan(num_kv_blocks=10).num_blocks == 10
    assert plan(memory_gb=0.5).num_blocks == 32 * 16  # the need is still the cap
    assert plan(device_budget=(64 * BLOCK, "--gpu-memory-utilization 0.9"), room=None).num_blocks == 64


def test_process_metrics_agree_with_prometheus_client():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    if read_process() is None:
        pytest.skip("needs /proc")
    ours = {s.name: s.value for f in text_string_to_metric_families(render_process_metrics("rawserve:", "m", None))
            for s in f.samples}
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    theirs = {s.name: s.value for f in registry.collect() for s in f.samples}
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    assert ours["process_start_time_seconds"] == pytest.approx(theirs["process_start_time_seconds"], abs=0.02)
    assert ours["process_max_fds"] == theirs["process_max_fds"]
    assert ours["process_resident_memory_bytes"] == pytest.approx(theirs["process_resident_memory_bytes"], rel=0.1)
    assert ours["process_virtual_memory_bytes"] == pytest.approx(theirs["process_virtual_memory_bytes"], rel=0.1)
    assert abs(ours["process_open_fds"] - theirs["process_open_fds"]) <= 2
    assert 0 < ours["process_cpu_seconds_total"] <= theirs["process_cpu_seconds_total"] + 0.05


# ---- a container-sized server: a child cgroup of our own, with a memory limit -------------------------------

def child_cgroup(tmp_name: str, limit_bytes: int) -> tuple[pathlib.Path, str]:
    """A new cgroup under this process's own memory cgroup with `limit_bytes`; (its directory, the file that
    reports its peak). Skips when the machine does not let this test make one."""
    for version, directory, _ in memory.cgroup_dirs(pathlib.Path("/proc/self"), pathlib.Path("/")):
        child = directory / tmp_name
        try:
            child.mkdir()
        except OSError:
            continue
        try:
            if version == "v1":
                (child / "memory.limit_in_bytes").write_text(str(limit_bytes))
                return child, "memory.max_usage_in_bytes"
            (child / "memory.max").write_text(str(limit_bytes))
            (child / "memory.swap.max").write_text("0")
            return child, "memory.peak"
        except OSError:
            child.rmdir()
    pytest.skip("no writable memory cgroup here (a container without cgroup delegation)")


def container_checkpoint(root: pathlib.Path, dtype: str) -> pathlib.Path:
    """The tiny checkpoint of the llama.cpp comparison (2 layers, hidden 256, 152k vocabulary), with the demo
    model's tokenizer (ids past it are padding rows)."""
    from bench.checkpoints import QWEN3_TINY
    from rawserve.demo_model import ensure_demo_model, write_qwen3_checkpoint

    demo = ensure_demo_model()
    directory = write_qwen3_checkpoint(root / f"tiny-{dtype}", QWEN3_TINY, seed=0, dtype=dtype, bos_token_id=None,
                                       eos_token_id=2, generation_config={"eos_token_id": [2]})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, directory / name)
    return directory


def serve_in(cgroup: pathlib.Path, model_dir: pathlib.Path, *flags: str):
    from tests.test_cli import Server

    command = (f"echo $$ > {cgroup / 'cgroup.procs'} && exec {sys.executable} -m rawserve serve {model_dir} "
               f"--port 0 --engine-mode process --no-log-requests {' '.join(flags)}")
    return Server(["sh", "-c", command])


def stream(port: int, results: list, i: int) -> None:
    body = json.dumps({"prompt": f"story {i}: once upon a time", "max_tokens": 48, "stream": True,
                       "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        events = [json.loads(line[6:]) for line in response.read().decode().split("\n") if line.startswith("data: {")]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        results.append((response.status, finish, events[-1]["usage"]["completion_tokens"]))
    finally:
        conn.close()


def burst(port: int, streams: int = 32) -> list:
    """`streams` concurrent streams (see stream), to completion; their results."""
    results: list = []
    threads = [threading.Thread(target=stream, args=(port, results, i)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture
def cgroups():
    made = []
    yield made
    for directory in made:
        deadline = time.monotonic() + 10  # the core and multiprocessing's helper leave it just after the server
        while directory.exists():
            try:
                directory.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


LIMIT = 600 * MIB


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> pathlib.Path:
    """container_checkpoint in bfloat16, as ../shared/peers writes it for llama.cpp (4 s to write: written once,
    read by both servers below)."""
    return container_checkpoint(tmp_path_factory.mktemp("container"), "bfloat16")


def test_32_streams_complete_in_a_600_mib_cgroup(bf16_checkpoint, cgroups):
    cgroup, peak_file = child_cgroup(f"rawserve-test-{os.getpid()}-serve", LIMIT)
    cgroups.append(cgroup)
    model_dir = bf16_checkpoint
    with serve_in(cgroup, model_dir, "--max-num-seqs", "32", "--max-model-len", "256") as server:
        summary = next(line for line in server.lines if "listening on" in line and "serving" in line)
        # dtype auto: bf16 where the CPU has it natively, else float32 (16 MiB of KV for 32 x 256 tokens)
        kv_bytes = 8 * MIB if "dtype bfloat16" in summary else 16 * MIB
        kv_dtype = "bfloat16" if "dtype bfloat16" in summary else "float32"
        assert (f"KV cache 8192 tokens (512 blocks of 16, {kv_bytes / MIB:.1f} MiB, {kv_dtype}) [what 32 sequences x "
                "256 tokens "
                "can use") in summary, summary
        assert "cgroup" in summary, summary  # the limit the cap came from is this cgroup's
        assert burst(server.port) == [(200, ["length"], 48)] * 32
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert f'rawserve:kv_cache_bytes{{model_name="tiny-bfloat16"}} {kv_bytes}' in text
        core_rss = float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("rawserve:engine_core_resident_memory_bytes{")))
        assert 100 * MIB < core_rss < LIMIT
        assert server.proc.poll() is None
    if (cgroup / peak_file).exists():  # v2's memory.peak is Linux 5.19+
        peak = int((cgroup / peak_file).read_text())
        print(f"cgroup peak {peak / MIB:.0f} MiB of {LIMIT / MIB:.0f}")
        assert peak <= LIMIT


def test_a_limit_too_small_for_the_weights_is_refused_at_start_with_the_numbers(bf16_checkpoint, cgroups):
    cgroup, _ = child_cgroup(f"rawserve-test-{os.getpid()}-small", 300 * MIB)
    cgroups.append(cgroup)
    model_dir = bf16_checkpoint
    with pytest.raises(AssertionError) as error:
        serve_in(cgroup, model_dir, "--max-num-seqs", "32", "--max-model-len", "256")
    log = str(error.value)
    print(next(line for line in log.splitlines() if "the engine failed to start" in line))
    assert re.search(r"not enough memory for the weights: they need \d+ MiB as (bfloat16|float32) and a step about "
                     r"\d+ MiB more, and \d+ MiB is left under the cgroup v[12] limit 300 MiB", log), log
    assert "exited with code -9" not in log  # refused, not OOM-killed


def test_the_demo_model_gets_its_own_pool_defaults_unless_a_flag_or_the_environment_says_otherwise():
    from rawserve.config import EngineConfig, build_parser, configs_from_args
    from rawserve.demo_model import DEMO_SERVING_DEFAULTS, apply_demo_defaults

    config = EngineConfig()
    note = apply_demo_defaults(config, [])
    assert (config.max_num_seqs, config.max_model_len) == (32, 1024) == tuple(DEMO_SERVING_DEFAULTS.values())
    assert note.startswith("demo model: --max-num-seqs 32, --max-model-len 1024 by default") and "2 GiB" in note
    # 32 x 1024 tokens at the demo model's 2 KiB a token (4 layers x K,V x 2 heads x 32 x float32): 64 MiB
    assert plan(block_bytes=16 * 2048, max_num_seqs=32, max_model_len=1024).num_bytes == 64 * MIB
    argv = ["--max-num-seqs", "256"]
    config, _ = configs_from_args(build_parser(environ={"RAWSERVE_MAX_MODEL_LEN": "4096"}).parse_args(argv))
    assert apply_demo_defaults(config, argv) is None
    assert (config.max_num_seqs, config.max_model_len) == (256, 4096)
    config, _ = configs_from_args(build_parser(environ={}).parse_args(["--max-model-len=512"]))
    assert "--max-num-seqs 32 by" in apply_demo_defaults(config, ["--max-model-len=512"])
    assert (config.max_num_seqs, config.max_model_len) == (32, 512)


def test_mib_keeps_a_small_size_visible():
    # a tiny hybrid's state slot (0.39 MiB) read "512 state slots of 0 MiB = 201 MiB" in the startup line
    assert memory.mib(0.39 * MIB) == "0.39 MiB" and memory.mib(4 * MIB) == "4 MiB"
    assert memory.mib(9.5 * MIB) == "9.50 MiB" and memory.mib(12.4 * MIB) == "12 MiB" and memory.mib(0) == "0 MiB"
