"""POST /v1/completions: text or token-id prompts (or a batch of them), n samples, echo, logprobs, streaming.

One HTTP request becomes len(prompts) x n engine requests; choice index = prompt * n + sample. With echo and
logprobs, a choice's logprobs cover the prompt's tokens first (what eval harnesses score), then the generated
ones; max_tokens 0 with echo is a scoring request that samples nothing.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rawserve.api.guided import request_spec
from rawserve.api.protocol import CompletionRequest
from rawserve.api.serving import (ServingContext, UsageTally, check_logprobs, choice_chunks, completion_logprobs,
                                  wants_continuous_usage, wants_usage_chunk)
from rawserve.engine.types import TokenLogprob
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


@dataclass(slots=True)
class Echo:
    """What each choice repeats of its prompt: the text, and (with logprobs) its tokens' entries."""
    texts: list[str]  # per choice; "" without echo
    prompts: list[list[int]]  # per choice, the prompt's ids
    with_logprobs: bool  # echo and logprobs: the prompt's tokens lead the choice's logprobs


async def create_completion(ctx: ServingContext, request: Request) -> JSONResponse | SSEResponse:
    req = parse(CompletionRequest, request.json())
    ctx.check_model(req.model)
    caller = ctx.caller(request)
    if req.suffix:
        raise APIError(400, "suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it must equal n).", param="best_of")
    check_logprobs(req.logprobs, "logprobs")
    check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens 0 samples nothing, so it needs echo (a scoring request).", param="max_tokens")
    prompts, texts = await _prompts(ctx, req.prompt)
    spec = request_spec(req)
    guided = await ctx.grammars.get(spec) if spec is not None else None
    echo_logprobs = req.echo and req.logprobs is not None
    # One prompt_logprobs run serves both uses: echoed logprobs (top `logprobs`) and prompt_logprobs (its own top).
    wanted = [v for v in (req.logprobs if echo_logprobs else None, req.prompt_logprobs) if v is not None]
    # Each prompt's context is checked on its own; the params are the same for all (max_tokens has a fixed default).
    params = [ctx.sampling_params(req, len(p), DEFAULT_MAX_TOKENS, "prompt", logprobs=req.logprobs,
                                  prompt_logprobs=max(wanted) if wanted else None, guided=guided, scoring=req.echo)
              for p in prompts][0]
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = ctx.start_streams(prompts, params, rid, req, caller)
    n = params.n
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.response_model(req)}
    tally = UsageTally([len(p) for p in prompts], n, caller.reservation)
    echo = Echo([""] * len(streams), [prompts[k // n] for k in range(len(streams))], echo_logprobs)
    if req.echo:
        decoded = [text if text is not None else await ctx.decode(ids) for text, ids in zip(texts, prompts)]
        echo.texts = [decoded[k // n] for k in range(len(streams))]
    if req.stream:
        return SSEResponse(_chunks(ctx, req, streams, base, echo, tally))
    return JSONResponse(await _response(ctx, req, streams, base, echo, tally))


def _echoed_entries(prompt_ids: list[int], entries: list[TokenLogprob | None] | None) -> list:
    """The prompt's logprob entries as completion_logprobs reads them: the first token's is (id, None, ...)."""
    if not entries:
        return []
    return [entry if entry is not None else (prompt_ids[i], None, None, ()) for i, entry in enumerate(entries)]


def _logprobs(ctx: ServingContext, req: CompletionRequest, echo: Echo, k: int, prompt_lps: list | None,
              generated: list, offset: int) -> dict | None:
    """A choice's logprobs (or one chunk's): the echoed prompt's entries when given, then the generated ones."""
    if req.logprobs is None:
        return None
    lead = completion_logprobs(ctx.tokenizer, _echoed_entries(echo.prompts[k], prompt_lps), 0, req.logprobs) \
        if echo.with_logprobs and prompt_lps is not None else None
    tail = completion_logprobs(ctx.tokenizer, generated, offset, req.logprobs)
    if lead is None:
        return tail
    return {key: lead[key] + tail[key] for key in tail}


async def _response(ctx: ServingContext, req: CompletionRequest, streams: list, base: dict, echo: Echo,
                    tally: UsageTally) -> dict:
    """The whole (non-streamed) response: a fold over the same chunks a stream sends."""
    text = list(echo.texts)
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
        choices.append({"index": k, "text": text[k],
                        "logprobs": _logprobs(ctx, req, echo, k, prompt_lps[k], entries[k], len(echo.texts[k])),
                        "finish_reason": finish[k][0], "stop_reason": finish[k][1],
                        "prompt_logprobs": _prompt_logprobs(ctx, prompt_lps[k], req.prompt_logprobs)})
    return {**base, "choices": choices, "usage": tally.usage()}


def _prompt_logprobs(ctx: ServingContext, entries: list | None, num_top: int | None) -> list | None:
    """vLLM's shape: one {token_id: {logprob, rank, decoded_token}} per prompt token (None for the first)."""
    if entries is None or num_top is None:
        return None
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token_id, logprob, rank, top = entry
        item = {str(token_id): {"logprob": logprob, "rank": rank,
                                "decoded_token": ctx.tokenizer.decode([token_id])}}
        for r, (top_id, top_lp) in enumerate(top[:num_top], start=1):
            item.setdefault(str(top_id), {"logprob": top_lp, "rank": r,
                                          "decoded_token": ctx.tokenizer.decode([top_id])})
        out.append(item)
    return out


async def _chunks(ctx: ServingContext, req: CompletionRequest, streams: list, base: dict, echo: Echo,
                  tally: UsageTally) -> AsyncIterator[dict]:
    continuous = wants_continuous_usage(req)

    def event(choice: dict) -> dict:
        if continuous:  # vLLM's continuous_usage_stats: the counts so far on every chunk
            return {**base, "choices": [choice], "usage": tally.usage(running=True)}
        return {**base, "choices": [choice]}

    offsets = [len(e) for e in echo.texts]
    # An echoed prompt goes out at once, unless its logprobs must come with it: those arrive with the first output.
    pending_echo = list(echo.texts)
    if not echo.with_logprobs:
        for k, prefix in enumerate(echo.texts):
            if prefix:
                yield event({"index": k, "text": prefix, "logprobs": None, "finish_reason": None})
        pending_echo = [""] * len(streams)
    # After the 200 went out, an engine failure (an APIError from choice_chunks) becomes an SSE error event.
    async for chunk in choice_chunks(streams, tally):
        k, out = chunk.index, chunk.out
        prefix, pending_echo[k] = pending_echo[k], ""
        lead_lps = out.prompt_logprobs if echo.with_logprobs else None  # sent once, with the first output
        lp = None
        if req.logprobs is not None and (out.logprobs or lead_lps is not None):
            lp = _logprobs(ctx, req, echo, k, lead_lps, out.logprobs or [], offsets[k])
        offsets[k] += len(out.text)
        if prefix or out.text or lp is not None or out.finished or out.prompt_logprobs is not None:
            choice = {"index": k, "text": prefix + out.text, "logprobs": lp, "finish_reason": chunk.finish_reason}
            if out.finished:
                choice["stop_reason"] = out.stop_reason
            if out.prompt_logprobs is not None and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(ctx, out.prompt_logprobs, req.prompt_logprobs)
            yield event(choice)
    if wants_usage_chunk(req):
        yield {**base, "choices": [], "usage": tally.usage()}
