"""OutputParser: one per choice, turns streamed text into OpenAI chat delta fragments.

Chains a reasoning parser and a tool-call parser chosen by name, and merges their events into
{"content"} / {"reasoning_content"} / {"tool_calls"} deltas. Must not import engine, http or api.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rawserve.text.parsers.base import Event, ReasoningParser, ToolParser
from rawserve.text.parsers.harmony import HarmonyParser
from rawserve.text.parsers.hermes import HermesToolParser
from rawserve.text.parsers.llama3_json import Llama3JsonToolParser
from rawserve.text.parsers.qwen3_coder import Qwen3CoderToolParser
from rawserve.text.parsers.reasoning import ThinkReasoningParser

# name -> factory(starts_in_reasoning | None). deepseek_r1 templates always open <think> in the
# prompt, so unless told otherwise its output starts inside reasoning; qwen3's starts outside.
REASONING_PARSERS: dict[str, Callable[[bool | None], ReasoningParser]] = {
    "qwen3": lambda opened: ThinkReasoningParser(bool(opened)),
    "deepseek_r1": lambda opened: ThinkReasoningParser(True if opened is None else opened),
    # gpt-oss's harmony channels (vLLM's names for it). Paired with the `openai` tool parser, one HarmonyParser
    # reads the whole output: OutputParser builds it with calls on.
    "gpt_oss": lambda opened: HarmonyParser(parse_calls=False),
    "openai_gptoss": lambda opened: HarmonyParser(parse_calls=False),
}
# name -> factory(tools: function name -> its parameters schema). Only the XML form needs the schemas: its
# values are raw text, typed by what each parameter declares.
TOOL_PARSERS: dict[str, Callable[[Mapping[str, Any]], ToolParser]] = {
    "hermes": lambda tools: HermesToolParser(),
    "llama3_json": lambda tools: Llama3JsonToolParser(),
    "qwen3_coder": Qwen3CoderToolParser,
    "openai": lambda tools: HarmonyParser(parse_calls=True),  # gpt-oss's harmony: calls are messages to functions.*
}
HARMONY_TOOL_PARSER = "openai"


AUTO = "auto"  # --tool-call-parser auto: the form the chat template teaches (text/defaults.py decides)


def check_parser_names(reasoning: str | None = None, tool: str | None = None, *, allow_auto: bool = True) -> None:
    """Raise ValueError for an unknown parser name, listing the known ones (for flag validation)."""
    if reasoning is not None and reasoning not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown {reasoning!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    known = [*TOOL_PARSERS, AUTO] if allow_auto else list(TOOL_PARSERS)
    if tool is not None and tool not in known:
        raise ValueError(f"--tool-call-parser: unknown {tool!r}; known: {', '.join(sorted(known))}")


class OutputParser:
    """feed(text, final) -> list of OpenAI chat delta fragments, in order.

    reasoning: a reasoning parser name or None (all text is content). use_tools: look for tool calls
    (with tool_parser) in the content. starts_in_reasoning: the prompt already opened <think>
    (see prompt_opens_reasoning); None takes the parser's default. `tools`: the request's functions, name ->
    parameters schema (None: no parameters). Deltas are never empty; a tool
    call's first delta carries index, id, type and name with empty arguments, later ones argument
    fragments. `has_tool_calls` tells the API to finish with "tool_calls".

    `markers` are the tags the chosen parsers read. `hidden_markers` (those of them the tokenizer holds as
    special tokens, which the detokenizer keeps for the parsers) never show in content or reasoning, not even
    in a block that falls back to text: with skip_special_tokens they would not have been there at all.
    """

    def __init__(
        self,
        reasoning: str | None = None,
        use_tools: bool = False,
        *,
        tool_parser: str = "hermes",
        starts_in_reasoning: bool | None = None,
        hidden_markers: Iterable[str] = (),
        tools: Mapping[str, Any] | None = None,
    ) -> None:
        check_parser_names(reasoning, tool_parser, allow_auto=False)
        self._reasoning = REASONING_PARSERS[reasoning](starts_in_reasoning) if reasoning else None
        self._tools = TOOL_PARSERS[tool_parser](tools or {}) if use_tools else None
        if tool_parser == HARMONY_TOOL_PARSER:
            # The openai tool parser means the model writes harmony (auto picks it from the template): its channels
            # are split whatever --reasoning-parser says, since unsplit they are no readable content; one parser
            # reads the channels and the calls, which are messages like any other.
            self._reasoning, self._tools = HarmonyParser(parse_calls=use_tools), None
        self.markers: tuple[str, ...] = ((self._reasoning.markers if self._reasoning is not None else ())
                                         + (self._tools.markers if self._tools is not None else ()))
        self._hidden = tuple(m for m in hidden_markers if m)
        self.has_tool_calls = False
        self._finished = False

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if self._finished:
            if text:
                raise ValueError("OutputParser got text after the final feed")
            return []
        self._finished = final
        if self._reasoning is not None:
            events = self._reasoning.feed(text, final)
        else:
            events = [("content", text)] if text else []
        if self._tools is not None:
            routed: list[Event] = []
            content = "".join(e[1] for e in events if e[0] == "content")  # type: ignore[misc]
            # Reasoning comes before the answer in the stream, so within one feed it is safe to put
            # reasoning events first and the content's tool parsing after them.
            routed += [e for e in events if e[0] != "content"]
            if content or final:
                routed += self._tools.feed(content, final)
            events = routed
        return self._deltas(events)

    def _deltas(self, events: list[Event]) -> list[dict]:
        deltas: list[dict] = []
        last: tuple | None = None  # (kind, index) of deltas[-1], to merge consecutive fragments
        for event in events:
            kind = event[0]
            if kind == "call":
                _, index, call_id, name = event  # type: ignore[misc]
                self.has_tool_calls = True
                deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
                last = ("call", index)
            elif kind == "args":
                _, index, fragment = event  # type: ignore[misc]
                if not fragment:
                    continue
                if last == ("args", index):
                    deltas[-1]["tool_calls"][0]["function"]["arguments"] += fragment
                else:
                    deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
                    last = ("args", index)
            else:
                text = event[1]
                for marker in self._hidden:  # a special token's text arrives whole: no split to hold back
                    text = text.replace(marker, "")
                if not text:
                    continue
                if last == (kind, None):
                    deltas[-1][kind] += text
                else:
                    deltas.append({kind: text})
                    last = (kind, None)
        return deltas
