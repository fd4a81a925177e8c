"""Hostile adapter directories against the reader and the registry: only regular files are read, never more bytes
than the rank needs, runtime paths stay under --lora-root, and a stuck read times out without holding later loads."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest

from rawserve.config import EngineConfig, build_parser, configs_from_args
from rawserve.engine.loader import read_model_config
from rawserve.engine.lora import MAX_CONFIG_BYTES, LoraError, read_adapter, weight_limits
from rawserve.engine.lora_registry import LoraRefused
from tests.engine.test_core import make_core

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    from rawserve.demo_model import ensure_demo_model
    from tests.engine.test_lora import make_adapter

    base = ensure_demo_model()
    good = make_adapter(base, tmp_path_factory.mktemp("lora-good") / "good", 4, 8, ["q_proj", "v_proj"], seed=3)
    return base, good


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "root"
    path.mkdir()
    return path


def copy_adapter(src, dst):
    shutil.copytree(src, dst)
    return dst


def read(base, path, root=None, rank=8):
    return read_adapter("x", str(path), read_model_config(base), rank, root=None if root is None else str(root))


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory"])
@pytest.mark.parametrize("confined", [False, True])
def test_a_config_that_is_not_a_regular_file_is_refused_before_it_is_read(base_and_adapter, root, kind, confined):
    """/dev/zero once made the core read without end, and a FIFO hung the load for ever."""
    base, good = base_and_adapter
    adapter = copy_adapter(good, root / "bad")
    config = adapter / "adapter_config.json"
    config.unlink()
    if kind == "dev_zero":
        os.symlink("/dev/zero", config)
    elif kind == "fifo":
        os.mkfifo(config)
    else:
        config.mkdir()
    start = time.monotonic()
    # Under a root, /dev/zero is a symlink out of it; the operator's paths may follow symlinks, to regular files only.
    match = "outside --lora-root" if confined and kind == "dev_zero" else "not a regular file"
    with pytest.raises(LoraError, match=match):
        read(base, adapter, root if confined else None)
    assert time.monotonic() - start < 2


def test_an_oversized_config_is_refused(base_and_adapter, root):
    base, good = base_and_adapter
    adapter = copy_adapter(good, root / "big")
    conf = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(conf) + " " * MAX_CONFIG_BYTES)
    with pytest.raises(LoraError, match=f"at most {MAX_CONFIG_BYTES} are read"):
        read(base, adapter, root)


def test_weights_past_what_the_rank_needs_are_refused_unread(base_and_adapter, root):
    base, good = base_and_adapter
    cfg = read_model_config(base)
    _, max_header, max_file = weight_limits(cfg, 4)
    padded = copy_adapter(good, root / "padded")
    with open(padded / "adapter_model.safetensors", "ab") as f:
        f.truncate(max_file + 1)  # sparse: the test writes nothing big
    with pytest.raises(LoraError, match=f"at most {max_file} are read"):
        read(base, padded, root, rank=4)
    header = copy_adapter(good, root / "header")
    length = max_header + 1  # a header longer than any rank-4 adapter's, in a file under the size cap
    (header / "adapter_model.safetensors").write_bytes(length.to_bytes(8, "little") + b"{}" + b" " * (length - 2))
    with pytest.raises(LoraError, match=f"a safetensors header of {length} bytes; .* at most {max_header}"):
        read(base, header, root, rank=4)
    huge = copy_adapter(good, root / "huge")
    (huge / "adapter_model.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    with pytest.raises(LoraError, match="not a safetensors file"):
        read(base, huge, root, rank=4)
    dtype = copy_adapter(good, root / "dtype")
    body = json.dumps({"x": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (dtype / "adapter_model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + bytes(8))
    with pytest.raises(LoraError, match="dtype other than F32, F16, BF16"):
        read(base, dtype, root, rank=4)


def test_runtime_paths_must_resolve_under_the_root(base_and_adapter, root, tmp_path):
    base, good = base_and_adapter
    outside = copy_adapter(good, tmp_path / "outside")
    assert read(base, outside).rank == 4  # the operator's path: anywhere
    for path in ("/etc/shadow", "/root", "/", "..", "../outside", str(outside), "nul\x00byte"):
        with pytest.raises(LoraError, match="outside --lora-root|not a usable path"):
            read(base, path, root)
    os.symlink(outside, root / "escape")  # a directory symlink out of the root
    with pytest.raises(LoraError, match="outside --lora-root"):
        read(base, "escape", root)
    linked = root / "linked"  # a file symlink out of the root
    linked.mkdir()
    os.symlink(outside / "adapter_config.json", linked / "adapter_config.json")
    shutil.copy(outside / "adapter_model.safetensors", linked)
    with pytest.raises(LoraError, match="outside --lora-root"):
        read(base, linked, root)
    # A Hugging Face cache snapshot: the files are symlinks to blobs, inside the root. Relative paths start there.
    blobs, snapshot = root / "blobs", root / "snapshot"
    copy_adapter(good, blobs)
    snapshot.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        os.symlink(os.path.join("..", "blobs", name), snapshot / name)
    assert read(base, "snapshot", root).rank == 4
    assert read(base, str(snapshot), root).rank == 4
    with pytest.raises(LoraError, match="not a directory"):
        read(base, "missing", root)


def runtime_core(base, root, **options):
    return make_core(base, allow_runtime_lora_updating=True, lora_root=str(root), max_lora_rank=8, **options)


def wait_finished(registry, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        done = registry.finished_loads()
        if done:
            return done
        assert time.monotonic() < deadline, "no load finished"
        time.sleep(0.01)


def test_a_stuck_read_times_out_and_later_loads_do_not_wait_for_it(base_and_adapter, root, monkeypatch):
    """A read stuck in the kernel (a hung network disk) is faked here: it is the disk, outside the registry."""
    import rawserve.engine.lora_registry as registry_module
    from rawserve.engine.lora_registry import MAX_READS

    base, good = base_and_adapter
    copy_adapter(good, root / "good")
    real, release = registry_module.read_adapter, threading.Event()

    def read_adapter(name, *args, **kwargs):
        if name.startswith("stuck"):
            release.wait(60)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(registry_module, "read_adapter", read_adapter)
    core = runtime_core(base, root, lora_load_timeout_s=0.3)
    registry = core.loras
    try:
        start = time.monotonic()
        registry.start_load(1, "stuck", "good")
        token, error, code = wait_finished(registry)[0]
        assert (token, code) == (1, "timeout") and "took more than 0.3 s" in error
        assert 0.3 <= time.monotonic() - start < 5 and "stuck" not in registry
        registry.start_load(2, "good", "good")  # the stuck read still holds its thread, not this load
        assert wait_finished(registry) == [(2, None, None)] and "good" in registry
        for i in range(1, MAX_READS):
            registry.start_load(10 + i, f"stuck{i}", "good")
        with pytest.raises(LoraRefused, match="in progress") as refused:  # stuck reads are bounded
            registry.start_load(20, "more", "good")
        assert refused.value.code == "busy"
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while True:  # released, the stuck reads end; the timed-out one is dropped, never registered
        done = registry.finished_loads()
        if len(done) == MAX_READS - 1 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert "stuck" not in registry
    registry.start_load(21, "after", "good")
    assert wait_finished(registry) == [(21, None, None)]


def test_runtime_updates_need_their_own_opt_in_and_a_root(base_and_adapter, root):
    base, good = base_and_adapter
    copy_adapter(good, root / "good")
    core = make_core(base, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoraRefused, match="--allow-runtime-lora-updating") as refused:
        core.loras.start_load(1, "x", str(root / "good"))
    assert refused.value.code == "disabled"
    core.loras.load("x", str(root / "good"))  # the operator's own loads are not runtime updates
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating: needs --lora-root"):
        EngineConfig(allow_runtime_lora_updating=True)
    with pytest.raises(ValueError, match="--lora-root: .* is not a directory"):
        EngineConfig(allow_runtime_lora_updating=True, lora_root=str(root / "missing"))
    parser = build_parser(environ={"RAWSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", "RAWSERVE_LORA_ROOT": str(root)})
    engine, _ = configs_from_args(parser.parse_args(["--model", "m"]))
    assert engine.allow_runtime_lora_updating and engine.lora_root == str(root) and engine.lora_enabled
    engine, _ = configs_from_args(build_parser(environ={}).parse_args(
        ["--model", "m", "--allow-runtime-lora-updating", "--lora-root", str(root), "--lora-load-timeout-s", "2"]))
    assert engine.allow_runtime_lora_updating and engine.lora_load_timeout_s == 2
