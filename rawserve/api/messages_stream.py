"""Anthropic's Messages API, output side: chat's parser deltas -> content blocks (thinking, text, tool_use) and the
named SSE events of a streamed message (message_start ... message_stop); a whole message is the fold of the same
events. Also Anthropic's error body, for refusals and for the `error` event of a stream that fails after its 200.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rawserve.api import access_log
from rawserve.api.chat import ChatRun
from rawserve.api.serving import ServingContext, choice_chunks
from rawserve.engine.frontend.output_processor import TextOutput
from rawserve.errors import APIError
from rawserve.http import Request
from rawserve.text.parsers import OutputParser

# What the stream writes while it waits (a long prefill, a slow step): Anthropic's ping event, which its SDKs skip.
PING_EVENT = b'event: ping\ndata: {"type":"ping"}\n\n'

# Anthropic's error types by status; any other 4xx is invalid_request_error, any other 5xx api_error.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(error: APIError) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`. Anthropic's shape has no `param`: the field a refusal
    names leads its message instead, as Anthropic's own messages do ("max_tokens: Field required")."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": error_type(error.status), "message": message}}


def _signature(thinking: str) -> str:
    # Anthropic signs a thinking block so that it can be handed back unaltered; rawserve verifies nothing (a thinking
    # block sent back is taken as it is), so the signature is only a digest of the text, stable across turns.
    return hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()


class ContentBlocks:
    """Parser deltas -> content blocks, and the content_block_* events a stream sends for them.

    Whitespace before any text (the newline after </think>, between tool calls) waits: it opens a text block only
    if text follows, or if the message would otherwise have no content.
    """

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._text = ""
        self._blank = ""

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        if "reasoning_content" in delta:
            events += self._ensure("thinking")
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]},
                                      delta["reasoning_content"]))
        if "content" in delta:
            text = self._blank + delta["content"]
            is_open = self._open is not None and self._open["type"] == "text"
            if not is_open and not text.strip():
                self._blank = text
            else:
                events += self._ensure("text")
                self._blank = ""
                events.append(self._delta({"type": "text_delta", "text": text}, text))
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            if "id" in call:
                events += self._close()
                self._blank = ""
                events += self._start({"type": "tool_use", "id": new_id("toolu"), "name": function["name"],
                                       "input": {}})
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]},
                                          function["arguments"]))
        return events

    def finish(self) -> list[dict]:
        events = []
        if self._blank and not self.blocks:
            events += self._ensure("text")
            events.append(self._delta({"type": "text_delta", "text": self._blank}, self._blank))
        self._blank = ""
        return events + self._close()

    def _delta(self, delta: dict, text: str) -> dict:
        self._text += text
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self._open, self._text = block, ""
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}
        return events + self._start(block)

    def _close(self) -> list[dict]:
        block = self._open
        if block is None:
            return []
        index, text, events = len(self.blocks) - 1, self._text, []
        if block["type"] == "thinking":
            block["thinking"], block["signature"] = text, _signature(text)
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif block["type"] == "text":
            block["text"] = text
        else:
            block["input"] = _tool_input(text)
        self._open, self._text = None, ""
        return [*events, {"type": "content_block_stop", "index": index}]


def _tool_input(arguments: str) -> dict:
    """A call's arguments as the object Anthropic's `input` is. Arguments that are no JSON object (a call cut short
    by max_tokens, which stop_reason then says) give an empty input; the stream has sent them as they were."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageRun:
    """One started request: its message at each stage, streamed as Anthropic's events or folded whole."""

    def __init__(self, ctx: ServingContext, req: Any, rid: str, run: ChatRun) -> None:
        self.ctx, self.req, self.rid, self.run = ctx, req, rid, run
        self.blocks = ContentBlocks()
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def message(self, content: list[dict], usage: dict) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.ctx.response_model(self.req),
                "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": usage}

    def usage(self) -> dict:
        """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not hold, which
        cache_read_input_tokens count (their sum is the prompt); rawserve's cache writes cost nothing extra."""
        chat = self.run.tally.usage()
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": chat["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": chat["completion_tokens"]}

    def _decide(self, out: TextOutput, parser: OutputParser) -> None:
        if out.finish_reason == "length":  # max_tokens, or the request's deadline
            self.stop_reason = "max_tokens"
        elif parser.has_tool_calls:
            self.stop_reason = "tool_use"
        elif isinstance(out.stop_reason, str):  # a matched stop string: one of stop_sequences
            self.stop_reason, self.stop_sequence = "stop_sequence", out.stop_reason
        else:
            self.stop_reason = "end_turn"

    async def events(self) -> AsyncIterator[dict]:
        """The events after message_start, through message_stop; an engine failure is raised as its APIError."""
        run = self.run
        async with contextlib.aclosing(choice_chunks(run.streams, run.tally, run.parsers, run.decide)) as chunks:
            async for chunk in chunks:
                for delta in chunk.deltas or ():
                    for event in self.blocks.feed(delta):
                        yield event
                if chunk.out.finished:
                    self._decide(chunk.out, run.parsers[chunk.index])
        for event in self.blocks.finish():
            yield event
        yield {"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
               "usage": self.usage()}
        yield {"type": "message_stop"}

    async def stream(self, request: Request) -> AsyncIterator[dict]:
        # The prefix cache's share is known once the engine answers: message_delta's usage corrects this one.
        start = {"input_tokens": self.run.tally.num_prompt_tokens, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0, "output_tokens": 0}
        yield {"type": "message_start", "message": self.message([], start)}
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for event in events:
                    yield event
        except APIError as error:  # after the 200: Anthropic's error event ends the stream
            # Caught here, so access_log._watch never sees it: record it as that wrapper would.
            record = access_log.current()
            if record is not None:
                record.stream_error = error
                access_log.log_error(request, record, error)
            yield error_body(error)

    async def whole(self) -> dict:
        async with contextlib.aclosing(self.events()) as events:
            async for _ in events:
                pass
        return self.message(self.blocks.blocks, self.usage())
