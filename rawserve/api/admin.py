"""Operational endpoints: /v1/models, /health, /metrics, /version, /tokenize, /detokenize.

/health and /metrics stay open without an API key (http/auth.py protects /v1/* only).
"""
from __future__ import annotations

from rawserve import __version__
from rawserve.api.chat import render_prompt
from rawserve.api.protocol import ChatRequest, DetokenizeRequest, TokenizeRequest
from rawserve.api.serving import ServingContext
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, TextResponse, parse
from rawserve.metrics import CONTENT_TYPE


def model_card(ctx: ServingContext) -> dict:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "rawserve",
            "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}


async def list_models(ctx: ServingContext, request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(ctx)]})


async def retrieve_model(ctx: ServingContext, request: Request) -> JSONResponse:
    ctx.check_model(request.path_params["model"])
    return JSONResponse(model_card(ctx))


def health(ctx: ServingContext, is_draining) -> object:
    async def handler(request: Request) -> JSONResponse:
        if ctx.llm.is_dead:
            raise APIError(503, f"The engine is dead: {ctx.llm.dead_reason}", code="engine_dead")
        if is_draining():
            raise APIError(503, "The server is shutting down.", code="draining")
        return JSONResponse({"status": "ok"})
    return handler


async def metrics(ctx: ServingContext, request: Request) -> TextResponse:
    return TextResponse(ctx.llm.render_metrics(), content_type=CONTENT_TYPE)


async def version(ctx: ServingContext, request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__})


async def tokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = parse(TokenizeRequest, request.json())
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
    if req.messages is not None:
        chat = ChatRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        text, _ = render_prompt(ctx, chat)
        ids = await ctx.encode(text, add_special_tokens=False)
    else:
        ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})


async def detokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = parse(DetokenizeRequest, request.json())
    ctx.check_model(req.model)
    ctx.check_prompt_ids(req.tokens or [0], "tokens")
    return JSONResponse({"prompt": await ctx.decode(req.tokens)})
