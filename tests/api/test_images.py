"""Images through a live server (real sockets; the vision model's core spawned, as `rawserve serve` runs it): chat
image_url parts, Responses input_image and Messages image blocks, from data: URLs, a loopback http server and
file:// under the allowed directory; each placeholder expanded to the image's tokens (counted in usage); every bad
input a 400 in OpenAI's shape naming its part; a hostile batch leaving the server's memory where it was; the openai
SDK end to end. The tiny checkpoint's weights are random: the tests assert structure, placement and usage."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from rawserve.config import EngineConfig, ServerConfig
from rawserve.engine.mm_inputs import MultiModalInputs
from tests.api.demo_server import serve_demo
from tests.api.test_media import NOISE, bomb_png, encoded, image_routes, png, serve_images
from tests.api.test_openai_server import ServerThread, wait_idle

Image = pytest.importorskip("PIL.Image")

MODEL = "qwen35-vl-tiny"
IMAGE_PAD, VISION_START, VISION_END = 248056, 248053, 248054
LIMITS = dict(limit_mm_per_prompt="image=3", max_image_pixels=1_000_000, max_request_image_pixels=1_500_000,
              max_image_bytes=200_000, media_fetch_timeout_s=1.0)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "photo.png").write_bytes(png(100, 60, color=(5, 6, 7)))
    (root / "outside.png").write_bytes(png(10, 10))
    return root


@pytest.fixture(scope="module")
def images_base():
    with serve_images(image_routes(png(80, 40, color=(200, 100, 0)))) as base:
        yield base


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_root):
    from tests.checkpoints import make_qwen35_vl_checkpoint

    directory = make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35-vl"))
    srv = ServerThread(EngineConfig(model_dir=str(directory), device="cpu", dtype="float32", max_model_len=1024),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process",
                                    allowed_local_media_path=str(media_root / "allowed"), **LIMITS))
    yield srv
    srv.stop()


def post(server, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(server.base + path, json.dumps(body).encode(),
                                     {"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(server, *parts: dict, max_tokens: int = 3) -> tuple[int, dict]:
    """A chat whose second message holds `parts` after a text part (so an image at parts[1] is content.2)."""
    return post(server, "/v1/chat/completions", {"max_tokens": max_tokens, "messages": [
        {"role": "system", "content": "Describe images."},
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}]})


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def tokens_of(server, width: int, height: int) -> int:
    return server.app.context.images.rules.grid(height, width)[2]


def assert_refused(status: int, body: dict, param: str, code: str | None = None) -> None:
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def test_an_image_to_a_text_only_model_is_a_400_naming_the_part():
    for srv in serve_demo({}):
        status, body = chat(srv, {"type": "text", "text": "and"}, image_part(data_url(png(8, 8))))
        assert_refused(status, body, "messages.1.content.2", "images_unsupported")
        assert "no vision" in body["error"]["message"]
        assert chat(srv, {"type": "text", "text": "text only"})[0] == 200


def test_a_data_image_is_placed_and_counted(server):
    spied = []
    generate = server.app.llm.generate

    def spy(prompt_ids, params, request_id=None, *args, **kwargs):  # the real call, its arguments recorded
        spied.append((list(prompt_ids), kwargs.get("features")))
        return generate(prompt_ids, params, request_id, *args, **kwargs)

    server.app.llm.generate = spy
    try:
        status, body = chat(server, image_part(data_url(png(100, 60, color=(9, 9, 9))), detail="high"),
                            {"type": "text", "text": "and"}, image_part(data_url(encoded(NOISE, "JPEG"), "image/jpeg")))
        status_text, text_only = chat(server, {"type": "text", "text": "and"})
    finally:
        server.app.llm.generate = generate
    assert (status, status_text) == (200, 200), body
    sizes = [tokens_of(server, 100, 60), tokens_of(server, 64, 64)]
    # each image is <|vision_start|><|image_pad|> x its tokens <|vision_end|>; text-only has neither
    assert body["usage"]["prompt_tokens"] == text_only["usage"]["prompt_tokens"] + sum(sizes) + 2 * 2
    ids, features = spied[0]
    assert isinstance(features, MultiModalInputs) and spied[1][1] is None
    assert [(i.width, i.height, i.num_tokens) for i in features.images] == [(100, 60, sizes[0]), (64, 64, sizes[1])]
    assert ids.count(IMAGE_PAD) == sum(sizes)
    for image in features.images:
        assert ids[image.offset - 1] == VISION_START and ids[image.offset + image.num_tokens] == VISION_END
        assert set(ids[image.offset:image.offset + image.num_tokens]) == {IMAGE_PAD}
        assert len(image.rgb) == image.width * image.height * 3
    assert features.images[0].rgb[:3] == bytes((9, 9, 9))


def test_http_and_file_images(server, images_base, media_root):
    want = tokens_of(server, 80, 40)
    base_tokens = chat(server)[1]["usage"]["prompt_tokens"]
    for url, tokens in ((images_base + "/img.png", want), (images_base + "/redirect", want),
                        (images_base + "/chunked.png", want),
                        (f"file://{media_root}/allowed/photo.png", tokens_of(server, 100, 60))):
        status, body = chat(server, image_part(url))
        assert status == 200, (url, body)
        assert body["usage"]["prompt_tokens"] == base_tokens + tokens + 2, url


BAD = {
    "corrupt data": (lambda base, root: data_url(b"\x89PNG\r\n\x1a\nnot really"), "invalid_image"),
    "not an image": (lambda base, root: data_url(b"GIF? no, just text"), "invalid_image_format"),
    "truncated": (lambda base, root: data_url(encoded(NOISE, "PNG")[:600]), "invalid_image"),
    "unsupported format": (lambda base, root: data_url(encoded(Image.new("RGB", (4, 4)), "BMP"), "image/bmp"),
                           "invalid_image_format"),
    "not base64": (lambda base, root: "data:image/png;base64,%%%", "invalid_image_url"),
    "non-image data type": (lambda base, root: "data:text/html;base64,PGh0bWw+", "invalid_image_format"),
    "non-image URL": (lambda base, root: base + "/page", "invalid_image_format"),
    "fetch timeout": (lambda base, root: base + "/slow.png", "image_fetch_timeout"),
    "fetch too large": (lambda base, root: base + "/big.png", "image_too_large"),
    "fetch too large, chunked": (lambda base, root: base + "/big-chunked.png", "image_too_large"),
    "fetch 404": (lambda base, root: base + "/gone.png", "image_fetch_failed"),
    "redirect loop": (lambda base, root: base + "/loop", "image_fetch_failed"),
    "decompression bomb": (lambda base, root: data_url(bomb_png(60_000, 60_000)), "image_too_large"),
    "too many pixels": (lambda base, root: data_url(png(1200, 1000)), "image_too_large"),
    "aspect ratio": (lambda base, root: data_url(png(500, 2)), "invalid_image"),
    "file outside the allowed path": (lambda base, root: f"file://{root}/outside.png", "invalid_image_url"),
    "file through ..": (lambda base, root: f"file://{root}/allowed/../outside.png", "invalid_image_url"),
    "unknown scheme": (lambda base, root: "gopher://example.com/a.png", "invalid_image_url"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_bad_image_is_a_400_naming_its_part(server, images_base, media_root, case):
    make, code = BAD[case]
    status, body = chat(server, {"type": "text", "text": "and"}, image_part(make(images_base, media_root)))
    assert_refused(status, body, "messages.1.content.2", code)


def test_bad_parts_and_limits_are_400s(server, images_base):
    ok = image_part(data_url(png(8, 8)))
    status, body = chat(server, ok, ok, ok, ok)  # the limit is 3: the fourth is named
    assert_refused(status, body, "messages.1.content.4", "too_many_images")
    assert_refused(*chat(server, ok, image_part(data_url(png(8, 8)), detail="huge")),
                   "messages.1.content.2.image_url.detail", "invalid_value")
    assert_refused(*chat(server, {"type": "image_url", "image_url": "not an object"}),
                   "messages.1.content.1.image_url", "invalid_value")
    assert_refused(*chat(server, {"type": "input_audio", "input_audio": {}}), "messages.1.content.1")
    # each fits alone (900,000 and 700,000 pixels); together past the request's 1,500,000
    status, body = chat(server, image_part(data_url(png(1000, 900))), image_part(data_url(png(1000, 700))))
    assert_refused(status, body, "messages.1.content.2", "image_too_large")
    # placeholder text without an image would leave the core looking for one
    assert_refused(*chat(server, {"type": "text", "text": "<|image_pad|>"}), "messages")
    # two placeholders for one image: refused before the image is fetched (a fetch would time out first)
    status, body = chat(server, {"type": "text", "text": "<|image_pad|>"}, image_part(images_base + "/slow.png"))
    assert_refused(status, body, "messages")
    assert "2 image placeholder(s) for 1 image(s)" in body["error"]["message"]
    status, body = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(png(8, 8))}}]},
        {"role": "user", "content": "hi"}]})
    assert_refused(status, body, "messages")  # Qwen3.5's template refuses an image in the system message
    assert chat(server, ok)[0] == 200


def test_responses_input_image(server, images_base):
    status, body = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 3, "input": [
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is in"},
            {"type": "input_image", "image_url": images_base + "/img.png", "detail": "auto"}]}]})
    assert status == 200, body
    status, text_only = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 3, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in"}]}]})
    assert body["usage"]["input_tokens"] == text_only["usage"]["input_tokens"] + tokens_of(server, 80, 40) + 2
    # a follow-up turn carries the earlier image along
    status, follow = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 3,
                                                    "previous_response_id": body["id"], "input": "and now?"})
    assert status == 200 and follow["usage"]["input_tokens"] > body["usage"]["input_tokens"], follow
    for content, param, code in (
            ([{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": images_base + "/page"}],
             "input.0.content.1", "invalid_image_format"),
            ([{"type": "input_image", "file_id": "file-123"}], "input.0.content.0.file_id", None),
            ([{"type": "input_image"}], "input.0.content.0.image_url", "missing_required_parameter")):
        status, body = post(server, "/v1/responses", {"model": MODEL, "max_output_tokens": 3,
                                                      "input": [{"role": "user", "content": content}]})
        assert_refused(status, body, param, code)


def test_messages_image_blocks(server, images_base):
    b64 = base64.b64encode(png(100, 60)).decode()
    blocks = [{"type": "text", "text": "What is this?"},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
              {"type": "image", "source": {"type": "url", "url": images_base + "/img.png"}}]
    headers = {"anthropic-version": "2023-06-01"}
    status, body = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": blocks}]}, headers)
    assert status == 200, body
    status, counted = post(server, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": [{"role": "user", "content": blocks}]}, headers)
    status, text_only = post(server, "/v1/messages/count_tokens", {
        "model": MODEL, "messages": [{"role": "user", "content": blocks[:1]}]}, headers)
    images = tokens_of(server, 100, 60) + tokens_of(server, 80, 40) + 2 * 2
    assert counted["input_tokens"] == text_only["input_tokens"] + images == body["usage"]["input_tokens"]
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}
    for blocks_, param in (([{"type": "text", "text": "x"}, bad], "messages.0.content.1"),
                           ([{"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": b64}}],
                            "messages.0.content.0.source.media_type")):
        status, body = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": blocks_}]}, headers)
        assert status == 400 and body["type"] == "error", body  # Anthropic's error shape on this route
        assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"], body


def test_tokenize_counts_an_image_as_chat_does(server, images_base):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             image_part(data_url(png(100, 60, color=(3, 4, 5)))),
                                             image_part(images_base + "/img.png")]}]
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    status, answer = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": messages})
    assert status == 200, answer
    want = tokens_of(server, 100, 60) + tokens_of(server, 80, 40)
    assert body["count"] == len(body["tokens"]) == answer["usage"]["prompt_tokens"]
    assert body["tokens"].count(IMAGE_PAD) == want
    bad = [{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(data_url(b"not an image"))]}]
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": bad})
    assert_refused(status, body, "messages.0.content.1")


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return float(next(line for line in text.splitlines() if line.startswith(f"rawserve:{name}")).rsplit(" ", 1)[1])


def test_metrics_count_images_and_the_encoder(server):
    before = metric(server, 'mm_items_received_total{model_name="%s",modality="image"}' % MODEL)
    ok = image_part(data_url(png(8, 8, color=(1, 99, 7))))
    assert chat(server, ok, ok)[0] == 200
    assert chat(server, image_part("data:image/png;base64,AAAA"))[0] == 400  # refused: not counted
    assert metric(server, 'mm_items_received_total{model_name="%s",modality="image"}' % MODEL) == before + 2
    wait_idle(server)

    # the same image twice in one prompt: the core's encoder cache answers the second (its half of the counters)
    def counted() -> bool:
        return (metric(server, "mm_encoder_cache_misses_total") >= 1 and metric(server, "mm_encoder_cache_hits_total")
                >= 1 and metric(server, "mm_encoder_seconds_total") > 0)

    # the core's stats come with its next report (each step, and at least every second): polled, 1.5 s at most
    deadline = time.monotonic() + 1.5
    while not counted() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted()


def rss_kib() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_a_hostile_batch_leaves_memory_where_it_was(server, images_base, media_root):
    """Bombs, corrupt and oversized images, many at once: each a 400, the server (this process) no bigger after a
    batch than after the first one, and a good request still answered."""
    hostile = [data_url(bomb_png(60_000, 60_000)), data_url(encoded(NOISE, "PNG")[:600]), images_base + "/big.png",
               data_url(png(1200, 1000)), data_url(b"\0" * 150_000), images_base + "/page"]
    bodies = [[{"type": "text", "text": "x"}, image_part(url)] for url in hostile]
    # two images that decode (900,000 pixels each, 2.7 MB of RGB) before the second passes the request's budget
    bodies.append([image_part(data_url(png(1000, 900))), image_part(data_url(png(900, 1000)))])

    def batch() -> None:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda parts: chat(server, *parts), bodies * 4))
        assert {status for status, _ in results} == {400}, [body for status, body in results if status != 400]

    batch()  # the first batch sizes the allocator's arenas
    before = rss_kib()
    for _ in range(3):
        batch()
    after = rss_kib()
    print(f"server RSS after the first hostile batch {before / 1024:.0f} MiB, after three more {after / 1024:.0f} MiB")
    assert after - before < 24 * 1024, (before, after)
    assert chat(server, image_part(data_url(png(8, 8))))[0] == 200
    wait_idle(server)


def test_the_openai_sdk_end_to_end(server, images_base):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused")
    image = data_url(png(64, 64, color=(0, 128, 255)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What colour is this?"},
                                             {"type": "image_url", "image_url": {"url": image}}]}]
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    fetched = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": images_base + "/img.png"}}, {"type": "text", "text": "Describe."}]}])
    assert fetched.usage.prompt_tokens > tokens_of(server, 80, 40)
    stream = client.chat.completions.create(model=MODEL, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, messages=messages)
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    response = client.responses.create(model=MODEL, max_output_tokens=3, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is in this image?"},
        {"type": "input_image", "image_url": image, "detail": "auto"}]}])
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > tokens_of(server, 64, 64)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert caught.value.body["param"] == "messages.0.content.0"


def test_without_pillow_images_get_a_400_naming_the_extra_and_text_is_served(server, monkeypatch):
    from rawserve.api.media import decode as decode_module

    url = data_url(png(8, 8))
    decode_module.pillow.cache_clear()
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` fails, as without the vision extra
    try:
        status, body = chat(server, {"type": "text", "text": "and"}, image_part(url))
        assert_refused(status, body, "messages.1.content.2", "images_unsupported")
        assert 'pip install "rawserve[vision]"' in body["error"]["message"]
        assert chat(server, {"type": "text", "text": "text only"})[0] == 200
    finally:
        monkeypatch.undo()
        decode_module.pillow.cache_clear()
    assert chat(server, image_part(url))[0] == 200


def test_the_server_process_does_not_load_pillow_until_an_image_comes():
    code = "import sys, rawserve.__main__, rawserve.api.app; print('PIL' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False", out.stderr


def test_the_image_reaches_the_model(server):
    """Greedy, same text: another image changes what the model says (its first tokens' logprobs); the same image
    again gives the same (an encoder-cache and prefix-cache hit the second time)."""
    def first_logprobs(color) -> list[float]:
        status, body = post(server, "/v1/chat/completions", {
            "max_tokens": 3, "temperature": 0, "logprobs": True, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, image_part(data_url(png(64, 48, color=color)))]}]})
        assert status == 200, body
        return [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]

    red, blue, red_again = first_logprobs((255, 0, 0)), first_logprobs((0, 0, 255)), first_logprobs((255, 0, 0))
    assert red_again == pytest.approx(red, abs=1e-4)
    assert blue != pytest.approx(red, abs=1e-3)
