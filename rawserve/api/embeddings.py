"""POST /v1/embeddings in OpenAI's shape (input as text, texts, token ids or lists of them; dimensions;
encoding_format float or base64; truncate_prompt_tokens), and `run_pooling`, the admission and collection of
pooling requests that /v1/rerank shares. The vectors come from the core (PoolingParams); this module shapes them.
"""
from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
import uuid
from dataclasses import dataclass

from rawserve.api.serving import Caller, ServingContext, overloaded, stream_error
from rawserve.engine.pooling import PoolingSpec
from rawserve.engine.types import PoolingParams, SamplingParams
from rawserve.errors import APIError, EngineDead, Overloaded
from rawserve.http import JSONResponse, Request, parse

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request
MAX_REQUEST_TOKENS = 300_000  # OpenAI's limit on the tokens of one embeddings request, summed over its inputs


@dataclass(slots=True)
class EmbeddingRequest:
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last k tokens of each input (-1: the context)
    priority: int = 0


def pooling_only(task: str):
    """The handler for a generation route on a pooling model (and /v1/embeddings or /v1/rerank where the model does
    not serve them): a clear 400, as vLLM answers."""
    async def refuse(request: Request) -> JSONResponse:
        raise APIError(400, f"The model does not support {request.path}: it is served for {task}.",
                       code="unsupported_task")
    return refuse


def check_limits(num_inputs: int, num_tokens: int, param: str) -> None:
    if num_inputs > MAX_INPUTS:
        raise APIError(400, f"At most {MAX_INPUTS} inputs per request; got {num_inputs}.", param=param)
    if num_tokens > MAX_REQUEST_TOKENS:
        raise APIError(400, f"The inputs hold {num_tokens} tokens in all; at most {MAX_REQUEST_TOKENS} per request.",
                       param=param, code="context_length_exceeded")


def fit_context(ctx: ServingContext, ids: list[int], truncate: int | None, param: str) -> list[int]:
    """An input as the model takes it: cut to its last `truncate` tokens when asked (-1: the context), else a 400
    when it is over the context (never cut silently)."""
    if truncate is not None:
        keep = ctx.max_model_len if truncate == -1 else truncate
        ids = ids[-keep:] if len(ids) > keep else ids
    if len(ids) > ctx.max_model_len:
        raise APIError(400, f"This model's maximum context length is {ctx.max_model_len} tokens. However, your "
                            f"input has {len(ids)} tokens. Shorten it or set truncate_prompt_tokens.", param=param,
                       code="context_length_exceeded")
    return ids


async def _last(stream) -> object:
    last = None
    async for out in stream:
        last = out
    return last


async def run_pooling(ctx: ServingContext, prompts: list[list[int]], params: list[PoolingParams], rid: str,
                      caller: Caller, priority: int = 0) -> list[list[float]]:
    """Each prompt as a pooling request; -> their vectors, in order. Admitted in waves of at most half of
    --max-pending (a 2,048-input request must not need 2,048 slots at once, nor starve the others); a refusal or
    fault part-way aborts what was started. A key's bucket is charged the prompt tokens."""
    reservation = None
    if ctx.limiter is not None:
        reservation = ctx.limiter.reserve(caller.api_key, sum(map(len, prompts)), 0)
    wave = max(1, ctx.llm.max_pending // 2)
    vectors: list[list[float]] = []
    try:
        for first in range(0, len(prompts), wave):
            streams = []
            try:
                for i in range(first, min(first + wave, len(prompts))):
                    streams.append(ctx.llm.generate(prompts[i], SamplingParams(max_tokens=0, pooling=params[i]),
                                                    f"{rid}-{i}", priority, timeout_s=caller.timeout_s))
                outs = await asyncio.gather(*(_last(stream) for stream in streams))
            except (Overloaded, EngineDead) as error:
                raise overloaded(error) from None
            except ValueError as error:  # the core's refusal, which names the field first ("dimensions: ...")
                field = str(error).partition(":")[0]
                raise APIError(400, str(error), param=field if field in ("dimensions", "pooling") else None) from None
            except APIError:
                raise
            except Exception as error:  # noqa: BLE001 - an engine stream's failure, as the client sees it
                raise stream_error(error) from None
            finally:
                for stream in streams:
                    ctx.llm.abort(stream.request_id)  # a no-op for those finished
            for out in outs:
                if out is None or out.pooled is None:
                    raise APIError(500, f"The request ended ({getattr(out, 'finish_reason', None)}) before its "
                                        "vector was computed.", code="internal_error")
                vectors.append(out.pooled)
    finally:
        if reservation is not None:
            reservation.settle(0)
    return vectors


def _encode_base64(vector: list[float]) -> str:
    """OpenAI's base64: the float32 values' little-endian bytes."""
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


async def _inputs(ctx: ServingContext, value: object, truncate: int | None) -> list[list[int]]:
    items = [value] if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)) \
        else value
    if not items:
        raise APIError(400, "input is empty.", param="input")
    if len(items) > MAX_INPUTS:
        raise APIError(400, f"At most {MAX_INPUTS} inputs per request; got {len(items)}.", param="input")
    prompts = []
    for k, item in enumerate(items):
        param = "input" if len(items) == 1 else f"input.{k}"
        if isinstance(item, str):
            if not item:
                raise APIError(400, "An input is an empty string.", param=param)
            # Tokenized only up to a bound (Tokenizer.encode refuses past it early): the context, unless a cut
            # is asked for, and the request's whole allowance then.
            bound = ctx.max_model_len if truncate is None else MAX_REQUEST_TOKENS
            try:
                ids = await ctx.encode(item, max_tokens=bound)
            except APIError as error:
                raise APIError(400, f"This model's maximum context length is {ctx.max_model_len} tokens; "
                                    f"input {k} is longer. {error.message}", param=param,
                               code="context_length_exceeded") from None
        else:
            ids = list(item)
        ctx.check_prompt_ids(ids, param)
        prompts.append(fit_context(ctx, ids, truncate, param))
    return prompts


async def create_embeddings(ctx: ServingContext, spec: PoolingSpec, request: Request) -> JSONResponse:
    if spec.task != "embed":
        raise APIError(400, f"The model does not support /v1/embeddings: it is served for {spec.task}.",
                       code="unsupported_task")
    started = time.monotonic()
    req = parse(EmbeddingRequest, request.json())
    ctx.check_model(req.model)
    caller = ctx.caller(request)
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be float or base64, got {req.encoding_format!r}.",
                       param="encoding_format")
    if req.dimensions is not None and req.dimensions < 1:
        raise APIError(400, f"dimensions must be a positive integer, got {req.dimensions}.", param="dimensions")
    if req.truncate_prompt_tokens is not None and not (req.truncate_prompt_tokens == -1
                                                       or req.truncate_prompt_tokens >= 1):
        raise APIError(400, "truncate_prompt_tokens must be -1 (the context) or a positive count.",
                       param="truncate_prompt_tokens")
    prompts = await _inputs(ctx, req.input, req.truncate_prompt_tokens)
    num_tokens = sum(map(len, prompts))
    check_limits(len(prompts), num_tokens, "input")
    pooling = PoolingParams(spec.method, spec.normalize, req.dimensions)
    rid = f"embd-{uuid.uuid4().hex}"
    vectors = await run_pooling(ctx, prompts, [pooling] * len(prompts), rid, caller, req.priority)
    data = [{"object": "embedding", "index": i,
             "embedding": _encode_base64(v) if req.encoding_format == "base64" else v} for i, v in enumerate(vectors)]
    metrics = ctx.llm.metrics
    metrics.inc("pooling_requests_total", label_value="embed")
    metrics.inc("pooling_inputs_total", len(prompts), label_value="embed")
    metrics.observe("pooling_request_latency_seconds", time.monotonic() - started)
    return JSONResponse({"object": "list", "data": data, "model": ctx.model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
