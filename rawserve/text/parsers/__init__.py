"""Streaming output parsers, pluggable by name: reasoning (<think>), tool calls (hermes, llama3_json, qwen3_coder) and
gpt-oss's harmony channels (gpt_oss, openai). Pure string state machines; they must not import engine, http or api.
"""
from __future__ import annotations

from rawserve.text.parsers.harmony import HarmonyParser
from rawserve.text.parsers.hermes import HermesToolParser
from rawserve.text.parsers.llama3_json import Llama3JsonToolParser
from rawserve.text.parsers.output import REASONING_PARSERS, TOOL_PARSERS, OutputParser, check_parser_names
from rawserve.text.parsers.qwen3_coder import Qwen3CoderToolParser
from rawserve.text.parsers.reasoning import ThinkReasoningParser, prompt_opens_reasoning

__all__ = [
    "HarmonyParser",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "OutputParser",
    "Qwen3CoderToolParser",
    "ThinkReasoningParser",
    "check_parser_names",
    "prompt_opens_reasoning",
]
