"""POST /v1/responses and the stored responses (GET, DELETE, input_items): OpenAI's Responses API on chat's
path. A request becomes a ChatRequest (items -> messages, tools, tool_choice, text.format) and runs through
chat.start_chat; its parser deltas become output items, and, streamed, Responses events with `event:` lines.

Refusals are raised before any header and name the Responses field; once a stream has started, a failure
goes out as `response.failed`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rawserve.api import access_log
from rawserve.api.chat import ChatRun, start_chat
from rawserve.api.protocol import (ChatMessage, ChatRequest, FunctionCall, FunctionDefinition, ResponseFormat,
                                   ResponsesRequest, SamplingExtensions, Tool, ToolCall)
from rawserve.api.response_store import MAX_CHAIN_TURNS, ResponseStore, StoredResponse
from rawserve.api.serving import ServingContext, chat_logprobs, choice_chunks
from rawserve.errors import APIError
from rawserve.http import JSONResponse, Request, SSEResponse, parse

# Responses fields chat has under the same names, besides the SamplingExtensions both inherit.
_SHARED_FIELDS = ("temperature", "top_p", "parallel_tool_calls", "user",
                  *(f.name for f in dataclasses.fields(SamplingExtensions)))
# Chat's field names in its errors -> the Responses field a client sent (longest prefix first).
_PARAMS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("tool_choice.function.name", "tool_choice.name"), ("max_tokens", "max_output_tokens"),
           ("messages", "input"))
_TERMINAL = ("response.completed", "response.incomplete")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
MAX_INPUT_ITEMS_PAGE = 100
# The one `include` value rawserve has data for; the others name outputs of tools it does not run, or
# encrypted reasoning it cannot produce.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's limits on `metadata`: it refuses more, and a client relying on them should get the same 400 here.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    # OpenAI answers an unknown (or another key's) response with a 404 of type invalid_request_error.
    return APIError(404, message, param=param, code=code, type="invalid_request_error")


def _check_unsupported(req: ResponsesRequest) -> None:
    """Fields that would change what the request means, which rawserve cannot honour: a 400 naming them."""
    if req.background:
        raise APIError(400, "background responses are not supported by this server.", param="background")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is not supported by this server.", param=name)
    for value in req.include or ():
        if value != LOGPROBS_INCLUDE:
            raise APIError(400, f"include value {value!r} is not supported by this server; it supports only "
                                f"{LOGPROBS_INCLUDE!r}.", param="include", code="invalid_value")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"Invalid 'metadata': too many properties. Expected an object with at most "
                            f"{MAX_METADATA_PAIRS} properties, but got an object with {len(metadata)} properties "
                            "instead.", param="metadata", code="object_above_max_size")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise APIError(400, f"Invalid 'metadata': key {key[:MAX_METADATA_KEY_CHARS]!r}... is {len(key)} "
                                f"characters long; the limit is {MAX_METADATA_KEY_CHARS}.", param="metadata",
                           code="string_above_max_length")
        if isinstance(value, str) and len(value) > MAX_METADATA_VALUE_CHARS:
            raise APIError(400, f"Invalid 'metadata': the value of {key!r} is {len(value)} characters long; the "
                                f"limit is {MAX_METADATA_VALUE_CHARS}.", param="metadata",
                           code="string_above_max_length")


def _text_of(content: Any, param: str, images: bool = False) -> str:
    """A message's (or a tool output's) text: a string, or text parts joined; any other part is a 400, but for
    input_image parts where `images` allows them (checked here, left out of the text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"Invalid type for '{param}': expected a string or an array of content parts.",
                       param=param, code="invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            _image_url(part, f"{param}.{j}")
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            allowed = "text parts (input_text, output_text) and input_image" if images else \
                "text parts (input_text, output_text)"
            raise APIError(400, f"Content part type {kind!r} is not supported here by this server; only {allowed} "
                                "are.", param=f"{param}.{j}.type")
        texts.append(part["text"])
    return "".join(texts)


def _image_url(part: dict, param: str) -> str:
    """An input_image part's URL (a data: URL or an http(s) or file:// one); file_id names an upload this
    server has no store for."""
    url = part.get("image_url")
    if part.get("file_id") is not None and url is None:
        raise APIError(400, "input_image with file_id is not supported by this server (it has no file store); "
                            "send image_url.", param=f"{param}.file_id")
    if not isinstance(url, str) or not url:
        raise APIError(400, f"Missing required parameter: '{param}.image_url'.", param=f"{param}.image_url",
                       code="missing_required_parameter")
    detail = part.get("detail")
    if detail is not None and detail not in ("auto", "low", "high"):
        raise APIError(400, f"Invalid value for '{param}.detail': expected 'auto', 'low' or 'high'.",
                       param=f"{param}.detail", code="invalid_value")
    return url


def _message_content(content: Any) -> str | list[dict]:
    """A checked message item's content for chat: its text, or with images chat's parts in order."""
    if isinstance(content, str) or not any(part.get("type") == "input_image" for part in content):
        return _text_of(content, "input")
    return [{"type": "image_url", "image_url": {"url": part["image_url"]}} if part["type"] == "input_image"
            else {"type": "text", "text": part["text"]} for part in content]


def image_params(history: list[dict], items: list[dict]) -> list[str]:
    """Each input_image's path in the order chat_messages keeps them: this request's as input.K.content.J, an
    earlier turn's as the previous_response_id that brought it."""
    def images(item: dict) -> list[int]:
        content = item.get("content") if item.get("type") == "message" else None
        return [j for j, part in enumerate(content) if part.get("type") == "input_image"] \
            if isinstance(content, list) else []

    return [*("previous_response_id" for item in history for _ in images(item)),
            *(f"input.{k}.content.{j}" for k, item in enumerate(items) for j in images(item))]


def _required_str(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        where = f"{param}.{key}"
        if value is None:
            raise APIError(400, f"Missing required parameter: '{where}'.", param=where,
                           code="missing_required_parameter")
        raise APIError(400, f"Invalid type for '{where}': expected a string.", param=where, code="invalid_type")
    return value


def input_items(value: str | list[dict] | None) -> list[dict]:
    """The request's input as stored items, each with an id (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"id": _new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    items = []
    for i, item in enumerate(value):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"Invalid value for '{param}.role': expected one of {', '.join(_ROLES)}.",
                               param=f"{param}.role", code="invalid_value")
            content = item.get("content")
            text = _text_of(content, f"{param}.content", images=role != "assistant")
            if isinstance(content, str):
                content = [{"type": "output_text" if role == "assistant" else "input_text", "text": text}]
            items.append({"id": item.get("id") or _new_id("msg"), "type": "message", "role": role,
                          "status": item.get("status") or "completed", "content": content})
        elif kind == "function_call":
            items.append({"id": item.get("id") or _new_id("fc"), "type": "function_call",
                          "status": item.get("status") or "completed",
                          "arguments": _required_str(item, "arguments", param),
                          "call_id": _required_str(item, "call_id", param), "name": _required_str(item, "name", param)})
        elif kind == "function_call_output":
            output = item.get("output")
            _text_of(output, f"{param}.output")
            items.append({"id": item.get("id") or _new_id("fco"), "type": "function_call_output",
                          "call_id": _required_str(item, "call_id", param), "output": output,
                          "status": item.get("status") or "completed"})
        elif kind == "reasoning":
            items.append({**item, "id": item.get("id") or _new_id("rs")})
        else:
            raise APIError(400, f"Input item type {kind!r} is not supported by this server.", param=f"{param}.type")
    return items


def chat_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """Items -> chat messages: function calls join the assistant turn before them, a reasoning item becomes
    the next assistant turn's reasoning_content; developer goes to the renderer, which makes it the system role
    when the template does not know it."""
    messages = [ChatMessage("system", instructions)] if instructions else []
    reasoning: str | None = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "message":
            role = item["role"]
            messages.append(ChatMessage(role, _message_content(item["content"])))
            if role == "assistant":
                messages[-1].reasoning_content, reasoning = reasoning, None
        elif kind == "function_call":
            call = ToolCall(FunctionCall(item["name"], item["arguments"]), id=item["call_id"])
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant" or reasoning is not None:
                # Made with its first call: an assistant message with neither content nor tool_calls is refused.
                messages.append(ChatMessage("assistant", None, tool_calls=[call], reasoning_content=reasoning))
                reasoning = None
            else:
                last.tool_calls = [*(last.tool_calls or ()), call]
        elif kind == "function_call_output":
            messages.append(ChatMessage("tool", _text_of(item["output"], "input"), tool_call_id=item["call_id"]))
    return messages


def _tools(tools: list[dict] | None) -> list[Tool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"Tool type {tool.get('type')!r} is not supported by this server; only 'function' "
                                "tools are.", param=f"tools.{i}.type")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, f"Invalid type for 'tools.{i}.parameters': expected an object.",
                           param=f"tools.{i}.parameters", code="invalid_type")
        out.append(Tool(FunctionDefinition(_required_str(tool, "name", f"tools.{i}"), tool.get("description"),
                                           parameters, tool.get("strict"))))
    return out


def _tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": "..."}'
                            "; other tool choices are not supported by this server.", param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatRequest:
    """The one internal request chat also runs: same template, tools, parsers and guided decoding."""
    chat = ChatRequest(messages=messages, model=req.model, max_tokens=req.max_output_tokens, tools=_tools(req.tools),
                       tool_choice=_tool_choice(req.tool_choice), logprobs=wants_logprobs(req),
                       top_logprobs=req.top_logprobs, **{name: getattr(req, name) for name in _SHARED_FIELDS})
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat.response_format = ResponseFormat("json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema is None:
            raise APIError(400, "Missing required parameter: 'text.format.schema'.", param="text.format.schema",
                           code="missing_required_parameter")
        chat.response_format = ResponseFormat("json_schema", {"name": fmt.name, "schema": fmt.schema})
    effort = req.reasoning.effort if req.reasoning is not None else None
    chat.reasoning_effort = effort  # the template's variables for it: chat.reasoning_effort_kwargs
    chat.chat_template_kwargs = req.chat_template_kwargs
    return chat


def wants_logprobs(req: ResponsesRequest) -> bool:
    """OpenAI reports logprobs only when `include` asks for them; top_logprobs alone adds nothing."""
    return LOGPROBS_INCLUDE in (req.include or ())


def _renamed(error: APIError) -> APIError:
    """A refusal from chat's path, naming the Responses field instead of chat's."""
    if error.param is not None and re.match(r"tools\.\d+\.function\.", error.param):  # a flat tool in Responses
        error.param = error.param.replace(".function.", ".", 1)
        return error
    for chat_name, name in _PARAMS:
        if error.param is not None and (error.param == chat_name or error.param.startswith(chat_name + ".")):
            error.param = name + error.param[len(chat_name):]
            error.message = error.message.replace(chat_name, name)
            break
    return error


class OutputItems:
    """Parser deltas -> output items, and the events a stream sends for them (without sequence numbers).

    Whitespace before any text (the newline between tool calls) waits: it opens a message only if text
    follows, or if the response would otherwise have no output.

    Logprobs (`add_logprobs`, OpenAI's entries of the tokens just generated) wait for the text they made: they go
    on the next output_text delta and its part; tokens whose text became reasoning or a call are dropped, as is
    a last token with no text (the end-of-turn token).
    """

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None
        self._text = ""
        self._blank = ""
        self._logprobs: list[dict] = []  # the open message's, for its part and output_text.done
        self._pending: list[dict] = []  # entries whose text has not gone out yet

    def add_logprobs(self, entries: list[dict]) -> None:
        self._pending += entries

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if "reasoning_content" in delta:
            self._pending = []
            events += self._ensure("reasoning")
            events.append(self._delta("response.reasoning_summary_text.delta", delta["reasoning_content"],
                                      summary_index=0))
        if "content" in delta:
            text = self._blank + delta["content"]
            is_open = self._open is not None and self._open["type"] == "message"
            if not is_open and not text.strip():
                self._blank = text
            else:
                events += self._ensure("message")
                self._blank = ""
                events.append(self._text_delta(text))
        for call in delta.get("tool_calls", ()):
            self._pending = []
            function = call["function"]
            if "id" in call:
                events += self._close("completed")
                self._blank = ""
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                        "call_id": call["id"], "name": function["name"]}
                events += self._add(item)
            if function.get("arguments"):
                events.append(self._delta("response.function_call_arguments.delta", function["arguments"]))
        return events

    def finish(self, status: str) -> list[dict]:
        events = []
        if self._blank and not self.items:
            events += self._ensure("message")
            events.append(self._text_delta(self._blank))
        return events + self._close(status)

    def _text_delta(self, text: str) -> dict:
        entries, self._pending = self._pending, []
        self._logprobs += entries
        return self._delta("response.output_text.delta", text, content_index=0, logprobs=entries)

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _delta(self, kind: str, text: str, **fields: Any) -> dict:
        self._text += text
        return {"type": kind, **self._where(), **fields, "delta": text}

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self._open, self._text, self._logprobs = item, "", []
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close("completed")
        if kind == "message":
            events += self._add({"id": _new_id("msg"), "type": "message", "status": "in_progress", "content": [],
                                 "role": "assistant"})
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part})
        else:
            events += self._add({"id": _new_id("rs"), "type": "reasoning", "summary": []})
            events.append({"type": "response.reasoning_summary_part.added", **self._where(), "summary_index": 0,
                           "part": {"type": "summary_text", "text": ""}})
        return events

    def _close(self, status: str) -> list[dict]:
        item = self._open
        if item is None:
            return []
        where, text = self._where(), self._text
        if item["type"] == "message":
            part = {"type": "output_text", "annotations": [], "logprobs": self._logprobs, "text": text}
            item["content"] = [part]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                       "logprobs": self._logprobs},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        elif item["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            item["summary"] = [part]
            events = [{"type": "response.reasoning_summary_text.done", **where, "summary_index": 0, "text": text},
                      {"type": "response.reasoning_summary_part.done", **where, "summary_index": 0, "part": part}]
        else:
            item["arguments"] = text
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        if "status" in item:
            item["status"] = status
        self._open, self._text = None, ""
        return [*events, {"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": dict(item)}]


def _pick(value: float | None, default: float | None, fallback: float) -> float:
    """The value sampling used: the request's, else the checkpoint's default, else OpenAI's."""
    return value if value is not None else default if default is not None else fallback


class ResponseRun:
    """One started request: the response object at each stage, its output, its store entry."""

    def __init__(self, ctx: ServingContext, store: ResponseStore, req: ResponsesRequest, rid: str,
                 items: list[dict], previous: StoredResponse | None, api_key: str | None, run: ChatRun) -> None:
        self.ctx, self.store, self.req, self.rid, self.items = ctx, store, req, rid, items
        self.previous, self.api_key, self.run = previous, api_key, run
        self.output = OutputItems()
        self.logprobs = wants_logprobs(req)
        self.created_at = int(time.time())

    def response(self, status: str, *, usage: dict | None = None, error: dict | None = None) -> dict:
        req, d = self.req, self.ctx.defaults
        fmt = req.text.format if req.text is not None else None
        text_format: dict = {"type": "text"} if fmt is None else {
            k: v for k, v in (("type", fmt.type), ("name", fmt.name), ("schema", fmt.schema),
                              ("description", fmt.description), ("strict", fmt.strict)) if v is not None}
        effort = req.reasoning.effort if req.reasoning is not None else None
        summary = req.reasoning.summary if req.reasoning is not None else None
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": self.ctx.response_model(req),
            "output": [dict(item) for item in self.output.items] if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": effort, "summary": summary}, "store": req.store,
            "temperature": _pick(req.temperature, d.temperature, 1.0),
            "text": {"format": text_format}, "tool_choice": req.tool_choice, "tools": req.tools or [],
            "top_logprobs": req.top_logprobs, "top_p": _pick(req.top_p, d.top_p, 1.0), "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    async def usage(self) -> dict:
        chat = self.run.tally.usage()
        reasoning = "".join(part["text"] for item in self.output.items if item["type"] == "reasoning"
                            for part in item["summary"])
        # ctx.encode moves a long text to a thread: a long reasoning summary must not stall the loop.
        num_reasoning = len(await self.ctx.encode(reasoning, False)) if reasoning else 0
        return {"input_tokens": chat["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": min(num_reasoning, chat["completion_tokens"])},
                "total_tokens": chat["total_tokens"]}

    async def events(self) -> AsyncIterator[dict]:
        """The events after response.in_progress, ending with response.completed or .incomplete (the
        response is stored then); an engine failure is raised as its APIError."""
        run, finish = self.run, None
        async with contextlib.aclosing(choice_chunks(run.streams, run.tally, run.parsers, run.decide)) as chunks:
            async for chunk in chunks:
                if self.logprobs and chunk.out.logprobs:
                    self.output.add_logprobs(chat_logprobs(self.ctx.tokenizer, chunk.out.logprobs)["content"])
                for delta in chunk.deltas or ():
                    for event in self.output.feed(delta):
                        yield event
                if chunk.out.finished:
                    finish = chunk.finish_reason
        status = "incomplete" if finish == "length" else "completed"
        for event in self.output.finish(status):
            yield event
        response = self.response(status, usage=await self.usage())
        if self.req.store:
            self.store.put(StoredResponse(response, self.items, self.previous, self.api_key))
        yield {"type": f"response.{status}", "response": response}

    async def stream(self, request: Request) -> AsyncIterator[dict]:
        sequence_number = 0

        def numbered(event: dict) -> dict:
            nonlocal sequence_number
            event["sequence_number"] = sequence_number
            sequence_number += 1
            return event

        yield numbered({"type": "response.created", "response": self.response("in_progress")})
        yield numbered({"type": "response.in_progress", "response": self.response("in_progress")})
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for event in events:
                    yield numbered(event)
        except APIError as error:  # after the 200: the failed response ends the stream
            # Caught here, so access_log._watch never sees it: record it as that wrapper would.
            record = access_log.current()
            if record is not None:
                record.stream_error = error
                access_log.log_error(request, record, error)
            failed = self.response("failed", usage=await self.usage(),
                                   error={"code": error.code or error.type, "message": error.message})
            yield numbered({"type": "response.failed", "response": failed})

    async def whole(self) -> dict:
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if event["type"] in _TERMINAL:
                    return event["response"]
        raise AssertionError("the events ended without a terminal response")


async def create_response(ctx: ServingContext, store: ResponseStore, request: Request) -> JSONResponse | SSEResponse:
    req = parse(ResponsesRequest, request.json())
    ctx.check_model(req.model)
    _check_unsupported(req)
    _check_metadata(req.metadata)
    previous = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id, request.api_key)
        if previous is not None and previous.num_turns >= MAX_CHAIN_TURNS:
            raise APIError(400, f"The conversation of '{req.previous_response_id}' already has {previous.num_turns} "
                                f"turns, the most one chain may have ({MAX_CHAIN_TURNS}); start a new one.",
                           param="previous_response_id", code="conversation_too_long")
        if previous is None:
            raise _not_found(f"Previous response with id '{req.previous_response_id}' not found.",
                             param="previous_response_id", code="previous_response_not_found")
    if req.input is None and previous is None:
        raise APIError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    items = input_items(req.input)
    history = previous.conversation() if previous is not None else []
    rid = _new_id("resp")
    try:
        chat = chat_request(req, chat_messages(req.instructions, history + items))
        run = await start_chat(ctx, chat, rid, ctx.caller(request), image_params(history, items))
    except APIError as error:
        raise _renamed(error) from None
    response = ResponseRun(ctx, store, req, rid, items, previous, request.api_key, run)
    if req.stream:
        return SSEResponse(response.stream(request), named=True)
    return JSONResponse(await response.whole())


def _stored(store: ResponseStore, request: Request) -> StoredResponse:
    rid = request.path_params["response_id"]
    record = store.get(rid, request.api_key)
    if record is None:
        raise _not_found(f"Response with id '{rid}' not found.")
    return record


async def retrieve_response(store: ResponseStore, request: Request) -> JSONResponse:
    return JSONResponse(_stored(store, request).response)


async def delete_response(store: ResponseStore, request: Request) -> JSONResponse:
    rid = request.path_params["response_id"]
    if not store.delete(rid, request.api_key):  # unknown, evicted, or another key's: the same 404 as GET
        raise _not_found(f"Response with id '{rid}' not found.")
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


async def list_input_items(store: ResponseStore, request: Request) -> JSONResponse:
    """OpenAI's cursor page: `order` (desc by default), `after` (an item id), `limit` (1..100, 20)."""
    items = list(_stored(store, request).input_items)
    query = request.query
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"Invalid value for 'order': expected 'asc' or 'desc', got {order!r}.", param="order",
                       code="invalid_value")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_INPUT_ITEMS_PAGE:
        raise APIError(400, f"limit must be an integer from 1 to {MAX_INPUT_ITEMS_PAGE}.", param="limit")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"No input item with id '{after}'.", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
