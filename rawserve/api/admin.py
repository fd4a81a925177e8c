"""Operational endpoints: /v1/models, /health (liveness), /ready (readiness), /metrics, /version, /tokenize,
/detokenize, /tokenizer_info, and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

/health, /ready and /metrics stay open without an API key (http/auth.py protects /v1/* only) and during a drain.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from rawserve import __version__
from rawserve.api.chat import prompt_ids, render_prompt
from rawserve.api.protocol import (ChatRequest, DetokenizeRequest, LoadLoraAdapterRequest, TokenizeRequest,
                                   UnloadLoraAdapterRequest)
from rawserve.api.serving import ServingContext, model_not_found
from rawserve.engine.frontend.async_llm import LoraOpError
from rawserve.errors import APIError, EngineDead
from rawserve.http import JSONResponse, Request, Router, TextResponse, parse
from rawserve.metrics import CONTENT_TYPE


log = logging.getLogger("rawserve.api.lora")

TOKENIZE_MAX_TOKENS = 1 << 17  # /tokenize's limit when the context is shorter


def _capacity(ctx: ServingContext) -> dict:
    """vLLM's max_model_len, and (rawserve's) the KV pool all requests share, in tokens and bytes."""
    return {"max_model_len": ctx.max_model_len, "kv_cache_tokens": ctx.kv_cache.get("tokens"),
            "kv_cache_bytes": ctx.kv_cache.get("bytes")}


def model_card(ctx: ServingContext, task: str = "generate") -> dict:
    """`task`: what the model serves (generate, embed, rerank), as vLLM's runner and task."""
    return {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "rawserve",
            "root": ctx.model_name, "parent": None, "task": task, **_capacity(ctx)}


def lora_card(ctx: ServingContext, name: str) -> dict:
    """An adapter as vLLM lists it: its own id, its directory as root, the base model as parent."""
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "rawserve",
            "root": ctx.loras[name], "parent": ctx.model_name, **_capacity(ctx)}


async def list_models(ctx: ServingContext, request: Request, *, task: str = "generate") -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(ctx, task), *(lora_card(ctx, n) for n in ctx.loras)]})


async def retrieve_model(ctx: ServingContext, request: Request, *, task: str = "generate") -> JSONResponse:
    model = request.path_params["model"]
    ctx.check_model(model)
    return JSONResponse(lora_card(ctx, model) if model in ctx.loras else model_card(ctx, task))


def _check_runtime_updates(ctx: ServingContext, request: Request) -> None:
    """Without --allow-runtime-lora-updating the routes answer as paths that do not exist, as vLLM's (which it
    does not register without VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    if not (ctx.llm.info or {}).get("lora_runtime_updating"):
        raise APIError(404, f"Invalid URL ({request.method} {request.path}).", code="not_found")


# One answer for every path the server will not load, whatever the reason (outside --lora-root, missing, not a
# directory, not a regular file, too large, not a valid adapter): a client learns nothing of the file system.
# The reason goes to the server's log.
LORA_PATH_REFUSED = "The LoRA adapter could not be loaded from lora_path (see the server's log for why)."


def _log_load(name: str, path: str, task: asyncio.Future) -> None:
    """The load's outcome in the server's log, whether or not its client is still there to be answered; reading
    the task's exception here also keeps a load whose client left from logging 'Task exception was never retrieved'."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        log.info("lora: adapter %r loaded from %r", name, path)
    elif isinstance(error, LoraOpError):
        log.warning("lora: loading adapter %r from %r failed: %s", name, path, error)
    elif not isinstance(error, EngineDead):
        log.error("lora: loading adapter %r from %r failed", name, path, exc_info=error)


async def load_lora_adapter(ctx: ServingContext, request: Request) -> TextResponse:
    """Read, check and register an adapter in the core (only with --allow-runtime-lora-updating, only from under
    --lora-root). A path it cannot load gets LORA_PATH_REFUSED, whatever the reason."""
    _check_runtime_updates(ctx, request)
    req = parse(LoadLoraAdapterRequest, request.json())
    name = req.lora_name
    if not name or not req.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       param="lora_name" if not name else "lora_path")
    if name == ctx.model_name or name in ctx.loras:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")

    async def load_and_register() -> None:
        await ctx.llm.lora_op("load", name, req.lora_path)
        ctx.loras[name] = req.lora_path

    # Shielded: a client that leaves mid-load must not leave the core with an adapter we do not list. The load
    # goes on and _log_load reports how it ended.
    task = asyncio.ensure_future(load_and_register())
    task.add_done_callback(functools.partial(_log_load, name, req.lora_path))
    try:
        await asyncio.shield(task)
    except LoraOpError as error:
        if error.code == "name":
            raise APIError(400, str(error), param="lora_name") from None
        if error.code == "busy":
            raise APIError(503, "Too many LoRA adapter loads are in progress; try again later.",
                           code="lora_loads_busy") from None
        if error.code == "timeout":
            raise APIError(400, "Loading the LoRA adapter took too long and was given up.", param="lora_path",
                           code="lora_load_timeout") from None
        if error.code == "disabled":
            raise APIError(404, f"Invalid URL ({request.method} {request.path}).", code="not_found") from None
        raise APIError(400, LORA_PATH_REFUSED, param="lora_path") from None
    except EngineDead as error:
        raise APIError(503, f"The engine is dead: {error}", code="engine_dead") from None
    return TextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(ctx: ServingContext, request: Request) -> TextResponse:
    """New requests for it are refused at once; the core drops it when its last request ends."""
    _check_runtime_updates(ctx, request)
    req = parse(UnloadLoraAdapterRequest, request.json())
    name = req.lora_name
    if name not in ctx.loras:
        raise model_not_found(name, "lora_name")
    del ctx.loras[name]
    try:
        await asyncio.shield(asyncio.ensure_future(ctx.llm.lora_op("unload", name)))  # as for a load
    except KeyError:
        raise model_not_found(name, "lora_name") from None
    except LoraOpError as error:
        raise APIError(400, str(error), param="lora_name") from None
    except EngineDead as error:
        raise APIError(503, f"The engine is dead: {error}", code="engine_dead") from None
    return TextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


PROBE_PATHS = ("/health", "/ready", "/metrics")  # answered during a drain too


def health(ctx: ServingContext, stall_timeout_s: float = 30.0) -> Callable:
    """Liveness (GET and HEAD /health): 503 when the engine is dead, or frozen (requests wait and the core has
    sent nothing, not even its heartbeat, for stall_timeout_s: AsyncLLM.stall_reason); a drain is not a failure."""
    async def handler(request: Request) -> JSONResponse:
        if ctx.llm.is_dead:
            raise APIError(503, f"The engine is dead: {ctx.llm.dead_reason}", code="engine_dead")
        stalled = ctx.llm.stall_reason(stall_timeout_s)
        if stalled is not None:
            raise APIError(503, f"The engine is not responding: {stalled}.", code="engine_stalled")
        return JSONResponse({"status": "ok"})
    return handler


def loading_router() -> Router:
    """What answers while the model loads: every path, /health and /ready included, 503 `loading` (with
    Retry-After), so a probe or a client is told at once instead of waiting in the backlog. /health too, as
    llama.cpp's server does: scripts and benchmarks wait for its 200 before sending work, and Kubernetes gives
    a load its time through the startup probe on /health (deploy/k8s)."""
    async def loading(request: Request) -> JSONResponse:
        raise APIError(503, "The model is loading.", code="loading")

    router = Router()
    for method in ("GET", "HEAD", "POST", "DELETE"):
        router.add(method, "/{path:path}", loading)
    return router


def ready(ctx: ServingContext, is_draining: Callable[[], bool]) -> Callable:
    """Readiness: 200 only while new requests are welcome; 503 while the model loads, drains, or is dead."""
    async def handler(request: Request) -> JSONResponse:
        if ctx.llm.is_dead:
            raise APIError(503, f"The engine is dead: {ctx.llm.dead_reason}", code="engine_dead")
        if is_draining():
            raise APIError(503, "The server is shutting down.", code="draining")
        if ctx.llm.info is None:
            raise APIError(503, "The model is loading.", code="loading")
        return JSONResponse({"status": "ready"})
    return handler


async def metrics(ctx: ServingContext, request: Request) -> TextResponse:
    return TextResponse(ctx.llm.render_metrics(), content_type=CONTENT_TYPE)


async def version(ctx: ServingContext, request: Request) -> JSONResponse:
    return JSONResponse({"version": __version__})


async def tokenizer_info(ctx: ServingContext, request: Request) -> JSONResponse:
    """vLLM's GET /tokenizer_info: what a client needs to tokenize as the server does (lm-evaluation-harness's
    tokenizer_backend=remote reads it, then uses /tokenize and /detokenize)."""
    tok = ctx.tokenizer
    return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                         "eos_token": tok.eos_token, "model_max_length": ctx.max_model_len,
                         "vocab_size": tok.vocab_size, "chat_template": ctx.chat_template})


async def tokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = parse(TokenizeRequest, request.json())
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
    # Texts longer than the context may be measured (documents to split), but not without bound.
    limit = max(ctx.max_model_len, TOKENIZE_MAX_TOKENS)
    if req.messages is not None:
        chat = ChatRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
        images: list = []
        text, _ = render_prompt(ctx, chat, images)
        if images:  # as chat takes them: each image read and sized, its placeholder run as long as its tokens
            _, _, ids, _ = await prompt_ids(ctx, chat)
        else:
            ids = await ctx.encode(text, add_special_tokens=False, max_tokens=limit)
    else:
        ids = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens, max_tokens=limit)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})


async def detokenize(ctx: ServingContext, request: Request) -> JSONResponse:
    req = parse(DetokenizeRequest, request.json())
    ctx.check_model(req.model)
    ctx.check_prompt_ids(req.tokens or [0], "tokens")
    return JSONResponse({"prompt": await ctx.decode(req.tokens)})
