"""The engine's thread sizing: the CPU budget from affinity and cgroup quotas (fake cgroup files), the thread
plan and the OpenMP environment, and a real spawned core that runs with it and sleeps when idle."""
from __future__ import annotations

import asyncio
import os
import pathlib
import re
import sys

import pytest

from rawserve.config import EngineConfig, build_parser, configs_from_args
from rawserve.engine.cpu_budget import CpuBudget, auto_threads, cgroup_cpu_quota, cpu_budget, plan_threads
from rawserve.engine.frontend.async_llm import AsyncLLM
from rawserve.engine.launch import CoreFactory
from rawserve.engine.types import SamplingParams
from tests.engine.test_async_llm import byte_tokenizer, collect
from tests.test_memory import fake_cgroups, write


def test_cgroup_v2_quota_binds_from_an_ancestor_and_is_rounded_down(tmp_path):
    proc_self = fake_cgroups(tmp_path, "v2", "/kubepods/pod1/ctr")
    leaf = tmp_path / "sys/fs/cgroup/kubepods/pod1/ctr"
    write(leaf, cpu__max="max 100000\n")
    write(leaf.parent, cpu__max="250000 100000\n")  # the pod: 2.5 CPUs
    write(leaf.parent.parent, cpu__max="max 100000\n")
    assert cgroup_cpu_quota(proc_self, tmp_path)[0] == 2.5
    budget = cpu_budget(proc_self, tmp_path, affinity=8)
    assert (budget.cpus, budget.affinity, budget.quota) == (2, 8, 2.5)
    assert "cgroup v2 CPU quota 2.5" in budget.source and "rounded down to 2" in budget.source
    write(leaf, cpu__max="150000 100000\n")  # tighter than the pod: the container's own 1.5 binds
    assert cpu_budget(proc_self, tmp_path, affinity=8).cpus == 1


def test_cgroup_v1_cfs_quota_under_a_container_root(tmp_path):
    # v1's cpu hierarchy mounted with the container's cgroup as its root, as docker shows it.
    proc_self = tmp_path / "proc" / "self"
    proc_self.mkdir(parents=True)
    (proc_self / "cgroup").write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    (proc_self / "mountinfo").write_text(
        "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n")
    top = tmp_path / "sys/fs/cgroup/cpu,cpuacct"
    write(top, cpu__cfs_quota_us="-1\n", cpu__cfs_period_us="100000\n")
    assert cpu_budget(proc_self, tmp_path, affinity=6) == CpuBudget(6, 6, None, "6 CPUs in the affinity mask")
    write(top, cpu__cfs_quota_us="50000\n", cpu__cfs_period_us="100000\n")  # half a CPU: still one thread
    assert cpu_budget(proc_self, tmp_path, affinity=6).cpus == 1
    write(top, cpu__cfs_quota_us="1600000\n")  # 16 CPUs of quota on 6 CPUs of affinity: the affinity binds
    budget = cpu_budget(proc_self, tmp_path, affinity=6)
    assert (budget.cpus, budget.quota) == (6, 16.0) and "affinity mask (under the cgroup v1 CPU quota 16" in budget.source


def test_no_cgroup_files_means_the_affinity_mask():
    budget = cpu_budget()
    assert budget.cpus == len(os.sched_getaffinity(0)) or budget.quota is not None


def test_auto_leaves_one_cpu_to_the_front_process_only_above_four():
    assert [auto_threads(n) for n in (1, 2, 4, 5, 16)] == [1, 2, 4, 4, 15]
    plan = plan_threads("auto", {}, CpuBudget(8, 8, None, "8 CPUs in the affinity mask"))
    assert plan.num_threads == 7 and "one left to the front process" in plan.reason
    assert plan.env == {"OMP_NUM_THREADS": "7", "GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "0"}


def test_the_users_openmp_settings_are_respected_and_the_flag_wins():
    budget = CpuBudget(2, 2, None, "2 CPUs in the affinity mask")
    plan = plan_threads("auto", {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "5"}, budget)
    assert plan.num_threads == 3 and plan.reason.startswith("OMP_NUM_THREADS=3 from the environment")
    assert plan.env == {"OMP_NUM_THREADS": "3"}  # no wait policy over the user's spin count
    assert "OpenMP waits as the environment says (GOMP_SPINCOUNT=1000)" in plan.reason
    plan = plan_threads(1, {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}, budget)
    assert (plan.num_threads, plan.env["OMP_NUM_THREADS"]) == (1, "1") and "GOMP_SPINCOUNT" not in plan.env
    assert plan_threads("auto", {"OMP_NUM_THREADS": "junk"}, budget).num_threads == 2  # not a count: ignored


def test_num_threads_flag_and_environment_variable():
    engine, _ = configs_from_args(build_parser(environ={"RAWSERVE_NUM_THREADS": "3"}).parse_args([]))
    assert engine.num_threads == 3
    engine, _ = configs_from_args(build_parser(environ={"RAWSERVE_NUM_THREADS": "3"}).parse_args(
        ["--num-threads", "auto"]))
    assert engine.num_threads == "auto"
    with pytest.raises(ValueError, match="--num-threads: must be >= 1"):
        EngineConfig(num_threads=0)
    with pytest.raises(ValueError, match="--num-threads: must be auto or a number"):
        EngineConfig(num_threads="many")


def stat_fields(path: pathlib.Path) -> list[str]:
    """/proc/.../stat's fields after the command name: [0] the state, [11] utime, [12] stime."""
    return path.read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    fields = stat_fields(pathlib.Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def runnable_share(pid: int, seconds: float, interval_s: float = 0.02) -> float:
    """The share of samples in which some thread of `pid` was running or runnable (R). Unlike CPU time this
    does not shrink when neighbours crowd the CPUs: a spinning thread is R whether or not it gets a CPU."""
    samples = busy = 0
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        states = []
        for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(stat_fields(task / "stat")[0])
            except OSError:  # the thread ended between the listing and the read
                pass
        samples += 1
        busy += "R" in states
        await asyncio.sleep(interval_s)
    return busy / samples


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
async def test_spawned_core_runs_on_its_plan_and_sleeps_when_idle(tiny_qwen3_dir):
    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", max_model_len=256, num_kv_blocks=32,
                          num_threads=2)
    before = dict(os.environ)
    llm = AsyncLLM(CoreFactory(config), byte_tokenizer(), mode="process")
    await llm.start()
    try:
        pid = llm.info["pid"]
        assert os.environ == before  # the spawned core's environment was set for it alone
        assert llm.info["num_threads"] == 2 and llm.info["threads_reason"].startswith("--num-threads 2")
        environ = dict(item.split("=", 1) for item in
                       pathlib.Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        assert environ["OMP_NUM_THREADS"] == "2"
        if "OMP_WAIT_POLICY" not in before and "GOMP_SPINCOUNT" not in before:
            assert environ["GOMP_SPINCOUNT"] == "30000"
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = await collect(llm.generate([1, 2, 3], params))
        assert outs[-1].finish_reason == "length"
        await asyncio.sleep(0.3)  # the step's threads go quiet; the loop goes back to its blocking wait
        used = cpu_seconds(pid)
        # Idle, it wakes once a second for its heartbeat. A loop polling without blocking, or OpenMP threads
        # spinning, would be runnable in nearly every sample and burn what CPU it gets.
        share = await runnable_share(pid, 1.2)
        assert share < 0.2, f"an idle engine core was runnable in {share:.0%} of samples"
        assert cpu_seconds(pid) - used < 0.1, "an idle engine core used CPU"
    finally:
        await llm.stop(2)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2 or "OMP_NUM_THREADS" in os.environ,
                    reason="sized for auto's two threads on two CPUs")
async def test_spawned_core_drops_to_one_thread_beside_two_busy_processes(tiny_qwen3_dir):
    config = EngineConfig(model_dir=str(tiny_qwen3_dir), device="cpu", max_model_len=512, num_kv_blocks=64)
    llm = AsyncLLM(CoreFactory(config), byte_tokenizer(), mode="process")
    await llm.start()
    busy = [await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass") for _ in range(2)]
    try:
        assert llm.info["num_threads"] == 2 and "fewer while other processes" in llm.info["threads_reason"]
        seen = set()

        async def watch() -> None:
            while True:
                seen.add(re.search(r"^rawserve:engine_threads\{[^}]*\} (\d+)", llm.render_metrics(), re.M).group(1))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        outs = await collect(llm.generate([1, 2, 3], params))
        await asyncio.sleep(1.2)  # the heartbeat's stats after the last step
        watcher.cancel()
        assert outs[-1].finish_reason == "length"
        assert "1" in seen, f"engine threads seen beside two busy processes: {sorted(seen)}"
    finally:
        for proc in busy:
            proc.kill()
            await proc.wait()
        await llm.stop(2)
