"""Everything between chat messages and token ids, and between token ids and client deltas.

Imports tokenizers and jinja2 only; never engine, http or api. Import the submodules directly:
tokenizer, chat_template, defaults, detokenizer, stop, parsers.
"""
from __future__ import annotations
