"""Request schemas of the OpenAI API (plus vLLM's extensions), as dataclasses for http.schema.parse.

Field names and defaults follow OpenAI's. None means "the server's default" (generation_config.json).
Unknown fields are ignored by parse(), since clients send fields like `user` a server may not use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rawserve.http.schema import FieldError

# OpenAI's roles whose content is required and never null (its schema: a string, or an array of at least one
# content part). An assistant's may be null when it has tool_calls; other roles a template knows are passed on.
_ROLES_WITH_CONTENT = frozenset({"system", "developer", "user", "tool"})


@dataclass(slots=True)
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(slots=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


@dataclass(slots=True)
class StructuredOutputs:
    """vLLM's structured_outputs: exactly one of these."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclass(slots=True)
class SamplingExtensions:
    """vLLM's sampling extensions (and OpenAI's common sampling fields), on every generating endpoint."""
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    lora: str | None = None  # a LoRA adapter's name (or select it with model: "<name>", vLLM's convention)
    # structured output, vLLM's names
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


@dataclass(slots=True)
class SamplingFields(SamplingExtensions):
    """Fields both chat and completions share."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # OpenAI's structured output (Responses has text.format)


@dataclass(slots=True)
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


@dataclass(slots=True)
class FunctionCall:
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCall:
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


@dataclass(slots=True)
class ChatMessage:
    # system, developer, user, assistant, tool, function, or any role the template knows (vLLM passes them on)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        content, role = self.content, self.role
        if content is None:
            if role in _ROLES_WITH_CONTENT:
                raise FieldError("content", f"Invalid value for '{{param}}': a {role} message needs content (a string "
                                            "or an array of content parts), but it is missing or null.",
                                 code="invalid_value")
            if role == "assistant" and not self.tool_calls:
                raise FieldError("content", "Invalid value for '{param}': an assistant message needs content unless "
                                            "it has tool_calls, but it is missing or null.", code="invalid_value")
        elif content == [] and (role in _ROLES_WITH_CONTENT or role == "assistant"):
            raise FieldError("content", "Invalid '{param}': empty array. Expected an array with minimum length 1, "
                                        "but got an empty array instead.", code="empty_array")


@dataclass(slots=True)
class FunctionDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@dataclass(slots=True)
class Tool:
    function: FunctionDefinition
    type: Literal["function"] = "function"


@dataclass(slots=True)
class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = field(kw_only=True)  # required, as OpenAI's is, after SamplingFields' defaults
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # OpenAI's reasoning effort: the template's `reasoning_effort` (gpt-oss's "Reasoning: high") and thinking switch
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


@dataclass(slots=True)
class LoadLoraAdapterRequest:
    """vLLM's POST /v1/load_lora_adapter body."""
    lora_name: str
    lora_path: str


@dataclass(slots=True)
class UnloadLoraAdapterRequest:
    """vLLM's POST /v1/unload_lora_adapter body (lora_int_id is accepted and ignored: names identify adapters)."""
    lora_name: str
    lora_int_id: int | None = None


@dataclass(slots=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


# The Responses API (POST /v1/responses). Input items and tools stay plain dicts: their shape depends on
# their `type`, which api/responses.py checks item by item so a 400 names the item's path.

@dataclass(slots=True)
class ResponsesTextFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


@dataclass(slots=True)
class ResponsesText:
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


@dataclass(slots=True)
class ReasoningOptions:
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


@dataclass(slots=True)
class ResponsesRequest(SamplingExtensions):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    user: str | None = None
    stream: bool = False
    include: list[str] | None = None  # extra output data; rawserve has "message.output_text.logprobs"
    top_logprobs: int | None = None
    # Fields that change the meaning of a request and that rawserve cannot honour: a 400 when set.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
