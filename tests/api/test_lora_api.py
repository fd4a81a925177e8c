"""LoRA through the server: --lora-modules, selection by model or lora, /v1/models' parents, load and unload at
run time (unloading one in use waits for its request), a bad directory's 400, unknown names' 404, and
lora_requests_info on /metrics."""
from __future__ import annotations

import json
import threading

import pytest

from rawserve.api.admin import LORA_PATH_REFUSED
from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import MODEL, ServerThread, raw

openai = pytest.importorskip("openai")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from rawserve.demo_model import ensure_demo_model
    from tests.engine.test_lora import make_adapter

    base = ensure_demo_model()
    root = tmp_path_factory.mktemp("lora-api")  # the servers' --lora-root
    return base, {"a": make_adapter(base, root / "a", 4, 8, ["q_proj", "v_proj"], seed=1),
                  "b": make_adapter(base, root / "b", 8, 16, ["o_proj", "down_proj", "up_proj"], seed=2)}


@pytest.fixture(scope="module")
def server(adapters):
    base, paths = adapters
    srv = ServerThread(EngineConfig(model_dir=str(base), device="cpu", num_kv_blocks=256, max_model_len=512,
                                    lora_modules=[f"a={paths['a']}"], max_loras=2, max_lora_rank=8,
                                    allow_runtime_lora_updating=True, lora_root=str(paths["a"].parent)),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[]))
    yield srv
    srv.stop()


def post(server, path, body) -> tuple[int, dict | str]:
    status, payload = raw(server, "POST", path, json.dumps(body).encode(), "content-type: application/json\r\n")
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def complete(server, **fields):
    return post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 8, "temperature": 0,
                                           "ignore_eos": True, **fields})


def test_select_list_load_unload(server, adapters):
    _, paths = adapters
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "a"} and cards["a"].parent == MODEL and cards[MODEL].parent is None
    base = complete(server)[1]["choices"][0]["text"]
    status, by_model = complete(server, model="a")
    assert status == 200 and by_model["model"] == "a"
    assert by_model["choices"][0]["text"] != base
    assert complete(server, lora="a")[1]["choices"][0]["text"] == by_model["choices"][0]["text"]
    status, resp = post(server, "/v1/responses", {"model": "a", "input": "hi", "max_output_tokens": 4})
    assert status == 200 and resp["model"] == "a"
    status, body = complete(server, model="nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = complete(server, lora="nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"

    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(paths["b"])})
    assert status == 200, body
    assert "b" in {m.id for m in client.models.list().data}
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "b"
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(paths["b"])})
    assert status == 400 and "already been loaded" in body["error"]["message"]
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(paths["b"].parent)})
    assert status == 400 and body["error"]["message"] == LORA_PATH_REFUSED
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200, body
    assert complete(server, model="b")[0] == 404
    status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_unload_in_use_waits_and_metrics(server):
    status, page = raw(server, "GET", "/metrics")
    assert b"lora_requests_info{max_lora=\"2\"" in page
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    expected = complete(server, model="a", prompt="hello", max_tokens=200)[1]["choices"][0]["text"]
    stream = client.completions.create(model="a", prompt="hello", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the request is running on a
    assert first.model == "a"
    status, _ = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert status == 200
    assert complete(server, model="a")[0] == 404  # refused at once for new requests
    text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == expected  # the request in flight ran to its end on the adapter
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": server.app.engine_config
                                                          .lora_paths()["a"]})
    assert status == 200, body


@pytest.fixture
def gated_reads(monkeypatch):
    """Adapter reads that wait for `gate` (the real read follows): what a large adapter on a slow disk does."""
    import rawserve.engine.lora_registry as registry_module

    real, gate, started = registry_module.read_adapter, threading.Event(), threading.Event()

    def read_adapter(*args, **kwargs):
        started.set()
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_module, "read_adapter", read_adapter)
    yield gate, started
    gate.set()


def test_requests_run_while_an_adapter_is_read(server, adapters, gated_reads):
    gate, started = gated_reads
    _, paths = adapters
    answer = {}
    loader = threading.Thread(target=lambda: answer.update(
        zip(("status", "body"), post(server, "/v1/load_lora_adapter", {"lora_name": "slow", "lora_path": str(paths["b"])}))))
    loader.start()
    assert started.wait(30)
    status, body = complete(server, model="a", max_tokens=12)  # the core steps on while the read waits
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "slow", "lora_path": str(paths["b"])})
    assert status == 400 and "being loaded" in body["error"]["message"]
    assert loader.is_alive() and complete(server, model="slow")[0] == 404  # not listed before it is read
    gate.set()
    loader.join(30)
    assert answer["status"] == 200, answer
    assert complete(server, model="slow")[0] == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "slow"})[0] == 200


def test_a_client_leaving_mid_load_still_gets_the_adapter_listed(server, adapters, gated_reads):
    """The load goes on when its client leaves (the handler is shielded), and the server lists what the core has."""
    import socket
    import time

    gate, started = gated_reads
    _, paths = adapters
    body = json.dumps({"lora_name": "left", "lora_path": str(paths["b"])}).encode()
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/load_lora_adapter HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        assert started.wait(30)
    time.sleep(0.5)  # the server sees the EOF and cancels the handler while the core is still reading
    gate.set()
    deadline = time.monotonic() + 30
    while "left" not in server.app.context.loras:
        assert time.monotonic() < deadline, "a load whose client left was never listed"
        time.sleep(0.05)
    assert complete(server, model="left")[0] == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "left"})[0] == 200


def test_load_and_use_at_run_time_with_the_core_in_its_own_process(server, adapters):
    """The same adapter loaded at run time into a spawned core answers as the thread-mode server's does."""
    base, paths = adapters
    spawned = ServerThread(EngineConfig(model_dir=str(base), device="cpu", num_kv_blocks=128, max_model_len=512,
                                        allow_runtime_lora_updating=True, lora_root=str(paths["a"].parent),
                                        max_loras=1, max_lora_rank=8),
                           ServerConfig(port=0, served_model_name=MODEL, engine_mode="process", api_key=[]))
    try:
        assert spawned.app.llm.info["pid"] != server.app.llm.info["pid"]
        for path in (str(paths["b"].parent), "/etc/shadow", "/root", "/dev/zero"):
            status, body = post(spawned, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path})
            assert status == 400 and body["error"]["message"] == LORA_PATH_REFUSED, path
        assert post(spawned, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"})[0] == 200  # relative
        here, there = complete(server, model="a"), complete(spawned, model="a")
        assert there[0] == 200 and there[1]["choices"][0]["text"] == here[1]["choices"][0]["text"]
    finally:
        spawned.stop()


def test_the_prefix_cache_is_keyed_by_adapter_through_the_api(server):
    """The same prompt on the base model, then on an adapter: no blocks shared; the adapter again: cached."""
    long_prompt = "the adapter cache key " * 40  # several full KV blocks

    def cached(model):
        status, body = complete(server, model=model, prompt=long_prompt, max_tokens=2)
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(MODEL)
    assert cached(MODEL) > 0  # the base model hits its own blocks
    assert cached("a") == 0  # the adapter's KV differs: it never reads the base model's blocks
    assert cached("a") > 0


def _hostile_paths(root, good, outside):
    """Adapter paths a hostile client may send, each built under (or pointing out of) the --lora-root `root`."""
    import os
    import shutil

    def adapter(name):
        path = root / name
        if not path.exists():
            shutil.copytree(good, path)
        return path

    zero = adapter("h-zero")  # its config a symlink to /dev/zero: once read without end
    if not (zero / "adapter_config.json").is_symlink():
        (zero / "adapter_config.json").unlink()
        os.symlink("/dev/zero", zero / "adapter_config.json")
    fifo = adapter("h-fifo")  # its config a FIFO: once a load (and every later one) hung for ever
    if not (fifo / "adapter_config.json").is_fifo():
        (fifo / "adapter_config.json").unlink()
        os.mkfifo(fifo / "adapter_config.json")
    big = adapter("h-bigconf")
    (big / "adapter_config.json").write_text((good / "adapter_config.json").read_text() + " " * (2 << 20))
    padded = adapter("h-bigweights")
    with open(padded / "adapter_model.safetensors", "ab") as f:
        f.truncate(64 << 20)  # sparse
    header = adapter("h-header")
    length = 40_000  # over the header a rank-4 adapter of the demo model can need, in a file under the size cap
    (header / "adapter_model.safetensors").write_bytes(length.to_bytes(8, "little") + b"{}" + b" " * (length - 2))
    if not (root / "h-escape").is_symlink():
        os.symlink("/etc", root / "h-escape")
    linked = adapter("h-linkout")  # its config a symlink to a valid one outside the root
    if not (linked / "adapter_config.json").is_symlink():
        (linked / "adapter_config.json").unlink()
        os.symlink(outside / "adapter_config.json", linked / "adapter_config.json")
    return ["/etc/shadow", "/root", "/root/", "/etc/passwd", "/dev/zero", "../../../etc", "h-escape", "h-escape/ssh",
            "h-missing", str(root), "h-zero", str(zero), "h-fifo", "h-bigconf", "h-bigweights", "h-header",
            "h-linkout", str(outside), "nul\u0000byte"]


def test_hostile_paths_all_get_one_generic_400_and_a_later_load_works(server, adapters, tmp_path, caplog):
    import logging
    import shutil
    import time

    _, paths = adapters
    root = paths["a"].parent
    outside = tmp_path / "outside"
    shutil.copytree(paths["a"], outside)
    caplog.set_level(logging.WARNING, "rawserve")
    bodies = {}
    start = time.monotonic()
    for path in _hostile_paths(root, paths["a"], outside):
        status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "h", "lora_path": path})
        assert status == 400, (path, body)
        bodies[path] = body
    assert time.monotonic() - start < 30  # no read without end, no FIFO wait
    assert all(body == {"error": {"message": LORA_PATH_REFUSED, "type": "invalid_request_error", "param": "lora_path",
                                  "code": None}} for body in bodies.values()), bodies
    reasons = "\n".join(r.getMessage() for r in caplog.records if r.name == "rawserve.api.lora")
    for reason in ("outside --lora-root", "not a regular file", "are read for this file", "file is missing",
                   "a safetensors header of"):
        assert reason in reasons  # the operator is told why
    assert "h" not in server.app.context.loras
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "h", "lora_path": "b"})  # relative: root/b
    assert status == 200, body
    assert complete(server, model="h")[0] == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "h"})[0] == 200


def test_the_load_routes_are_closed_without_the_opt_in(adapters):
    base, paths = adapters
    srv = ServerThread(EngineConfig(model_dir=str(base), device="cpu", num_kv_blocks=64, max_model_len=256,
                                    enable_lora=True, lora_modules=[f"a={paths['a']}"], max_lora_rank=8,
                                    lora_root=str(paths["a"].parent)),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="thread", api_key=[]))
    try:
        for route, body in (("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(paths["b"])}),
                            ("/v1/unload_lora_adapter", {"lora_name": "a"})):
            status, answer = post(srv, route, body)
            assert status == 404 and answer["error"]["code"] == "not_found", answer
            assert answer["error"]["message"] == f"Invalid URL (POST {route})."
        assert complete(srv, model="a")[0] == 200  # the operator's --lora-modules still serve
        assert complete(srv, model="b")[0] == 404
    finally:
        srv.stop()


def test_a_client_leaving_a_failing_load_logs_no_500_and_no_unretrieved_exception(server, adapters, gated_reads,
                                                                                   caplog):
    import gc
    import logging
    import socket
    import time

    gate, started = gated_reads
    _, paths = adapters
    caplog.set_level(logging.INFO)
    body = json.dumps({"lora_name": "gone", "lora_path": "no-such-adapter"}).encode()
    with socket.create_connection(("127.0.0.1", server.app.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/load_lora_adapter HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        assert started.wait(30)
    time.sleep(0.5)  # the server sees the EOF and cancels the handler while the core is still reading
    gate.set()
    deadline = time.monotonic() + 30
    while not any("loading adapter 'gone'" in r.getMessage() or "never retrieved" in r.getMessage()
                  for r in caplog.records):
        assert time.monotonic() < deadline, "the failed load was never logged"
        gc.collect()  # an unretrieved task exception is reported when the task is collected
        time.sleep(0.05)
    gc.collect()
    server.call(asyncio_sleep())  # and the loop has run its callbacks
    messages = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert not [m for m in messages if "never retrieved" in m[2] or m[1] >= logging.ERROR], messages
    access = [m[2] for m in messages if m[0] == "rawserve.access" and "load_lora_adapter" in m[2]]
    assert access and all('" 500' not in line for line in access) and '" 499' in access[-1], access
    assert "gone" not in server.app.context.loras


async def asyncio_sleep():
    import asyncio

    await asyncio.sleep(0.05)
