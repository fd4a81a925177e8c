"""rawserve: an OpenAI-compatible LLM inference server with its own engine and HTTP stack."""
from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # The offline API imports torch; keep `import rawserve` cheap for the HTTP-only users.
    if name == "LLM":
        from rawserve.engine.frontend.llm import LLM

        return LLM
    raise AttributeError(name)
