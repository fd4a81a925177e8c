"""Bearer API keys on every path with 401 in OpenAI's shape; /health, /ready and /metrics stay open, and
--open-paths opens more."""
from __future__ import annotations

import pytest

from rawserve.http import APIKeyAuth, JSONResponse, Request, Router, TextResponse
from tests.http.harness import client, serve

UNAUTHORIZED_KEYS = {"message", "type", "param", "code"}


async def ok(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def metrics(request: Request) -> TextResponse:
    return TextResponse("up 1\n")


def router() -> Router:
    r = Router()
    r.add("GET", "/v1/models", ok)
    r.add("POST", "/v1/chat/completions", ok)
    r.add("GET", "/health", ok)
    r.add("GET", "/metrics", metrics)
    return r


async def test_missing_key_is_401_with_code_invalid_api_key():
    async with serve(router(), api_key=["sk-one"]) as server, client(server.port) as c:
        reply = await c.request("GET", "/v1/models")
        assert reply.status == 401
        error = reply.json()["error"]
        assert set(error) == UNAUTHORIZED_KEYS
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("value", ["Bearer sk-wrong", "Basic sk-one", "Bearer", "sk-one", "Bearer sk-on"])
async def test_wrong_or_malformed_key_is_401(value):
    async with serve(router(), api_key=["sk-one"]) as server, client(server.port) as c:
        reply = await c.request("GET", "/v1/models", headers=[("Authorization", value)])
        assert reply.status == 401 and reply.json()["error"]["code"] == "invalid_api_key"


async def test_any_of_several_keys_is_accepted_and_the_scheme_is_case_insensitive():
    async with serve(router(), api_key=["sk-one", "sk-two"]) as server, client(server.port) as c:
        for value in ("Bearer sk-one", "bearer sk-two", "BEARER  sk-two"):
            assert (await c.request("GET", "/v1/models", headers=[("Authorization", value)])).status == 200


async def test_handler_sees_which_key_passed():
    seen: list[str | None] = []

    async def whoami(request: Request) -> JSONResponse:
        seen.append(request.api_key)
        return JSONResponse({})

    r = router()
    r.add("GET", "/v1/whoami", whoami)
    r.add("GET", "/whoami", whoami)
    async with serve(r, api_key=["sk-one", "sk-two"], open_paths=["/whoami"]) as server, client(server.port) as c:
        await c.request("GET", "/v1/whoami", headers=[("Authorization", "Bearer sk-two")])
        await c.request("GET", "/whoami", headers=[("Authorization", "Bearer sk-two")])
    assert seen == ["sk-two", None]  # open paths are not checked, so no key is vouched for


async def test_paths_outside_v1_need_the_key_too_unless_opened():
    r = router()
    r.add("POST", "/tokenize", ok)
    r.add("GET", "/version", ok)
    async with serve(r, api_key=["sk-one"]) as server, client(server.port) as c:
        assert (await c.request("POST", "/tokenize", b"{}")).status == 401
        assert (await c.request("GET", "/version")).status == 401
        assert (await c.request("GET", "/unknown")).status == 401  # nothing about the routes leaks either
        auth = [("Authorization", "Bearer sk-one")]
        assert (await c.request("POST", "/tokenize", b"{}", headers=auth)).status == 200
    async with serve(r, api_key=["sk-one"], open_paths=["/tokenize"]) as server, client(server.port) as c:
        assert (await c.request("POST", "/tokenize", b"{}")).status == 200
        assert (await c.request("GET", "/version")).status == 401


async def test_health_and_metrics_stay_open():
    async with serve(router(), api_key=["sk-one"]) as server, client(server.port) as c:
        assert (await c.request("GET", "/health")).status == 200
        assert (await c.request("GET", "/metrics")).body == b"up 1\n"


async def test_without_keys_v1_is_open():
    async with serve(router()) as server, client(server.port) as c:
        assert (await c.request("GET", "/v1/models")).status == 200


async def test_unauthorized_body_is_refused_before_it_is_read():
    async with serve(router(), api_key=["sk-one"]) as server, client(server.port) as c:
        await c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        data = await c.read_until_closed()
        assert data.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in data


async def test_unauthorized_unknown_v1_path_is_401_not_404():
    async with serve(router(), api_key=["sk-one"]) as server, client(server.port) as c:
        assert (await c.request("GET", "/v1/secret-admin")).status == 401


def test_blank_key_is_refused_at_startup():
    with pytest.raises(ValueError, match="--api-key"):
        APIKeyAuth([" padded "])
