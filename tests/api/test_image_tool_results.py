"""Through a live server (real sockets, the vision model's core spawned) started with --mm-processor-kwargs: images
inside Anthropic tool_result blocks render where the template puts a tool message's image parts (Qwen3.5's: inside
its <tool_response>) and count in usage, a bad one is a 400 naming its path inside the block; the lowered
max_pixels sizes an image as transformers' processor does with it, fewer tokens than the checkpoint's bound."""
from __future__ import annotations

import base64

import pytest

from rawserve.api.media import ImageProcessorRules
from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_images import IMAGE_PAD, VISION_END, VISION_START, data_url, post
from tests.api.test_media import png
from tests.api.test_openai_server import ServerThread

Image = pytest.importorskip("PIL.Image")

MODEL = "qwen35-vl-tiny"
MAX_PIXELS = 96 * 96  # the checkpoint's processor publishes 192 * 192
ANTHROPIC = {"anthropic-version": "2023-06-01"}
TOOL = {"name": "screenshot", "description": "Take a screenshot.", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.checkpoints import make_qwen35_vl_checkpoint

    directory = make_qwen35_vl_checkpoint(tmp_path_factory.mktemp("qwen35-vl"))
    srv = ServerThread(EngineConfig(model_dir=str(directory), device="cpu", dtype="float32", max_model_len=1024,
                                    mm_processor_kwargs=f'{{"max_pixels": {MAX_PIXELS}}}'),
                       ServerConfig(port=0, served_model_name=MODEL, engine_mode="process"))
    srv.directory = directory
    yield srv
    srv.stop()


class Spy:
    """Records the prompt ids and features of each request the server hands the engine (the real call runs)."""

    def __init__(self, server) -> None:
        self.server, self.calls = server, []

    def __enter__(self) -> list:
        llm = self.server.app.llm
        self.generate = llm.generate

        def spy(prompt_ids, params, request_id=None, *args, **kwargs):
            self.calls.append((list(prompt_ids), kwargs.get("features")))
            return self.generate(prompt_ids, params, request_id, *args, **kwargs)

        llm.generate = spy
        return self.calls

    def __exit__(self, *exc) -> None:
        self.server.app.llm.generate = self.generate


def prompt_tokens(body: dict) -> int:
    """Anthropic's input_tokens leave out the tokens read from the (prefix) cache."""
    return body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


def image_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def turns(result_content) -> list[dict]:
    return [{"role": "user", "content": "Show me the screen."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result_content},
                                         {"type": "text", "text": "What do you see?"}]}]


def messages(server, result_content, path: str = "/v1/messages") -> tuple[int, dict]:
    body = {"model": MODEL, "messages": turns(result_content), "tools": [TOOL], "thinking": {"type": "disabled"}}
    if path == "/v1/messages":
        body["max_tokens"] = 2
    return post(server, path, body, ANTHROPIC)


def test_an_image_in_a_tool_result_renders_inside_the_tool_response_and_counts(server):
    tokens = server.app.context.images.rules.grid(60, 100)[2]
    with Spy(server) as calls:
        status, body = messages(server, [{"type": "text", "text": "Here it is:"}, image_block(png(100, 60))])
        status_text, text_only = messages(server, [{"type": "text", "text": "Here it is:"}])
    assert (status, status_text) == (200, 200), body
    ids, features = calls[0]
    assert prompt_tokens(body) == len(ids) and prompt_tokens(text_only) == len(calls[1][0])
    assert calls[1][1] is None and len(features.images) == 1 and features.images[0].num_tokens == tokens
    decode = server.app.context.tokenizer.decode
    image = features.images[0]
    assert ids[image.offset - 1] == VISION_START and ids[image.offset + tokens] == VISION_END
    assert ids.count(IMAGE_PAD) == tokens
    before, after = decode(ids[:image.offset - 1]), decode(ids[image.offset + tokens + 1:])
    # Qwen3.5's template: the tool's output, image and all, inside <tool_response> in a user turn
    assert before.endswith("<tool_response>\nHere it is:")
    assert after.startswith("\n</tool_response>")
    status, counted = messages(server, [{"type": "text", "text": "Here it is:"}, image_block(png(100, 60))],
                               "/v1/messages/count_tokens")
    assert status == 200 and counted["input_tokens"] == prompt_tokens(body), counted


def test_images_before_and_inside_a_tool_result_keep_their_order_and_paths(server):
    first, second = png(64, 64, color=(1, 2, 3)), png(200, 120, color=(4, 5, 6))
    conversation = turns([image_block(second)])
    conversation[0] = {"role": "user", "content": [{"type": "text", "text": "Look:"}, image_block(first)]}
    with Spy(server) as calls:
        status, body = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": conversation,
                                                     "tools": [TOOL]}, ANTHROPIC)
    assert status == 200, body
    sizes = [(image.width, image.height) for image in calls[0][1].images]
    assert sizes == [(64, 64), (200, 120)]
    bad = turns([{"type": "text", "text": "x"}, {"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not a png").decode()}}])
    status, body = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": bad}, ANTHROPIC)
    assert status == 400 and body["type"] == "error", body  # Anthropic's shape on this route
    assert "messages.2.content.0.content.1" in body["error"]["message"], body
    status, body = messages(server, [{"type": "document", "source": {}}])
    assert status == 400 and "messages.2.content.0.content.0.type" in body["error"]["message"], body
    assert "text and image blocks in a tool_result" in body["error"]["message"]


def test_an_image_in_a_chat_tool_message_renders_as_well(server):
    tokens = server.app.context.images.rules.grid(60, 100)[2]
    chat = [{"role": "user", "content": "Show me the screen."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "screenshot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": "Here it is:"},
                {"type": "image_url", "image_url": {"url": data_url(png(100, 60))}}]}]
    with Spy(server) as calls:
        status, body = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": chat})
    assert status == 200, body
    ids, features = calls[0]
    assert body["usage"]["prompt_tokens"] == len(ids) and ids.count(IMAGE_PAD) == tokens
    assert "<tool_response>\nHere it is:<|vision_start|><|image_pad|>" in server.app.context.tokenizer.decode(ids)


def test_max_pixels_sizes_images_as_transformers_does_with_it(server):
    from tests.checkpoints import hf_image_processor

    picture = Image.new("RGB", (300, 200), (30, 60, 90))
    published = ImageProcessorRules.from_dir(server.directory).grid(200, 300)[2]
    rules = server.app.context.images.rules
    out = hf_image_processor(server.directory)(images=[picture], return_tensors="pt", size={
        "longest_edge": MAX_PIXELS, "shortest_edge": rules.min_pixels})
    want = int(out["image_grid_thw"].prod()) // 4
    assert want < published
    url = data_url(png(300, 200, color=(30, 60, 90)))
    with Spy(server) as calls:
        status, body = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    assert status == 200, body
    image = calls[0][1].images[0]
    assert image.num_tokens == want == calls[0][0].count(IMAGE_PAD)
    _, gh, gw = out["image_grid_thw"][0].tolist()
    assert (image.resized_height, image.resized_width) == (gh * 16, gw * 16)
    status, bare = post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}]}]})
    assert body["usage"]["prompt_tokens"] == bare["usage"]["prompt_tokens"] + want + 2
