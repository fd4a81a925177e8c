"""Unit tests of the server's image reading (api/media): the processor's resize grid against transformers' own
on many sizes, the checkpoint's rules from its files, data: URLs, file:// under the allowed directory, Pillow's
decode of each format (GIF's first frame, transparency on white as transformers does) and every refusal."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import json
import random
import socket
import struct
import threading
import time
import zlib

import pytest

from rawserve.api.media import ImagePart, ImageProcessorRules, ImageReader, MediaLimits, SourcePolicy
from rawserve.api.media.decode import decode
from rawserve.api.media.sources import data_url_bytes, image_bytes
from rawserve.engine.mm_inputs import ImageInput, ImageTooOdd, expand_placeholders, smart_resize
from rawserve.errors import APIError

Image = pytest.importorskip("PIL.Image")

# Qwen3-VL's and Qwen3.5's published processor: patch 16, merge 2, 65,536 to 16,777,216 pixels.
PUBLISHED = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
SIZES = [(1, 1), (1, 199), (3, 500), (16, 16), (31, 33), (32, 32), (48, 48), (100, 3000), (224, 224),
         (255, 257), (448, 448), (480, 640), (768, 1024), (1080, 1920), (1000, 1), (4000, 7000), (8192, 8192),
         (1, 201), (201, 1),
         (2160, 3840), (50, 9999), (65, 129), (17, 3400)]


NOISE = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))


def png(width: int, height: int, mode: str = "RGB", color=(10, 200, 30)) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (width, height), color).save(out, "PNG")
    return out.getvalue()


def encoded(image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def vision_dir(tmp_path, preprocessor: dict | None = PUBLISHED, **config):
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 248056, "vision_config": {
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}, **config}))
    if preprocessor is not None:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return tmp_path


def limits(**kw) -> MediaLimits:
    sources = SourcePolicy(max_bytes=kw.pop("max_bytes", 1 << 20), fetch_timeout_s=2.0,
                           allowed_local_path=kw.pop("allowed_local_path", None))
    return MediaLimits(**{"max_images": 4, "max_image_pixels": 1 << 22, "max_request_pixels": 1 << 23,
                          "sources": sources, **kw})


@pytest.mark.parametrize("preprocessor", [PUBLISHED, {**PUBLISHED, "size": {"shortest_edge": 4096,
                                                                             "longest_edge": 36864}},
                                          {"min_pixels": 3136, "max_pixels": 1003520, "patch_size": 14}])
def test_grid_equals_transformers_processor_on_many_sizes(tmp_path, preprocessor):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize \
        as hf_smart_resize

    directory = vision_dir(tmp_path, preprocessor)
    rules = ImageProcessorRules.from_dir(directory)
    hf = Qwen2VLImageProcessorPil.from_pretrained(directory)
    assert (rules.patch_size, rules.merge_size) == (hf.patch_size, hf.merge_size)
    for height, width in SIZES:
        try:
            want = hf_smart_resize(height, width, hf.patch_size * hf.merge_size, hf.size["shortest_edge"],
                                   hf.size["longest_edge"])
        except ValueError:  # past the aspect-ratio limit: refused by both
            with pytest.raises(ImageTooOdd):
                rules.grid(height, width)
            continue
        resized_height, resized_width, num_tokens = rules.grid(height, width)
        assert (resized_height, resized_width) == want
        assert num_tokens == hf.get_number_of_image_patches(height, width, {}) // hf.merge_size ** 2, (height, width)


def test_smart_resize_rounds_half_to_even_and_refuses_what_the_processor_refuses():
    # 48 / 32 = 1.5 rounds to 2 (even), 80 / 32 = 2.5 rounds to 2 (even): the processor's round(), not half-up
    assert smart_resize(80, 48, 32, 1, 1 << 30) == (64, 64)
    with pytest.raises(ImageTooOdd):
        smart_resize(1, 201, 32, 1024, 1 << 20)
    with pytest.raises(ImageTooOdd):
        smart_resize(0, 10, 32, 1024, 1 << 20)


def test_rules_come_from_the_checkpoint_files(tmp_path):
    assert ImageProcessorRules.from_dir(tmp_path) is None  # no config.json: no vision
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert ImageProcessorRules.from_dir(tmp_path) is None  # text-only
    rules = ImageProcessorRules.from_dir(vision_dir(tmp_path, {**PUBLISHED, "min_pixels": 1024}))
    assert (rules.patch_size, rules.min_pixels, rules.max_pixels, rules.image_token_id) == (16, 1024, 16777216, 248056)
    (tmp_path / "preprocessor_config.json").unlink()
    rules = ImageProcessorRules.from_dir(vision_dir(tmp_path, None))  # no preprocessor_config.json: the tower's
    assert (rules.patch_size, rules.merge_size, rules.min_pixels) == (16, 2, 56 * 56)
    with pytest.raises(ValueError, match="patch_size"):
        ImageProcessorRules.from_dir(vision_dir(tmp_path, {**PUBLISHED, "patch_size": 0}))


def test_expand_placeholders_places_each_image():
    def image(n):
        return ImageInput(b"h", 1, 1, b"rgb", 32, 32, 0, n)

    ids, placed = expand_placeholders([5, 9, 6, 9, 7], 9, [image(3), image(2)])
    assert ids == [5, 9, 9, 9, 6, 9, 9, 7]
    assert [p.offset for p in placed] == [1, 5]
    with pytest.raises(ValueError, match="1 image placeholder"):
        expand_placeholders([5, 9], 9, [image(3), image(2)])


def test_data_urls():
    assert data_url_bytes(data_url(b"abc"), "p", 10) == b"abc"
    assert data_url_bytes("data:;base64,YWJj", "p", 10) == b"abc"  # no media type: the decoder decides
    large = random.Random(1).randbytes(700_001)  # decoded in slices: more than one, the last one short
    assert data_url_bytes(data_url(large), "p", 1 << 20) == large
    for url, code in [("data:image/png,abc", "invalid_image_url"),
                      ("data:text/plain;base64,YWJj", "invalid_image_format"),
                      ("data:image/png;base64,@@@", "invalid_image_url"), ("data:image/png;base64", "invalid_image_url"),
                      (data_url(b"x" * 11), "image_too_large"), (data_url(b"x" * 400), "image_too_large")]:
        with pytest.raises(APIError) as caught:
            data_url_bytes(url, "messages.1.content.2", 10)
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, "messages.1.content.2", code)


def test_unknown_schemes_and_local_files(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png(4, 4))
    (tmp_path / "secret.png").write_bytes(png(4, 4))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    policy = SourcePolicy(max_bytes=1 << 20, fetch_timeout_s=1.0, allowed_local_path=str(allowed))

    def get(url, policy=policy):
        return asyncio.run(image_bytes(url, "p", policy))

    assert get(f"file://{allowed}/a.png") == png(4, 4)
    for url in (f"file://{tmp_path}/secret.png", f"file://{allowed}/link.png", f"file://{allowed}/../secret.png",
                f"file://{allowed}", f"file://{allowed}/missing.png", f"file://otherhost{allowed}/a.png",
                "ftp://example.com/a.png", "a.png"):
        with pytest.raises(APIError) as caught:
            get(url)
        assert caught.value.param == "p", url
    with pytest.raises(APIError, match="allowed-local-media-path"):
        get(f"file://{allowed}/a.png", SourcePolicy(max_bytes=1 << 20, fetch_timeout_s=1.0))
    with pytest.raises(APIError, match="larger than 10 bytes"):
        get(f"file://{allowed}/a.png", SourcePolicy(max_bytes=10, fetch_timeout_s=1.0, allowed_local_path=str(allowed)))


def test_every_format_decodes_to_the_same_rgb_as_transformers_conversion():
    from transformers.image_transforms import convert_to_rgb

    rgba = Image.new("RGBA", (5, 3), (200, 10, 10, 255))
    rgba.putpixel((0, 0), (0, 0, 255, 0))  # transparent: white after compositing
    rgba.putpixel((1, 0), (0, 0, 255, 128))
    palette = Image.new("P", (6, 2), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    palette.putpixel((0, 0), 2)
    cases = [encoded(rgba, "PNG"), encoded(rgba.convert("RGB"), "JPEG"), encoded(rgba, "WEBP", lossless=True),
             encoded(palette, "GIF", transparency=0), encoded(Image.new("L", (3, 3), 77), "PNG"),
             encoded(Image.new("I;16", (2, 2), 3000), "PNG")]
    for data in cases:
        got = decode(data, "p", 1000)
        with Image.open(io.BytesIO(data)) as image:
            want = convert_to_rgb(image, return_numpy=True)
        assert (got.height, got.width) == want.shape[:2]
        assert got.rgb == want.tobytes(), Image.open(io.BytesIO(data)).format


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    got = decode(out.getvalue(), "p", 1000)
    assert got.rgb[:3] == bytes((255, 0, 0))


def test_the_content_hash_is_the_pixels_not_the_encoding():
    image = Image.new("RGB", (7, 5), (1, 2, 3))
    lossless = [decode(encoded(image, fmt, **kw), "p", 1000) for fmt, kw in (("PNG", {}), ("WEBP", {"lossless": True}))]
    assert lossless[0].content_hash == lossless[1].content_hash
    assert decode(png(5, 7, color=(1, 2, 3)), "p", 1000).content_hash != lossless[0].content_hash  # same bytes, turned
    assert decode(png(7, 5, color=(1, 2, 4)), "p", 1000).content_hash != lossless[0].content_hash


def bomb_png(width: int, height: int) -> bytes:
    """A PNG header claiming width x height over a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data, code", [
    (b"not an image at all", "invalid_image_format"),
    (encoded(NOISE, "PNG")[:500], "invalid_image"),  # truncated
    (encoded(NOISE, "JPEG")[:400], "invalid_image"),
    (encoded(Image.new("RGB", (4, 4)), "BMP"), "invalid_image_format"),  # a format outside the four
    (encoded(Image.new("RGB", (4, 4)), "TIFF"), "invalid_image_format"),
    (bomb_png(100_000, 100_000), "image_too_large"),  # 10^10 pixels: refused from the header (Pillow's guard too)
    (bomb_png(2000, 2000), "image_too_large"),  # past this test's cap of 10^6
])
def test_bad_images_are_400s_naming_the_part(data, code):
    with pytest.raises(APIError) as caught:
        decode(data, "messages.0.content.1", 1_000_000)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "messages.0.content.1", code)


def test_the_reader_applies_every_limit(tmp_path):
    rules = ImageProcessorRules.from_dir(vision_dir(tmp_path))
    parts = [ImagePart(data_url(png(w, h)), f"messages.0.content.{k}") for k, (w, h) in enumerate(
        [(64, 48), (300, 20), (1000, 1000)])]
    images = asyncio.run(ImageReader(rules, 248056, limits()).read(parts))
    assert [(i.width, i.height, i.offset) for i in images] == [(64, 48, 0), (300, 20, 0), (1000, 1000, 0)]
    assert [(i.resized_width, i.resized_height, i.num_tokens) for i in images] == [
        (320, 224, 70), (992, 96, 93), (992, 992, 961)]  # transformers' numbers: the 65,536-pixel floor lifts two
    assert images[2].rgb == bytes((10, 200, 30)) * 1_000_000

    def refused(reader, parts):
        with pytest.raises(APIError) as caught:
            asyncio.run(reader.read(parts))
        return caught.value.param, caught.value.code

    assert refused(ImageReader(None, None, limits()), parts) == ("messages.0.content.0", "images_unsupported")
    assert refused(ImageReader(rules, 248056, limits(max_images=2)), parts) == ("messages.0.content.2",
                                                                               "too_many_images")
    assert refused(ImageReader(rules, 248056, limits(max_image_pixels=10_000)), parts) == (
        "messages.0.content.2", "image_too_large")
    # each image fits alone; the third passes what the first two left of the request's budget
    assert refused(ImageReader(rules, 248056, limits(max_request_pixels=1_000_000)), parts) == (
        "messages.0.content.2", "image_too_large")
    bad = [*parts[:2], ImagePart("data:image/png;base64,AAAA", "messages.3.content.0")]
    assert refused(ImageReader(rules, 248056, limits()), bad) == ("messages.3.content.0", "invalid_image_format")
    odd = [ImagePart(data_url(png(300, 1)), "messages.0.content.0")]  # aspect ratio 300: the processor refuses
    assert refused(ImageReader(rules, 248056, limits()), odd) == ("messages.0.content.0", "invalid_image")


def test_without_pillow_an_image_is_a_400_naming_the_extra(tmp_path, monkeypatch):
    from rawserve.api.media import decode as decode_module

    url = data_url(png(4, 4))
    decode_module.pillow.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "PIL", None)  # import PIL now fails, as without the extra
    try:
        reader = ImageReader(ImageProcessorRules.from_dir(vision_dir(tmp_path)), 248056, limits())
        with pytest.raises(APIError, match=r'pip install "rawserve\[vision\]"') as caught:
            asyncio.run(reader.read([ImagePart(url, "messages.0.content.0")]))
        assert caught.value.param == "messages.0.content.0"
    finally:
        decode_module.pillow.cache_clear()


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    routes: dict = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        # the fetcher hangs up on purpose when a body is too large or too slow
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._answer()

    def _answer(self):
        status, headers, body = self.routes.get(self.path, (404, {"Content-Type": "text/plain"}, b"no"))
        if callable(body):
            body = body()
        self.send_response(status)
        chunked = headers.get("Transfer-Encoding") == "chunked"
        for name, value in headers.items():
            self.send_header(name, value)
        if not chunked:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if chunked:
            for start in range(0, len(body), 4096):
                piece = body[start:start + 4096]
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve_images(routes: dict):
    """A loopback HTTP/1.1 server answering GET path -> (status, headers, body or a callable making it)."""
    handler = type("Handler", (_ImageHandler,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def image_routes(image: bytes) -> dict:
    def slow():
        time.sleep(1.5)
        return image

    return {"/img.png": (200, {"Content-Type": "image/png"}, image),
            "/unlabelled": (200, {}, image),
            "/chunked.png": (200, {"Content-Type": "image/png", "Transfer-Encoding": "chunked"}, image),
            "/page": (200, {"Content-Type": "text/html"}, b"<html>not an image</html>"),
            "/redirect": (302, {"Location": "/img.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/big.png": (200, {"Content-Type": "image/png"}, b"\0" * 300_000),
            "/big-chunked.png": (200, {"Content-Type": "image/png", "Transfer-Encoding": "chunked"}, b"\0" * 300_000),
            "/slow.png": (200, {"Content-Type": "image/png"}, slow),
            "/gone.png": (404, {"Content-Type": "text/plain"}, b"gone")}


def test_http_fetch_follows_its_rules():
    image = png(6, 4)
    policy = SourcePolicy(max_bytes=100_000, fetch_timeout_s=0.5, max_redirects=3)
    with serve_images(image_routes(image)) as base:
        def get(path, policy=policy):
            return asyncio.run(image_bytes(base + path, "messages.1.content.2", policy))

        for path in ("/img.png", "/unlabelled", "/chunked.png", "/redirect"):
            assert get(path) == image, path
        for path, code in (("/page", "invalid_image_format"), ("/loop", "image_fetch_failed"),
                           ("/big.png", "image_too_large"), ("/big-chunked.png", "image_too_large"),
                           ("/slow.png", "image_fetch_timeout"), ("/gone.png", "image_fetch_failed")):
            with pytest.raises(APIError) as caught:
                get(path)
            assert (caught.value.status, caught.value.param, caught.value.code) == (
                400, "messages.1.content.2", code), path
        elsewhere = SourcePolicy(max_bytes=100_000, fetch_timeout_s=1.0, allowed_domains=("images.example.com",))
        with pytest.raises(APIError, match="allowed-media-domains"):
            get("/img.png", elsewhere)
        assert get("/img.png", SourcePolicy(max_bytes=100_000, fetch_timeout_s=1.0, allowed_domains=("127.0.0.1",)))
    port = int(base.rsplit(":", 1)[1])  # closed now: nothing listens
    with pytest.raises(APIError, match="Cannot connect") as caught:
        asyncio.run(image_bytes(f"http://127.0.0.1:{port}/img.png", "p", policy))
    assert caught.value.code == "image_fetch_failed"


def test_the_vision_extra_is_declared_and_the_container_images_install_it():
    import pathlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    root = pathlib.Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vision"] == ["Pillow>=10"] and "Pillow>=10" in extras["test"]
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        assert 'pip install --no-cache-dir ".[vision]"' in (root / "deploy" / name).read_text(), name


def test_decoding_runs_off_the_event_loop(tmp_path, monkeypatch):
    from rawserve.api.media import reader as reader_module

    threads = []

    def recording_decode(*args):  # the real decode, noting the thread it ran on
        threads.append(threading.get_ident())
        return decode(*args)

    monkeypatch.setattr(reader_module, "decode", recording_decode)
    reader = ImageReader(ImageProcessorRules.from_dir(vision_dir(tmp_path)), 248056, limits())

    async def read():
        return threading.get_ident(), await reader.read([ImagePart(data_url(png(40, 30)), "p")] * 2)

    loop_thread, images = asyncio.run(read())
    assert len(images) == 2 and len(threads) == 2 and loop_thread not in threads


def test_a_vision_checkpoints_processor_template_is_found(tmp_path):
    """chat_template.json (the processor's, which renders image placeholders) comes after chat_template.jinja and
    before tokenizer_config.json's, as transformers' processors load it."""
    from rawserve.text.chat_template import ChatTemplateError, load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    assert load_chat_template(tmp_path) == "T"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert load_chat_template(tmp_path) == "P"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="chat_template.json"):
        load_chat_template(tmp_path)


@contextlib.contextmanager
def raw_server(answer: bytes):
    """A loopback TCP server that reads a request, writes `answer` and hangs up, whatever was asked."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


@pytest.mark.parametrize("answer, code", [
    (b"SSH-2.0-OpenSSH\r\n", "image_fetch_failed"),  # not HTTP
    (b"", "image_fetch_failed"),  # hangs up without a word
    (b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\nshort", "image_fetch_failed"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: x\r\n\r\n", "image_fetch_failed"),
    (b"HTTP/1.1 301 Moved\r\nContent-Length: 0\r\n\r\n", "image_fetch_failed"),  # a redirect to nowhere
    (b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000, "image_fetch_failed"),  # endless headers
])
def test_a_broken_image_server_is_a_400(answer, code):
    policy = SourcePolicy(max_bytes=100_000, fetch_timeout_s=2.0)
    with raw_server(answer) as base:
        with pytest.raises(APIError) as caught:
            asyncio.run(image_bytes(base + "/img.png", "p", policy))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, "p", code)


def test_a_url_a_request_line_cannot_carry_is_a_400():
    policy = SourcePolicy(max_bytes=100_000, fetch_timeout_s=2.0)
    with pytest.raises(APIError) as caught:
        asyncio.run(image_bytes("http://127.0.0.1:9/a b.png", "p", policy))
    assert caught.value.code == "invalid_image_url"
