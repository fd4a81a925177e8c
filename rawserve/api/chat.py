"""POST /v1/chat/completions: messages -> chat template -> engine; reasoning and tool calls parsed from the
output; the response or its SSE chunks in OpenAI's shapes.

Refusals (bad fields, template errors, overload) are raised before any header; errors after the
stream started go out as an SSE error event (http/sse.py).
"""
from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from rawserve.api.guided import ToolForcing, request_spec, think_mode
from rawserve.api.media import ImagePart
from rawserve.api.protocol import ChatMessage, ChatRequest
from rawserve.api.serving import (Caller, ServingContext, UsageTally, chat_logprobs, check_logprobs, choice_chunks,
                                  wants_continuous_usage, wants_usage_chunk)
from rawserve.engine.frontend.async_llm import RequestStream
from rawserve.engine.frontend.output_processor import TextOutput
from rawserve.engine.mm_inputs import MultiModalInputs, expand_placeholders
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, SSEResponse, parse
from rawserve.text.chat_template import RESERVED_KWARGS, render_chat
from rawserve.text.parsers import OutputParser, prompt_opens_reasoning


def message_dicts(messages: list[ChatMessage], images: list[ImagePart] | None = None) -> list[dict]:
    """Typed messages -> the plain dicts chat templates expect. Text parts are joined into one string; a message
    with images keeps its parts in order, as HF's processors hand them to templates ({"type": "image"} and
    {"type": "text", "text": ...}), and each image part is appended to `images` (when given) with its path."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.role, str) or not m.role:
            raise APIError(400, "A message's role must be a non-empty string.", param=f"messages.{i}.role")
        content = m.content
        if isinstance(content, list):
            parts: list[dict] = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind == "image_url":
                    url = image_url(part, f"messages.{i}.content.{j}")
                    if images is not None:
                        images.append(ImagePart(url, f"messages.{i}.content.{j}"))
                    parts.append({"type": "image"})
                    continue
                if kind != "text":
                    raise APIError(400, f"Content part type {kind!r} is not supported; 'text' and 'image_url' "
                                        "parts are.", param=f"messages.{i}.content.{j}")
                if not isinstance(part.get("text"), str):
                    got = "no 'text'" if part.get("text") is None else f"'text' of type {type(part['text']).__name__}"
                    raise APIError(400, f"A content part of type 'text' needs a string 'text'; this one has {got}.",
                                   param=f"messages.{i}.content.{j}.text")
                if parts and parts[-1]["type"] == "text":  # adjacent texts join, as they always have
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + part["text"]}
                else:
                    parts.append({"type": "text", "text": part["text"]})
            has_image = any(p["type"] == "image" for p in parts)
            content = parts if has_image else "".join(p["text"] for p in parts)
        message: dict = {"role": m.role, "content": content}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            message["reasoning_content"] = m.reasoning_content
        if m.tool_calls:  # arguments as sent (a JSON string): render_chat hands templates the mapping
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}} for call in m.tool_calls]
        out.append(message)
    return out


def image_url(part: dict, param: str) -> str:
    """An OpenAI image part's URL: {"type": "image_url", "image_url": {"url": ..., "detail": ...}}. detail is
    checked and otherwise unused: the checkpoint's processor decides the resolution."""
    body = part.get("image_url")
    if not isinstance(body, dict) or not isinstance(body.get("url"), str) or not body["url"]:
        raise APIError(400, "A content part of type 'image_url' needs an object 'image_url' with a non-empty string "
                            "'url'.", param=f"{param}.image_url", code="invalid_value")
    detail = body.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise APIError(400, f"Invalid value for '{param}.image_url.detail': expected 'auto', 'low' or 'high'.",
                       param=f"{param}.image_url.detail", code="invalid_value")
    return body["url"]


def reasoning_effort_kwargs(effort: str) -> dict:
    """A reasoning effort as template variables: gpt-oss's `reasoning_effort` (its system message's "Reasoning:"
    line), and the thinking switch of templates that have one (Qwen3's enable_thinking: off for none/minimal)."""
    return {"reasoning_effort": effort, "enable_thinking": effort not in ("none", "minimal")}


def tool_forcing(ctx: ServingContext, req: ChatRequest) -> ToolForcing | None:
    """tool_choice 'required' or {"type": "function", "function": {"name": ...}} as a grammar input:
    calls in the model's own format, each naming a listed tool with arguments valid for it."""
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    if not req.tools:
        raise APIError(400, "tool_choice other than 'none' or 'auto' needs a non-empty tools list.",
                       param="tool_choice")
    tools = [(i, t.function.name, json.dumps(t.function.parameters, ensure_ascii=False)
              if t.function.parameters is not None else "") for i, t in enumerate(req.tools)]
    parallel = req.parallel_tool_calls
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                '"function": {"name": "..."}}.', param="tool_choice")
        tools = [t for t in tools if t[1] == name]
        if not tools:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools.",
                           param="tool_choice.function.name")
        parallel = False  # a named choice is one call to that function, as OpenAI makes it
    return ToolForcing(tuple(tools), parallel, ctx.tool_call_parser)


def render_prompt(ctx: ServingContext, req: ChatRequest, images: list[ImagePart] | None = None) -> tuple[str, bool]:
    """-> (prompt text, whether tool calls are parsed). Each image renders as the template's one placeholder;
    its part is appended to `images` when given."""
    if not req.messages:
        raise APIError(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an "
                            "empty array instead.", param="messages", code="empty_array")
    if ctx.chat_template is None:
        raise APIError(400, "This model has no chat template; use /v1/completions or start the server with "
                            "--chat-template.", param="messages")
    choice = req.tool_choice
    tools = None
    if req.tools and choice != "none":
        tools = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.function.name), ("description", t.function.description),
            ("parameters", t.function.parameters)) if v is not None}} for t in req.tools]
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # chat_template_kwargs, being more specific, win
        kwargs = {**reasoning_effort_kwargs(req.reasoning_effort), **kwargs}
    reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
    if reserved:  # the renderer's own arguments and limits (the size cap, the clock) are the server's
        raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}: the server provides it.",
                       param=f"chat_template_kwargs.{reserved[0]}")
    tok = ctx.tokenizer
    messages = message_dicts(req.messages, images)
    add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
    try:
        text = render_chat(ctx.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token or "", eos_token=tok.eos_token or "", **kwargs)
    except ValueError as error:
        raise APIError(400, f"Chat template error: {error}", param="messages") from None
    if req.continue_final_message:
        last = final_text(messages[-1].get("content"))
        cut = text.rfind(last) if last else -1
        if cut >= 0:
            text = text[:cut + len(last)]
    return text, tools is not None


async def create_chat_completion(ctx: ServingContext, request: Request) -> JSONResponse | SSEResponse:
    req = parse(ChatRequest, request.json())
    ctx.check_model(req.model)
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = await start_chat(ctx, req, rid, ctx.caller(request))
    base = {"id": rid, "created": int(time.time()), "model": ctx.response_model(req)}
    if req.stream:
        return SSEResponse(_chunks(ctx, req, run.streams, run.parsers, base, run.tally, run.decide))
    return JSONResponse(await _response(ctx, req, run.streams, run.parsers, base, run.tally, run.decide,
                                        run.forced))


def echoed_content(req: ChatRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message's content when that message is the assistant's
    (a reply being continued); otherwise nothing."""
    if not req.echo or not req.messages or req.messages[-1].role != "assistant":
        return ""
    return final_text(message_dicts(req.messages[-1:])[0].get("content"))


def final_text(content: str | list[dict] | None) -> str:
    """A rendered message's content as the text a continued reply follows: with images, its last text part
    (nothing when it ends in an image)."""
    if isinstance(content, list):
        return content[-1].get("text", "") if content else ""
    return content or ""


@dataclass(slots=True)
class ChatRun:
    """A chat-shaped request started on the engine: what /v1/chat/completions and /v1/responses both render."""
    streams: list[RequestStream]
    parsers: list[OutputParser]
    tally: UsageTally
    forced: ToolForcing | None
    decide: Callable  # finish_reason(out, parser), bound to this request's tool_choice


async def prompt_ids(ctx: ServingContext, req: ChatRequest,
                     image_params: Sequence[str] | None = None) -> tuple[str, bool, list[int], MultiModalInputs | None]:
    """The rendered prompt, whether tool calls are parsed, its ids with each image's placeholder expanded to the
    image's tokens, and the images (None without any). `image_params`: the image parts' paths as the client
    named them, in order, when the request came in another API's shape (Responses, Messages)."""
    parts: list[ImagePart] = []
    text, use_tools = render_prompt(ctx, req, parts)
    if image_params is not None:
        parts = [ImagePart(part.url, param) for part, param in zip(parts, image_params, strict=True)]
    if parts and ctx.images is None:
        raise APIError(400, "This server takes no images.", param=parts[0].param, code="images_unsupported")
    if parts:
        ctx.images.check(parts)  # before the prompt is tokenized or any image fetched
    # The template already put BOS (or not) where the model wants it.
    ids = await ctx.encode(text, add_special_tokens=False, prompt_param="messages")
    if not parts:
        if ctx.images is not None and ctx.images.image_token_id is not None \
                and ctx.images.image_token_id in ids:  # the core would look for an image that is not there
            raise APIError(400, "The prompt spells the image placeholder token but carries no image.",
                           param="messages")
        return text, use_tools, ids, None
    placed = ids.count(ctx.images.image_token_id)
    if placed != len(parts):  # checked before any image is fetched; expand_placeholders relies on it
        raise APIError(400, f"The chat template does not place this request's images: the prompt holds {placed} "
                            f"image placeholder(s) for {len(parts)} image(s). (A text part must not spell the image "
                            "placeholder itself.)", param="messages")
    images = await ctx.images.read(parts)
    ids, images = expand_placeholders(ids, ctx.images.image_token_id, images)
    ctx.llm.metrics.inc("mm_items_received_total", len(images), label_value="image")
    return text, use_tools, ids, MultiModalInputs(images)


async def start_chat(ctx: ServingContext, req: ChatRequest, rid: str, caller: Caller,
                     image_params: Sequence[str] | None = None) -> ChatRun:
    """Template, images, tools, structured output, tokens, sampling params and admission: every refusal is an
    APIError raised here, before a response header. Errors name chat's fields (messages, max_tokens), or an
    image part by its path in `image_params` (see prompt_ids).
    `caller`: the request's key (token bucket, cache salt) and its own deadline."""
    check_logprobs(req.top_logprobs, "top_logprobs")
    text, use_tools, ids, features = await prompt_ids(ctx, req, image_params)
    forced = tool_forcing(ctx, req)
    spec = request_spec(req, tools=forced, think=think_mode(text, ctx.reasoning_parser))
    guided = await ctx.grammars.get(spec) if spec is not None else None
    ctx.check_prompt_ids(ids, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    opened = prompt_opens_reasoning(text) if ctx.reasoning_parser else None
    markers = OutputParser(ctx.reasoning_parser, use_tools, tool_parser=ctx.tool_call_parser).markers
    # Markers the checkpoint makes special tokens: skip_special_tokens must not drop them before the parsers,
    # which then keep them out of the message (as skipping would have). Without skipping they show as any
    # special token does where a block turns out not to be a call.
    special = ctx.tokenizer.special_ids_of(markers) if req.skip_special_tokens else frozenset()
    hidden = tuple(m for m in markers if ctx.tokenizer.token_to_id(m) in special)
    params = ctx.sampling_params(req, len(ids), None, "messages", logprobs=logprobs, guided=guided,
                                 keep_special_tokens=hidden)
    streams = ctx.start_streams([ids], params, rid, req, caller, features=features)
    schemas = {t.function.name: t.function.parameters for t in req.tools or ()}  # what the XML form's values are
    parsers = [OutputParser(ctx.reasoning_parser, use_tools, tool_parser=ctx.tool_call_parser,
                            starts_in_reasoning=opened, hidden_markers=hidden, tools=schemas) for _ in streams]
    decide = functools.partial(finish_reason, forced=forced, named=isinstance(req.tool_choice, dict))
    return ChatRun(streams, parsers, UsageTally([len(ids)], params.n, caller.reservation), forced, decide)


def finish_reason(out: TextOutput, parser: OutputParser | None, *, forced: ToolForcing | None = None,
                  named: bool = False) -> str | None:
    """A choice's finish_reason, decided once for streamed and whole responses: the engine's, or "tool_calls"
    when the output parser found calls ("stop" for a named tool_choice, as OpenAI); a forced call cut short by
    max_tokens stays "length"."""
    if forced is not None and out.finish_reason == "length":
        return "length"
    if parser is not None and parser.has_tool_calls:
        return "stop" if named else "tool_calls"
    return out.finish_reason


async def _response(ctx: ServingContext, req: ChatRequest, streams: list, parsers: list[OutputParser], base: dict,
                    tally: UsageTally, decide: Callable, forced: ToolForcing | None) -> dict:
    """The whole (non-streamed) response: a fold over the same chunks a stream sends."""
    echo = echoed_content(req)
    messages = [{"role": "assistant", "content": ""} for _ in streams]
    entries: list[list] = [[] for _ in streams]
    finish: list[tuple] = [(None, None)] * len(streams)
    async for chunk in choice_chunks(streams, tally, parsers, decide):
        k, out = chunk.index, chunk.out
        for delta in chunk.deltas:
            _accumulate(messages[k], delta)
        entries[k] += out.logprobs or []
        if out.finished:
            finish[k] = (chunk.finish_reason, out.stop_reason)
    choices = []
    for k, message in enumerate(messages):
        if forced is not None and finish[k][0] == "length":  # a forced call cut short is no call
            message["tool_calls"] = []
        message["content"] = echo + message["content"]
        if message.get("tool_calls") is not None and not message["content"]:
            message["content"] = None
        choices.append({"index": k, "message": message, "logprobs": chat_logprobs(ctx.tokenizer, entries[k])
                        if req.logprobs else None, "finish_reason": finish[k][0], "stop_reason": finish[k][1]})
    return {**base, "object": "chat.completion", "choices": choices, "usage": tally.usage()}


def _accumulate(message: dict, delta: dict) -> None:
    """Fold one streamed delta into a whole message (non-streaming responses)."""
    for key in ("content", "reasoning_content"):
        if key in delta:
            message[key] = (message.get(key) or "") + delta[key]
    for call in delta.get("tool_calls", ()):
        calls = message.setdefault("tool_calls", [])
        if "id" in call:
            calls.append({"id": call["id"], "type": "function",
                          "function": {"name": call["function"]["name"], "arguments": ""}})
        calls[-1]["function"]["arguments"] += call["function"].get("arguments", "")


async def _chunks(ctx: ServingContext, req: ChatRequest, streams: list, parsers: list[OutputParser], base: dict,
                  tally: UsageTally, decide: Callable) -> AsyncIterator[dict]:
    base = {**base, "object": "chat.completion.chunk"}
    continuous = wants_continuous_usage(req)

    def event(choice: dict) -> dict:
        if continuous:  # vLLM's continuous_usage_stats: the counts so far on every chunk
            return {**base, "choices": [choice], "usage": tally.usage(running=True)}
        return {**base, "choices": [choice]}

    echo = echoed_content(req)
    for k in range(len(streams)):
        yield event({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
        if echo:
            yield event({"index": k, "delta": {"content": echo}, "logprobs": None, "finish_reason": None})
    # After the 200 went out, an engine failure (an APIError from choice_chunks) becomes an SSE error event.
    async for chunk in choice_chunks(streams, tally, parsers, decide):
        k, out = chunk.index, chunk.out
        lp = chat_logprobs(ctx.tokenizer, out.logprobs) if req.logprobs and out.logprobs else None
        for delta in chunk.deltas or ([{}] if lp else []):
            yield event({"index": k, "delta": delta, "logprobs": lp, "finish_reason": None})
            lp = None
        if out.finished:
            yield event({"index": k, "delta": {}, "logprobs": None, "finish_reason": chunk.finish_reason,
                         "stop_reason": out.stop_reason})
    if wants_usage_chunk(req):
        yield {**base, "choices": [], "usage": tally.usage()}
