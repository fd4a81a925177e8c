"""Routing (404, 405 + Allow, path parameters) and CORS, as a table and over the wire."""
from __future__ import annotations

import pytest

from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, Router
from tests.http.harness import client, serve


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"route": request.method + " " + request.path, "params": request.path_params})


def api_router() -> Router:
    router = Router()
    router.add("POST", "/v1/chat/completions", ok)
    router.add("GET", "/v1/models", ok)
    router.add("GET", "/v1/models/{model:path}", ok)
    router.add("GET", "/v1/files/{file_id}/content", ok)
    router.add("GET", "/health", ok)
    return router


def test_exact_path_resolves_to_its_handler():
    handler, params = api_router().resolve("POST", "/v1/chat/completions")
    assert handler is ok and params == {}


def test_unknown_path_is_404():
    with pytest.raises(APIError) as info:
        api_router().resolve("GET", "/v1/nothing")
    assert info.value.status == 404


def test_known_path_with_wrong_method_is_405_with_allow():
    router = api_router()
    router.add("DELETE", "/v1/models", ok)
    with pytest.raises(APIError) as info:
        router.resolve("PUT", "/v1/models")
    assert info.value.status == 405 and info.value.headers == [(b"allow", b"DELETE, GET")]


def test_path_parameters_match_one_segment_or_the_rest():
    router = api_router()
    assert router.resolve("GET", "/v1/models/Qwen/Qwen3-0.6B")[1] == {"model": "Qwen/Qwen3-0.6B"}
    assert router.resolve("GET", "/v1/files/f-1/content")[1] == {"file_id": "f-1"}
    with pytest.raises(APIError):
        router.resolve("GET", "/v1/files/a/b/content")


def test_bad_registrations_are_refused():
    router = api_router()
    with pytest.raises(ValueError):
        router.add("GET", "/health", ok)  # twice
    with pytest.raises(ValueError):
        router.add("get", "/x", ok)
    with pytest.raises(ValueError):
        router.add("GET", "x", ok)
    with pytest.raises(ValueError):
        router.add("GET", "/a/{rest:path}/b", ok)


async def test_404_over_the_wire_in_openai_shape():
    async with serve(api_router()) as server, client(server.port) as c:
        reply = await c.request("GET", "/v1/nothing")
        assert reply.status == 404
        assert reply.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)."
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


async def test_405_over_the_wire_carries_allow():
    async with serve(api_router()) as server, client(server.port) as c:
        reply = await c.request("GET", "/v1/chat/completions")
        assert reply.status == 405 and reply.headers["allow"] == "POST"
        assert (await c.request("GET", "/health")).status == 200  # kept alive after it


async def test_cors_preflight_from_an_allowed_origin_gets_204_with_grants():
    async with serve(api_router(), allowed_origins=["https://app.example"]) as server, client(server.port) as c:
        reply = await c.request("OPTIONS", "/v1/chat/completions", headers=[
            ("Origin", "https://app.example"), ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", "authorization, content-type")])
        assert reply.status == 204 and reply.body == b"" and "content-length" not in reply.headers
        assert reply.headers["access-control-allow-origin"] == "https://app.example"
        assert reply.headers["access-control-allow-methods"] == "POST"
        assert reply.headers["access-control-allow-headers"] == "authorization, content-type"
        assert (await c.request("GET", "/health")).status == 200


async def test_cors_preflight_needs_no_api_key():
    async with serve(api_router(), allowed_origins=["*"], api_key=["k"]) as server, client(server.port) as c:
        reply = await c.request("OPTIONS", "/v1/models", headers=[
            ("Origin", "https://any.example"), ("Access-Control-Request-Method", "GET")])
        assert reply.status == 204 and reply.headers["access-control-allow-origin"] == "*"


async def test_cors_preflight_from_a_foreign_origin_is_403():
    async with serve(api_router(), allowed_origins=["https://app.example"]) as server, client(server.port) as c:
        reply = await c.request("OPTIONS", "/v1/models", headers=[
            ("Origin", "https://evil.example"), ("Access-Control-Request-Method", "GET")])
        assert reply.status == 403 and "access-control-allow-origin" not in reply.headers


async def test_cors_preflight_for_an_unrouted_method_is_405():
    async with serve(api_router(), allowed_origins=["*"]) as server, client(server.port) as c:
        reply = await c.request("OPTIONS", "/v1/models", headers=[
            ("Origin", "https://a.example"), ("Access-Control-Request-Method", "DELETE")])
        assert reply.status == 405 and reply.headers["allow"] == "GET"


async def test_actual_cors_request_gets_allow_origin_on_success_and_error():
    async with serve(api_router(), allowed_origins=["https://app.example"]) as server, client(server.port) as c:
        reply = await c.request("GET", "/v1/models", headers=[("Origin", "https://app.example")])
        assert reply.status == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
        assert reply.headers["vary"] == "origin"
        reply = await c.request("GET", "/v1/nothing", headers=[("Origin", "https://app.example")])
        assert reply.status == 404 and reply.headers["access-control-allow-origin"] == "https://app.example"
        reply = await c.request("GET", "/v1/models", headers=[("Origin", "https://other.example")])
        assert "access-control-allow-origin" not in reply.headers


async def test_without_allowed_origins_options_is_an_ordinary_405():
    async with serve(api_router()) as server, client(server.port) as c:
        reply = await c.request("OPTIONS", "/v1/models", headers=[
            ("Origin", "https://app.example"), ("Access-Control-Request-Method", "GET")])
        assert reply.status == 405 and "access-control-allow-origin" not in reply.headers


def test_path_parameters_are_percent_decoded():
    assert api_router().resolve("GET", "/v1/models/org%2Fmodel%20x")[1] == {"model": "org/model x"}
