"""LoRA through the server: --lora-modules, selection by model or lora, /v1/models' parents, load and unload at
run time (unloading one in use waits for its request), a bad directory's 400, unknown names' 404, and
lora_requests_info on /metrics."""
from __future__ import annotations

import json
import threading

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import MODEL, ServerThread, raw

openai = pytest.importorskip("openai")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from rawserve.demo_model import ensure_demo_model
    from tests.engine.test_lora import make_adapter

    base = ensure_demo_model()
    root = tmp_path_factory.mktemp("lora-api")
    return base, {"a": make_adapter(base, root / "a", 4, 8, ["q_proj", "v_proj"], seed=1),
                  "b": make_adapter(base, root / "b", 8, 16, ["o_proj", "down_proj", "up_proj"], seed=2)}


@pytest.fixture(scope="module")
def server(adapters):
    base, paths = adapters
    srv = ServerThread(EngineConfig(model_dir=str(base), device="cpu", num_kv_blocks=256, max_model_len=512,
                                    lora_modules=[f"a={paths['a']}"], max_loras=2, max_lora_rank=8),
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
    assert status == 400 and "adapter_config.json: file is missing" in body["error"]["message"]
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
