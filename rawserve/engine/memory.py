"""How much memory this process may still use: the cgroup (v2 or v1) memory limit less what the cgroup holds,
else the host's MemAvailable; and the process's own peak (VmHWM) for measuring a step's working margin.

Standard library only; reads /proc and the cgroup files, changes nothing but this process's VmHWM mark.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

MIB = 1 << 20
# cgroup v1 writes "no limit" as a huge page-aligned number (PAGE_COUNTER_MAX pages), not "max".
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class Headroom:
    """Bytes this process may still allocate, and why: `source` names the limit that binds."""
    available_bytes: int
    source: str
    limit_bytes: int | None = None  # the cgroup limit, when one binds
    used_bytes: int | None = None  # what the cgroup holds now (its working set: page cache it may drop excluded)


def mib(num_bytes: float) -> str:
    """Whole MiB, or two decimals under 10 MiB that are not 0 (a tiny model's state slot is 0.39 MiB, not "0")."""
    value = num_bytes / MIB
    return f"{value:.2f} MiB" if 0 < value < 10 and round(value) != value else f"{value:.0f} MiB"


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _stat_value(text: str | None, key: str) -> int:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _mounts(proc_self: pathlib.Path) -> list[tuple[str, str, str, str]]:
    """(root inside the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    out = []
    for line in (_read(proc_self / "mountinfo") or "").splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if sep and len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            out.append((fields[3], fields[4], rest[0], rest[2]))
    return out


def cgroup_dirs(proc_self: pathlib.Path, mount_prefix: pathlib.Path,
                controller: str = "memory") -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    """(version, this process's cgroup directory, the mount point) for `controller` (memory, cpu): v2's
    unified hierarchy, or v1's hierarchy of that controller."""
    found = []
    mounts = _mounts(proc_self)
    for line in (_read(proc_self / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            version, wanted = "v2", lambda fs, opts: fs == "cgroup2"
        elif controller in controllers.split(","):
            version, wanted = "v1", lambda fs, opts: fs == "cgroup" and controller in opts.split(",")
        else:
            continue
        for root, point, fs, opts in mounts:
            if not wanted(fs, opts):
                continue
            # A container sees its own cgroup as the mount's root: strip that prefix from the path.
            relative = path[len(root):] if root != "/" and path.startswith(root) else path
            base = mount_prefix / point.lstrip("/")
            found.append((version, base / relative.lstrip("/"), base))
            break
    return found


def _limit_and_usage(version: str, directory: pathlib.Path) -> tuple[int, int] | None:
    """(limit, working set) of one cgroup directory, or None when it sets no limit."""
    if version == "v2":
        raw = _read(directory / "memory.max")
        if raw is None or raw.strip() == "max":
            return None
        usage = int((_read(directory / "memory.current") or "0").strip() or 0)
        inactive = _stat_value(_read(directory / "memory.stat"), "inactive_file")
    else:
        raw = _read(directory / "memory.limit_in_bytes")
        if raw is None or int(raw.strip()) >= _V1_UNLIMITED:
            return None
        usage = int((_read(directory / "memory.usage_in_bytes") or "0").strip() or 0)
        inactive = _stat_value(_read(directory / "memory.stat"), "total_inactive_file")
    return int(raw.strip()), max(0, usage - inactive)


def cgroup_headroom(proc_self: pathlib.Path = pathlib.Path("/proc/self"),
                    mount_prefix: pathlib.Path = pathlib.Path("/")) -> Headroom | None:
    """The tightest cgroup memory limit over this process's cgroup and its ancestors (each binds), as the
    bytes left under it; None when no cgroup sets one."""
    best: Headroom | None = None
    for version, directory, top in cgroup_dirs(proc_self, mount_prefix):
        while True:
            found = _limit_and_usage(version, directory)
            if found is not None:
                limit, used = found
                left = max(0, limit - used)
                if best is None or left < best.available_bytes:
                    best = Headroom(left, f"cgroup {version} limit {mib(limit)} at {directory}, {mib(used)} in use",
                                    limit, used)
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return best


def host_available(proc: pathlib.Path = pathlib.Path("/proc")) -> Headroom:
    """The kernel's estimate of memory available without swapping (MemAvailable)."""
    text = _read(proc / "meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return Headroom(int(line.split()[1]) * 1024, f"host MemAvailable {mib(int(line.split()[1]) * 1024)}")
    raise OSError(f"{proc / 'meminfo'}: no MemAvailable")


def headroom(proc: pathlib.Path = pathlib.Path("/proc"), mount_prefix: pathlib.Path = pathlib.Path("/")) -> Headroom:
    """What this process may still allocate: the smaller of the cgroup's room and the host's."""
    host = host_available(proc)
    group = cgroup_headroom(proc / "self", mount_prefix)
    return group if group is not None and group.available_bytes < host.available_bytes else host


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False when it cannot be reset."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak (VmHWM), in bytes; 0 without /proc."""
    for line in (_read(pathlib.Path("/proc/self/status")) or "").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The KV pool's size and the sentence that says why (the startup line repeats it). A hybrid model's state
    slots (plan_kv_cache's state_bytes) come out of the same budget: num_bytes counts them too."""
    num_blocks: int
    num_bytes: int
    reason: str
    num_state_slots: int = 0  # running sequences' states: --max-num-seqs is bounded by this as well
    num_saved_states: int = 0  # the prefix cache's saved states (state_cache.StateCacheManager)
    state_bytes: int = 0  # one slot's bytes

    @property
    def kv_bytes(self) -> int:
        """The KV blocks' bytes alone, without the state slots (the startup line's figure; its reason adds them)."""
        return self.num_bytes - (self.num_state_slots + self.num_saved_states) * self.state_bytes


def kv_block_bytes(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one KV block over every layer, K and V, at the KV cache's storage dtype (--kv-cache-dtype:
    `element_bytes` is 1 for fp8, 2 for bf16/fp16, 4 for float32), not the activations'."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes


def plan_kv_cache(*, block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
                  num_kv_blocks: int | None, memory_gb: float | str, room: Headroom | None, margin_bytes: int,
                  share: float, device_budget: tuple[int, str] | None = None, state_bytes: int = 0,
                  save_states: bool = False) -> KVPlan:
    """Size the KV pool: the smaller of what max_num_seqs x max_model_len can use and the budget.

    The budget is, in order: --num-kv-blocks; a device budget (a GPU's --gpu-memory-utilization); a
    --kv-cache-memory-gb number (refused when `room` cannot back it); else auto, `share` of what is left in
    `room` after `margin_bytes` (a step's working memory), refused when it cannot hold one max_model_len
    sequence. Raises ValueError with the numbers.

    state_bytes: a hybrid model's fixed state per sequence (Qwen3.5's conv and recurrent states). The budget then
    holds --max-num-seqs running slots, and as many saved states for the prefix cache when `save_states`; when it
    cannot hold those and the KV of what they can use, the states get at most half of it (at least one running slot
    and, with `save_states`, one saved). The KV blocks get the rest.
    """
    blocks_per_seq = -(-max_model_len // block_size)
    need_blocks = max_num_seqs * blocks_per_seq
    need = f"what {max_num_seqs} sequences x {max_model_len} tokens can use"
    left = None if room is None else room.available_bytes - margin_bytes
    where = "" if room is None else (f"{mib(room.available_bytes)} left under the {room.source}, less "
                                     f"{mib(margin_bytes)} of measured step working memory")
    per_seq_states = 2 if save_states else 1
    if num_kv_blocks is not None:
        blocks, why = num_kv_blocks, "--num-kv-blocks"
        slots = per_seq_states * max_num_seqs if state_bytes else 0
        if left is not None and blocks * block_bytes + slots * state_bytes > left:
            raise ValueError(f"--num-kv-blocks: {blocks} blocks need {mib(blocks * block_bytes)}"
                             f"{f' and {slots} state slots {mib(slots * state_bytes)}' if slots else ''}, more than "
                             f"this host can back ({where}: {mib(max(left, 0))})")
        return _with_states(KVPlan(blocks, blocks * block_bytes, why), slots, state_bytes, save_states)
    if device_budget is not None:
        budget, why = device_budget
    elif memory_gb != "auto":
        budget, why = int(float(memory_gb) * (1 << 30)), f"--kv-cache-memory-gb {memory_gb:g}"
        if left is not None and budget > left:
            raise ValueError(f"--kv-cache-memory-gb: {memory_gb:g} GiB is more than this host can back "
                             f"({where}: {mib(max(left, 0))}); lower it, or use auto")
    else:
        assert left is not None, "auto sizing needs the memory headroom"
        budget = int(share * max(left, 0))
        why = f"{share:g} x ({where})"
    slots = 0
    if state_bytes:
        slots = per_seq_states * max_num_seqs
        if slots * state_bytes + need_blocks * block_bytes > budget:
            slots = min(slots, max(per_seq_states, budget // 2 // state_bytes))
        budget -= slots * state_bytes
        why = f"{why}, less the state slots"
    blocks = min(budget // block_bytes, need_blocks)
    if blocks == need_blocks:
        why = f"{need}; the cap was {mib(budget)} = {why}"
    else:
        why = f"capped at {mib(budget)} = {why}; {need} would be {mib(need_blocks * block_bytes)}"
    if blocks < blocks_per_seq:
        raise ValueError(
            f"not enough memory for the KV cache: {max(blocks, 0) * block_size} tokens "
            f"({mib(max(blocks, 0) * block_bytes)}) fit, {why.split('; ')[0]}, but one --max-model-len "
            f"{max_model_len} sequence needs {blocks_per_seq * block_size} tokens "
            f"({mib(blocks_per_seq * block_bytes)}); lower --max-model-len, or give the server more memory")
    return _with_states(KVPlan(blocks, blocks * block_bytes, why), slots, state_bytes, save_states)


def _with_states(plan: KVPlan, slots: int, state_bytes: int, save_states: bool) -> KVPlan:
    """The plan with its state slots split (running first, then saved) and said in its reason."""
    if not slots:
        return plan
    saved = slots // 2 if save_states else 0
    running = slots - saved
    why = (f"{plan.reason}; plus {slots} state slots of {mib(state_bytes)} ({running} running, {saved} saved for "
           f"the prefix cache) = {mib(slots * state_bytes)}")
    return KVPlan(plan.num_blocks, plan.num_bytes + slots * state_bytes, why, running, saved, state_bytes)
