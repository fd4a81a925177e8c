"""The engine core's loop: take messages, step, send outputs; in a thread or a spawned process.

It owns the core side of the protocol (engine/messages.py): in ADD / ABORT / SHUTDOWN; out READY / OUTPUTS /
ERROR / FATAL / STATS / QUEUED. It must not import asyncio, text or the server: a spawned core loads only the engine.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

from rawserve.engine.core_summary import describe_core
from rawserve.engine.ipc import Receiver, Sender
from rawserve.engine.messages import HEARTBEAT_INTERVAL_S, Message, MsgKind
from rawserve.process_stats import HeapRelease

log = logging.getLogger("rawserve.engine.core_loop")

STATS_INTERVAL_S = 0.25
# An idle loop wakes this often: to send its heartbeat, and (a spawned child) to check its parent still exists.
_IDLE_POLL_S = HEARTBEAT_INTERVAL_S
_LORA_POLL_S = 0.005  # an idle core checks this often whether an adapter read has finished


class _FrontendGone(Exception):
    """The outputs transport broke: nobody is left to serve."""


def _send(outputs: Sender, msgs: list[Message]) -> None:
    try:
        outputs.send(msgs)
    except OSError as error:  # BrokenPipeError etc.: the frontend exited
        raise _FrontendGone(repr(error)) from error


def _lora_op(core: Any, token: int, op: str, name: str, path: str | None) -> list[Message]:
    """Start a client's load (answered by _finished_lora_loads once read) or unload now; LORA_DONE for what is
    answered at once. Codes: "unknown" (no such adapter), or LoraRefused's ("name", "disabled", "busy")."""
    registry = getattr(core, "loras", None)
    try:
        if registry is None:
            return [(MsgKind.LORA_DONE, (token, "lora: this engine has no LoRA support", "disabled"))]
        registry.check_runtime_updates()
        if op == "load":
            registry.start_load(token, name, path)
            return []
        registry.unload(name)
        return [(MsgKind.LORA_DONE, (token, None, None))]
    except KeyError:
        return [(MsgKind.LORA_DONE, (token, f"no adapter named {name!r} is loaded", "unknown"))]
    except ValueError as error:  # LoraRefused: the name is in use, updates are off, too many reads
        return [(MsgKind.LORA_DONE, (token, str(error), getattr(error, "code", "bad")))]


def _finished_lora_loads(core: Any) -> list[Message]:
    """LORA_DONE for each run-time load that has finished, failed or run past its deadline."""
    return [(MsgKind.LORA_DONE, done) for done in core.loras.finished_loads()]


def _send_or_beat(outputs: Sender, msgs: list[Message], last_sent: float) -> float:
    """Send `msgs`; with nothing to send, a heartbeat once HEARTBEAT_INTERVAL_S has passed. Returns when the
    core last said something."""
    now = time.monotonic()
    if not msgs:
        if now - last_sent < HEARTBEAT_INTERVAL_S:
            return last_sent
        msgs = [(MsgKind.HEARTBEAT, None)]
    _send(outputs, msgs)
    return now


def run_core(factory: Callable[[], Any], inputs: Receiver, outputs: Sender, *,
             stats_interval_s: float = STATS_INTERVAL_S) -> None:
    """Build the core with `factory()` and serve it until `shutdown`, a fatal error or end of input.

    Blocks only when idle; while requests run, it takes every waiting message and steps at once, so
    a burst of new requests joins the next step. A request the core rejects (ValueError) fails alone
    with `error`. Any other exception from the core is `fatal` and ends the loop: block tables and
    computed-token counts may be inconsistent, and serving on risks one request reading another's KV.

    Out (MsgKind): READY {max_model_len, num_blocks, vocab_size, pid, device, dtype, num_params, block_size}, OUTPUTS [RequestOutput] once per
    step, ERROR (rid, message), FATAL message, STATS EngineStats every stats_interval_s while busy and
    whenever the core goes idle, QUEUED [(rid, seconds)] when requests are first scheduled (the
    scheduler times them: `core.take_queue_times()` after each step), HEARTBEAT when nothing else went out
    for HEARTBEAT_INTERVAL_S, busy or idle. Several go out in one send.
    """
    try:
        try:
            core = factory()
        except Exception as error:  # noqa: BLE001 - reported to the frontend; start() raises it
            log.exception("engine core failed to start")
            _send(outputs, [(MsgKind.FATAL, f"engine failed to start: {error!r}")])
            return
        _send(outputs, [(MsgKind.READY, {"max_model_len": core.max_model_len, "num_blocks": core.num_blocks,
                                          "vocab_size": core.vocab_size, "pid": os.getpid(),
                                          "loras": core.loras.paths() if hasattr(core, "loras") else {},
                                          "lora_runtime_updating": getattr(getattr(core, "loras", None),
                                                                           "allows_runtime_updates", False),
                                          **describe_core(core)}),  # device, dtype, params: the startup summary's
                        (MsgKind.STATS, core.stats())])
        try:
            _serve(core, inputs, outputs, stats_interval_s)
        finally:
            if hasattr(core, "close"):
                core.close()
    except _FrontendGone as error:
        log.warning("engine frontend is gone (%s); core loop exits", error)
    except Exception as error:  # noqa: BLE001 - a fault outside step() (stats, transport): every request sees it
        log.exception("engine core loop failed")
        try:
            outputs.send([(MsgKind.FATAL, f"engine core loop failed: {error!r}")])
        except OSError:
            pass
    finally:
        try:
            outputs.close()
        except OSError:  # the frontend already closed its end
            pass


def _serve(core: Any, inputs: Receiver, outputs: Sender, stats_interval_s: float) -> None:
    # In a spawned child, a parent killed by SIGKILL never closes our input; poll for it when idle.
    parent = multiprocessing.parent_process()
    was_busy = False
    last_stats = last_sent = time.monotonic()
    heap = HeapRelease()  # an idle core hands back what its steps freed
    release_kv = getattr(core, "release_idle_kv", None)  # and the KV pages no request holds (EngineCore's)
    while True:
        is_busy = core.has_unfinished
        if not is_busy and was_busy:  # just went idle (finished or aborted): report the freed blocks now
            last_sent = _send_or_beat(outputs, [(MsgKind.STATS, core.stats())], last_sent)
            last_stats = last_sent
            heap.went_idle(last_sent)
        was_busy = is_busy
        if is_busy:
            heap.went_busy()
        elif heap.run_if_due(time.monotonic()) and release_kv is not None:
            try:
                released = release_kv()
            except Exception as error:  # noqa: BLE001 - block ids and KV may disagree now: fatal, seen by every request
                log.exception("engine core failed giving KV pages back")
                _send(outputs, [(MsgKind.FATAL, f"engine KV release failed: {error!r}")])
                return
            if released:
                log.debug("idle: gave back %d MiB of KV pages", released >> 20)
        try:
            loading = hasattr(core, "loras") and core.loras.has_pending_loads
            msgs = inputs.recv(0 if is_busy else _LORA_POLL_S if loading else
                               heap.wait_s(time.monotonic(), _IDLE_POLL_S))
        except EOFError:  # the frontend closed its end: nobody will send more work
            return
        if not msgs and not is_busy and parent is not None and not parent.is_alive():
            log.warning("engine frontend process died; core loop exits")
            return
        replies: list[Message] = []
        for kind, payload in msgs:
            if kind == MsgKind.SHUTDOWN:
                _send(outputs, replies)
                return
            if kind == MsgKind.ADD:
                try:
                    core.add_request(payload.rid, payload.prompt_ids, payload.params, payload.priority,
                                     lora=payload.lora, features=payload.features, cache_salt=payload.cache_salt)
                except ValueError as error:  # rejected: this request fails alone
                    replies.append((MsgKind.ERROR, (payload.rid, str(error))))
                except Exception as error:  # noqa: BLE001 - state unknown: fatal, seen by every request
                    log.exception("engine core failed in add_request")
                    _send(outputs, [*replies, (MsgKind.FATAL, f"engine add_request failed: {error!r}")])
                    return
            elif kind == MsgKind.LORA:
                replies.extend(_lora_op(core, *payload))
            elif kind == MsgKind.ABORT:
                try:
                    core.abort_request(payload)
                except Exception as error:  # noqa: BLE001 - state unknown: fatal, seen by every request
                    log.exception("engine core failed in abort_request")
                    _send(outputs, [*replies, (MsgKind.FATAL, f"engine abort_request failed: {error!r}")])
                    return
            else:
                log.error("core loop ignores unknown message kind %r", kind)
        if hasattr(core, "loras") and core.loras.has_pending_loads:
            replies.extend(_finished_lora_loads(core))
        if not core.has_unfinished:
            last_sent = _send_or_beat(outputs, replies, last_sent)
            continue
        try:
            step_outputs = core.step()
            if step_outputs:
                replies.append((MsgKind.OUTPUTS, step_outputs))
            queued = core.take_queue_times()  # the scheduler timed them: queued -> first scheduled
            if queued:
                replies.append((MsgKind.QUEUED, queued))
            now = time.monotonic()
            if now - last_stats >= stats_interval_s:
                replies.append((MsgKind.STATS, core.stats()))
                last_stats = now
        except Exception as error:  # noqa: BLE001 - state unknown: fatal, seen by every request
            log.exception("engine core step failed")
            _send(outputs, [*replies, (MsgKind.FATAL, f"engine step failed: {error!r}")])
            return
        was_busy = True  # it stepped: report stats when it next finds itself idle
        last_sent = _send_or_beat(outputs, replies, last_sent)
