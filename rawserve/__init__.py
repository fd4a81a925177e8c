"""rawserve: an OpenAI-compatible LLM inference server with its own engine and HTTP stack.

`from rawserve import LLM, SamplingParams`, as vLLM users write it: both resolve on first use, so
`import rawserve` (the server process included) loads no torch.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":  # the offline engine imports torch; only now
        from rawserve.engine.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from rawserve.engine.types import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'rawserve' has no attribute {name!r}")
