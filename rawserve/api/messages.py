"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on chat's path. A request becomes a
ChatRequest (content blocks -> chat messages, tools, tool_choice, thinking -> the template's enable_thinking) and
runs through chat.start_chat; messages_stream.py turns the parser deltas into content blocks and named SSE events.

Every refusal is an APIError raised before a response header; these routes answer it in Anthropic's error shape
(`anthropic_errors`), and the router does the same for the HTTP layer's own refusals on these paths.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import orjson

from rawserve.api.chat import prompt_ids, start_chat
from rawserve.api.messages_stream import PING_EVENT, MessageRun, error_body, new_id
from rawserve.api.protocol import (ChatMessage, ChatRequest, FunctionCall, FunctionDefinition, SamplingExtensions,
                                   Tool, ToolCall)
from rawserve.api.serving import ServingContext
from rawserve.errors import APIError
from rawserve.http import Handler, JSONResponse, Request, Response, SSEResponse, parse
from rawserve.http.messages import error_response

log = logging.getLogger("rawserve.api")

MESSAGES_PATH = "/v1/messages"
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what Anthropic's base64 source takes
# Claude Code opens its system prompt with a block of billing metadata that changes with every request; kept, it
# would end each conversation's shared prefix at the first token, and with it every prefix-cache hit.
_BILLING_HEADER = "x-anthropic-billing-header"
# Chat's field names in its refusals -> the Messages field a client sent (first match wins).
_PARAMS = ((r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
           (r"tools\.(\d+)\.function\.", r"tools.\1."), (r"tool_choice\.function\.name", "tool_choice.name"),
           (r"stop\b", "stop_sequences"))


@dataclass(slots=True)
class MessagesRequest(SamplingExtensions):
    """Anthropic's request body (vLLM's sampling extensions and chat_template_kwargs also accepted). Messages,
    system blocks, tools and choices stay plain dicts: their shape depends on their `type`, checked block by block
    below so a 400 names the block's path."""
    model: str | None = None
    max_tokens: int | None = None  # required by /v1/messages, not by count_tokens
    messages: list[dict[str, Any]] | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _str_field(block: dict, key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise _bad(f"{param}.{key}", "Field required." if value is None else "Input should be a valid string.")
    return value


def _block_type(block: Any, param: str) -> str:
    if not isinstance(block, dict):
        raise _bad(param, "Input should be a content block (an object with a 'type').")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{param}.type", "Field required.")
    return kind


def _unsupported(kind: str, param: str, allowed: str) -> APIError:
    return _bad(f"{param}.type", f"content block type {kind!r} is not supported here; this server takes {allowed}.")


def _system_text(system: str | list[dict] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    texts = []
    for j, block in enumerate(system):
        kind = _block_type(block, f"system.{j}")
        if kind != "text":
            raise _unsupported(kind, f"system.{j}", "text blocks")
        text = _str_field(block, "text", f"system.{j}")
        if not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "\n".join(texts) or None


def _tool_result_content(block: dict, param: str) -> str | list[dict]:
    """A tool_result's content as a tool message's: its text (blocks joined by newlines) or, with images, chat's
    parts in order (a template renders a tool message's image parts as a user message's: Qwen3.5's inside its
    <tool_response>)."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{param}.content", "Input should be a string or an array of content blocks.")
    parts = []
    for k, part in enumerate(content):
        kind = _block_type(part, f"{param}.content.{k}")
        if kind == "text":
            parts.append({"type": "text", "text": _str_field(part, "text", f"{param}.content.{k}")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(part, f"{param}.content.{k}")}})
        else:
            raise _unsupported(kind, f"{param}.content.{k}", "text and image blocks in a tool_result")
    return _user_content(parts) if parts else ""


def _image_url(block: dict, param: str) -> str:
    """An image block's source as the URL chat's image parts carry: base64 data becomes a data: URL."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{param}.source", "Field required.")
    kind = source.get("type")
    if kind == "base64":
        media_type = _str_field(source, "media_type", f"{param}.source")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise _bad(f"{param}.source.media_type", f"Input should be one of {', '.join(IMAGE_MEDIA_TYPES)}.")
        return f"data:{media_type};base64,{_str_field(source, 'data', f'{param}.source')}"
    if kind == "url":
        return _str_field(source, "url", f"{param}.source")
    raise _bad(f"{param}.source.type", "Input should be 'base64' or 'url'.")


def _user_content(parts: list[dict]) -> str | list[dict]:
    """A user message's text (blocks joined by newlines) or, with images, chat's parts in order."""
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    merged: list[dict] = []
    for part in parts:
        if part["type"] == "text" and merged and merged[-1]["type"] == "text":
            merged[-1] = {"type": "text", "text": merged[-1]["text"] + "\n" + part["text"]}
        else:
            merged.append(part)
    return merged


def _user_turn(blocks: list, param: str) -> list[ChatMessage]:
    """A user turn's blocks, in order: text and images join one user message, each tool_result is a tool
    message."""
    out: list[ChatMessage] = []
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{param}.{j}")
        if kind == "text":
            parts.append({"type": "text", "text": _str_field(block, "text", f"{param}.{j}")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, f"{param}.{j}")}})
        elif kind == "tool_result":
            if parts:
                out.append(ChatMessage("user", _user_content(parts)))
                parts = []
            call_id = _str_field(block, "tool_use_id", f"{param}.{j}")
            out.append(ChatMessage("tool", _tool_result_content(block, f"{param}.{j}"), tool_call_id=call_id))
        else:
            raise _unsupported(kind, f"{param}.{j}", "text, image and tool_result blocks in a user message")
    if parts:
        out.append(ChatMessage("user", _user_content(parts)))
    return out


def image_params(req: MessagesRequest) -> list[str]:
    """Each image block's path, in the order chat_messages keeps them: images come only in user turns, directly
    or inside a tool_result's content, and a turn's messages keep its blocks' order."""
    params = []
    for i, message in enumerate(req.messages or ()):
        if message.get("role") != "user" or not isinstance(message.get("content"), list):
            continue
        for j, block in enumerate(message["content"]):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "image":
                params.append(f"messages.{i}.content.{j}")
            elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                params += [f"messages.{i}.content.{j}.content.{k}" for k, part in enumerate(block["content"])
                           if isinstance(part, dict) and part.get("type") == "image"]
    return params


def _assistant_turn(blocks: list, param: str) -> ChatMessage:
    """An assistant turn: text as its content, thinking as its reasoning_content, tool_use blocks as its calls."""
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = _block_type(block, f"{param}.{j}")
        if kind == "text":
            texts.append(_str_field(block, "text", f"{param}.{j}"))
        elif kind == "thinking":
            thoughts.append(_str_field(block, "thinking", f"{param}.{j}"))
        elif kind == "redacted_thinking":
            continue  # opaque by design: nothing a template could show
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise _bad(f"{param}.{j}.input", "Input should be an object.")
            calls.append(ToolCall(FunctionCall(_str_field(block, "name", f"{param}.{j}"),
                                               json.dumps(arguments, ensure_ascii=False)),
                                  id=_str_field(block, "id", f"{param}.{j}")))
        else:
            raise _unsupported(kind, f"{param}.{j}", "text, thinking and tool_use blocks in an assistant message")
    # Never null: templates (Qwen3's) read an assistant's content as a string even beside tool calls.
    content = "\n".join(texts)
    return ChatMessage("assistant", content, tool_calls=calls or None, reasoning_content="".join(thoughts) or None)


def chat_messages(req: MessagesRequest) -> list[ChatMessage]:
    """The system prompt and Anthropic's turns as chat messages (the template renders them as chat's would)."""
    if not req.messages:
        raise _bad("messages", "at least one message is required.")
    system = _system_text(req.system)
    out = [ChatMessage("system", system)] if system else []
    for i, message in enumerate(req.messages):
        param = f"messages.{i}"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{param}.role", "Input should be 'user' or 'assistant'.")
        content = message.get("content")
        if isinstance(content, str):
            out.append(ChatMessage(role, content))
        elif not isinstance(content, list):
            raise _bad(f"{param}.content", "Input should be a string or an array of content blocks.")
        elif role == "user":
            if not content:
                raise _bad(f"{param}.content", "a user message needs at least one content block.")
            out += _user_turn(content, f"{param}.content")
        else:
            out.append(_assistant_turn(content, f"{param}.content"))
    return out


def _tools(tools: list[dict] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):  # Anthropic's server tools (web_search_..., bash_...) run on its side
            raise _bad(f"tools.{i}.type", f"tool type {kind!r} is not supported by this server; it takes client "
                                          "tools (name, description, input_schema).")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools.{i}.input_schema", "Field required." if schema is None else "Input should be an object.")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"tools.{i}.description", "Input should be a valid string.")
        out.append(Tool(FunctionDefinition(_str_field(tool, "name", f"tools.{i}"), description, schema)))
    return out


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool]:
    """Anthropic's tool_choice -> (chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, True
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise _bad("tool_choice.disable_parallel_tool_use", "Input should be a valid boolean.")
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": _str_field(choice, "name", "tool_choice")}}, not disable
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if chat is None:
        raise _bad("tool_choice.type", "Input should be 'auto', 'any', 'tool' or 'none'.")
    return chat, not disable


def _thinking(thinking: dict | None) -> bool | None:
    """The template's thinking switch: True, False, or None (not asked: the template's default)."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind == "enabled":
        # budget_tokens is checked, not enforced: thinking ends when the model ends it, within max_tokens.
        budget = thinking.get("budget_tokens")
        if type(budget) is not int or budget < 1:
            raise _bad("thinking.budget_tokens", "Input should be a positive integer.")
        return True
    if kind == "adaptive":
        return True
    if kind == "disabled":
        return False
    raise _bad("thinking.type", "Input should be 'enabled', 'adaptive' or 'disabled'.")


def chat_request(req: MessagesRequest, *, counting: bool = False) -> ChatRequest:
    """The one internal request chat also runs: same template, tools, parsers and guided decoding. `counting`:
    for count_tokens, which has no max_tokens."""
    if not counting:
        if req.max_tokens is None:
            raise _bad("max_tokens", "Field required.")
        if req.max_tokens < 1:
            raise _bad("max_tokens", f"Input should be greater than or equal to 1, got {req.max_tokens}.")
    messages = chat_messages(req)
    choice, parallel = _tool_choice(req.tool_choice)
    metadata = req.metadata or {}
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise _bad("metadata.user_id", "Input should be a valid string.")
    shared = {f.name: getattr(req, f.name) for f in dataclasses.fields(SamplingExtensions)}
    if req.stop_sequences is not None:
        shared["stop"] = req.stop_sequences
    chat = ChatRequest(messages=messages, model=req.model, max_tokens=req.max_tokens, temperature=req.temperature,
                       top_p=req.top_p, tools=_tools(req.tools), tool_choice=choice, parallel_tool_calls=parallel,
                       user=user, **shared)
    thinking = _thinking(req.thinking)
    kwargs = {"enable_thinking": thinking} if thinking is not None else {}
    chat.chat_template_kwargs = {**kwargs, **(req.chat_template_kwargs or {})}
    # A final assistant turn is a prefill: the reply continues it, as Anthropic's does.
    chat.continue_final_message = messages[-1].role == "assistant"
    return chat


def _renamed(error: APIError) -> APIError:
    """A refusal from chat's path, naming the Messages field instead of chat's."""
    if error.param is None:
        return error
    for pattern, name in _PARAMS:
        renamed, n = re.subn("^" + pattern, name, error.param, count=1)
        if n:
            error.message = error.message.replace(error.param, renamed)
            error.param = renamed
            break
    return error


async def create_message(ctx: ServingContext, request: Request) -> JSONResponse | SSEResponse:
    req = parse(MessagesRequest, request.json())
    ctx.check_model(req.model)
    chat = chat_request(req)
    rid = new_id("msg")
    try:
        run = await start_chat(ctx, chat, rid, ctx.caller(request), image_params(req))
    except APIError as error:
        raise _renamed(error) from None
    message = MessageRun(ctx, req, rid, run)
    if req.stream:
        return SSEResponse(message.stream(request), named=True, ping=PING_EVENT)
    return JSONResponse(await message.whole())


async def count_tokens(ctx: ServingContext, request: Request) -> JSONResponse:
    """The prompt tokens /v1/messages would run for the same request: the same rendering, the same tokenizer."""
    req = parse(MessagesRequest, request.json())
    ctx.check_model(req.model)
    chat = chat_request(req, counting=True)
    try:
        _, _, ids, _ = await prompt_ids(ctx, chat, image_params(req))  # images read too: their tokens count
    except APIError as error:
        raise _renamed(error) from None
    return JSONResponse({"input_tokens": len(ids)})


def anthropic_error_response(error: APIError) -> Response:
    """`error` in Anthropic's shape, with the headers any error gets (x-should-retry, retry-after, its own)."""
    response = error_response(error)
    response.body = orjson.dumps(error_body(error))
    return response


def anthropic_errors(handler: Handler) -> Handler:
    """`handler` whose refusals (and crashes) are answered in Anthropic's shape rather than OpenAI's."""
    async def wrapped(request: Request) -> Response | SSEResponse:
        try:
            return await handler(request)
        except APIError as error:
            return anthropic_error_response(error)
        except Exception:  # the client gets Anthropic's api_error; the operator the traceback
            log.exception("handler for %s %s failed", request.method, request.path)
            return anthropic_error_response(APIError(500, "Internal server error.", code="internal_error"))
    return wrapped
