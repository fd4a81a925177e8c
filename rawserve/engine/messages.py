"""The frontend/core protocol: which kinds of message cross the process boundary, and what each carries.

Seam: both halves import it, so it imports the standard library only.
"""
from __future__ import annotations

import enum
from typing import Any


class MsgKind(enum.StrEnum):
    """A message's kind. A StrEnum: it equals its plain name, so a log or a test reads `"outputs"`."""

    # frontend -> core
    ADD = "add"  # AddRequest
    ABORT = "abort"  # rid
    SHUTDOWN = "shutdown"  # None
    LORA = "lora"  # (token, "load" | "unload", name, path or None): change the adapters at run time
    # core -> frontend
    READY = "ready"  # {max_model_len, num_blocks, vocab_size, pid}, once the core is built
    OUTPUTS = "outputs"  # [RequestOutput], once per step that produced any
    ERROR = "error"  # (rid, message): the core rejected that request alone
    FATAL = "fatal"  # message: the core is gone; every request fails
    STATS = "stats"  # EngineStats, periodically and whenever the core goes idle
    QUEUED = "queued"  # [(rid, seconds waited)] when requests are first scheduled
    # (token, error or None, code), answering LORA. code: None (done), "bad" (not a loadable adapter: the error is
    # for the server's log only), "unknown" (no such adapter), "name" (taken), "disabled", "busy", "timeout"
    LORA_DONE = "lora_done"
    HEARTBEAT = "heartbeat"  # None: sent when nothing else went out for HEARTBEAT_INTERVAL_S


# The core says something at least this often, busy or idle: a frontend that hears nothing for much longer
# knows the core is frozen (stopped, swapping, stuck in a step), not merely quiet.
HEARTBEAT_INTERVAL_S = 1.0


# One message: (kind, payload). Transports (engine/ipc.py) carry a list of them per send.
Message = tuple[MsgKind, Any]
