"""POST /v1/completions: text or token-id prompts (or a batch of them), n samples, echo, logprobs, streaming.

One HTTP request becomes len(prompts) x n engine requests; choice index = prompt * n + sample.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from rawserve.api.guided import request_spec
from rawserve.api.protocol import CompletionRequest
from rawserve.api.serving import (ServingContext, UsageTally, check_logprobs, choice_chunks, completion_logprobs,
                                  wants_usage_chunk)
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, SSEResponse, parse

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default for completions


async def _prompts(ctx: ServingContext, prompt) -> tuple[list[list[int]], list[str | None]]:
    """-> (token ids per prompt, the text of each prompt when it was given as text)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "The prompt is empty.", param="prompt")
    ids, texts = [], []
    for k, p in enumerate(prompt):
        param = "prompt" if len(prompt) == 1 else f"prompt.{k}"
        if isinstance(p, str):
            tokens = await ctx.encode(p, prompt_param=param)
            texts.append(p)
        else:
            tokens = list(p)
            texts.append(None)
        ctx.check_prompt_ids(tokens, param)
        ids.append(tokens)
    return ids, texts


async def create_completion(ctx: ServingContext, request: Request) -> JSONResponse | SSEResponse:
    req = parse(CompletionRequest, request.json())
    ctx.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n).", param="best_of")
    check_logprobs(req.logprobs, "logprobs")
    check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    prompts, texts = await _prompts(ctx, req.prompt)
    spec = request_spec(req)
    guided = await ctx.grammars.get(spec) if spec is not None else None
    params = [ctx.sampling_params(req, len(p), DEFAULT_MAX_TOKENS, "prompt", logprobs=req.logprobs,
                                  prompt_logprobs=req.prompt_logprobs, guided=guided) for p in prompts]
    rid = f"cmpl-{uuid.uuid4().hex}"
    ctx.check_capacity(len(prompts), params[0].n)  # the whole batch, before any of it starts
    streams = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams += ctx.start_streams([ids], p, f"{rid}-{i}", req)
    except APIError:
        for stream in streams:
            await stream.aclose()
        raise
    n = params[0].n
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.response_model(req)}
    tally = UsageTally([len(p) for p in prompts], n)
    echo = [""] * len(streams)
    if req.echo:
        decoded = [text if text is not None else await ctx.decode(ids) for text, ids in zip(texts, prompts)]
        echo = [decoded[k // n] for k in range(len(streams))]
    if req.stream:
        return SSEResponse(_chunks(ctx, req, streams, base, echo, tally))
    return JSONResponse(await _response(ctx, req, streams, base, echo, tally))


async def _response(ctx: ServingContext, req: CompletionRequest, streams: list, base: dict, echo: list[str],
                    tally: UsageTally) -> dict:
    """The whole (non-streamed) response: a fold over the same chunks a stream sends."""
    text = list(echo)
    entries: list[list] = [[] for _ in streams]
    finish: list[tuple] = [(None, None)] * len(streams)
    prompt_lps: list = [None] * len(streams)
    async for chunk in choice_chunks(streams, tally):
        k, out = chunk.index, chunk.out
        text[k] += out.text
        entries[k] += out.logprobs or []
        if out.prompt_logprobs is not None:
            prompt_lps[k] = out.prompt_logprobs
        if out.finished:
            finish[k] = (chunk.finish_reason, out.stop_reason)
    choices = []
    for k in range(len(streams)):
        choice = {"index": k, "text": text[k],
                  "logprobs": completion_logprobs(ctx.tokenizer, entries[k], len(echo[k]))
                  if req.logprobs is not None else None,
                  "finish_reason": finish[k][0], "stop_reason": finish[k][1]}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _prompt_logprobs(ctx, prompt_lps[k])
        choices.append(choice)
    return {**base, "choices": choices, "usage": tally.usage()}


def _prompt_logprobs(ctx: ServingContext, entries: list | None) -> list | None:
    """vLLM's shape: one {token_id: {logprob, rank, decoded_token}} per prompt token (None for the first)."""
    if entries is None:
        return None
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token_id, logprob, rank, top = entry
        item = {str(token_id): {"logprob": logprob, "rank": rank,
                                "decoded_token": ctx.tokenizer.decode([token_id])}}
        for r, (top_id, top_lp) in enumerate(top, start=1):
            item.setdefault(str(top_id), {"logprob": top_lp, "rank": r,
                                          "decoded_token": ctx.tokenizer.decode([top_id])})
        out.append(item)
    return out


async def _chunks(ctx: ServingContext, req: CompletionRequest, streams: list, base: dict, echo: list[str],
                  tally: UsageTally) -> AsyncIterator[dict]:
    offsets = [len(e) for e in echo]
    for k, prefix in enumerate(echo):
        if prefix:
            yield {**base, "choices": [{"index": k, "text": prefix, "logprobs": None, "finish_reason": None}]}
    # After the 200 went out, an engine failure (an APIError from choice_chunks) becomes an SSE error event.
    async for chunk in choice_chunks(streams, tally):
        k, out = chunk.index, chunk.out
        lp = None
        if req.logprobs is not None and out.logprobs:
            lp = completion_logprobs(ctx.tokenizer, out.logprobs, offsets[k])
        offsets[k] += len(out.text)
        if out.text or lp is not None or out.finished:
            choice = {"index": k, "text": out.text, "logprobs": lp, "finish_reason": chunk.finish_reason}
            if out.finished:
                choice["stop_reason"] = out.stop_reason
            yield {**base, "choices": [choice]}
    if wants_usage_chunk(req):
        yield {**base, "choices": [], "usage": tally.usage()}
