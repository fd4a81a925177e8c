"""A load client on raw asyncio sockets, for bench/serve.py, bench/soak.py and bench/overhead.py: one OpenAI
request per connection, its SSE stream parsed as it arrives (TTFT, gaps between events, tokens counted from
logprobs), and the misbehaving clients the soak needs (leave mid-stream, read slowly, never read).
No dependencies beyond the standard library and orjson.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson


@dataclass
class Outcome:
    """What one request saw. `tokens` counts output tokens as received (from logprobs, one entry a token)."""
    status: int = 0
    error: str | None = None  # an error code (from the body or an SSE error event), or what went wrong
    ttft_s: float | None = None
    e2e_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between token-bearing events
    tokens: int = 0
    usage_tokens: int | None = None  # usage.completion_tokens, when the response carried usage
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False  # a stream reached [DONE] (or a whole response was read)
    left: bool = False  # the client left on purpose before the end

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done


def request_bytes(host: str, path: str, payload: dict | bytes, api_key: str | None = None) -> bytes:
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    auth = b"authorization: Bearer %b\r\n" % api_key.encode() if api_key else b""
    return (b"POST %b HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n%bcontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b") % (path.encode(), host.encode(), auth, len(body), body)


def _count(outcome: Outcome, event: dict) -> int:
    """Tokens in one chunk or response (choices' logprobs), its usage and finish reasons."""
    usage = event.get("usage")
    if usage:
        outcome.usage_tokens = usage.get("completion_tokens")
    num = 0
    for choice in event.get("choices") or ():
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:  # chat
            num += len(logprobs.get("content") or ())
        else:  # completions
            num += len(logprobs.get("tokens") or ())
        if choice.get("finish_reason"):
            outcome.finish_reasons.append(choice["finish_reason"])
    return num


async def call(host: str, port: int, path: str, payload: dict | bytes, *, api_key: str | None = None,
               leave_after_events: int | None = None, read_delay_s: float = 0.0, never_read: bool = False,
               timeout_s: float = 600.0) -> Outcome:
    """Send one request and read its answer. leave_after_events: close after that many events (a client leaving
    mid-stream); read_delay_s: sleep before each read (a slow reader); never_read: send, then hold the socket
    without reading until the server gives up on it."""
    outcome = Outcome()
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 22), 30)
    except (OSError, asyncio.TimeoutError) as error:
        outcome.error = f"connect: {error!r}"
        return outcome
    try:
        writer.write(request_bytes(host, path, payload, api_key))
        if never_read:
            writer.transport.pause_reading()
            await asyncio.sleep(timeout_s)
            outcome.left = True
            return outcome
        await asyncio.wait_for(_read(reader, outcome, started, leave_after_events, read_delay_s), timeout_s)
    except asyncio.TimeoutError:
        outcome.error = outcome.error or "client timeout"
    except (OSError, ValueError) as error:
        outcome.error = outcome.error or f"{type(error).__name__}: {error}"
    finally:
        outcome.e2e_s = time.perf_counter() - started
        writer.close()
    return outcome


async def _read(reader: asyncio.StreamReader, outcome: Outcome, started: float, leave_after: int | None,
                delay_s: float) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    outcome.status = int(head.split(b" ", 2)[1])
    headers = head.lower()
    if b"text/event-stream" not in headers:
        body = await reader.read() if b"transfer-encoding: chunked" not in headers else await _unchunk_all(reader)
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            outcome.error = "bad json"
            return
        if outcome.status != 200:
            outcome.error = (answer.get("error") or {}).get("code") or str(outcome.status)
            return
        outcome.tokens = _count(outcome, answer)
        outcome.done = True  # no TTFT: the whole answer came at once
        return
    buffer = b""
    events = 0
    last = None
    while True:
        if delay_s:
            await asyncio.sleep(delay_s)
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip().split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return
        buffer += (await reader.readexactly(size + 2))[:-2]
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            if not raw.startswith(b"data: "):
                continue  # a ping comment
            data = raw[6:]
            if data == b"[DONE]":
                outcome.done = True
                continue
            event = orjson.loads(data)
            if "error" in event:
                outcome.error = event["error"].get("code") or "stream error"
                continue
            num = _count(outcome, event)
            if num:
                now = time.perf_counter()
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - started
                else:
                    outcome.gaps_s.append(now - last)
                last = now
                outcome.tokens += num
            events += 1
            if leave_after is not None and events >= leave_after:
                outcome.left = True
                return


async def _unchunk_all(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(out)
        out += (await reader.readexactly(size + 2))[:-2]


async def send_raw(host: str, port: int, data: bytes, timeout_s: float = 30.0) -> int:
    """Send arbitrary bytes, read the answer to the end; its status (0 when the server closed without one)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return 0
    try:
        writer.write(data)
        answer = await asyncio.wait_for(reader.read(65536), timeout_s)
        return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


async def get_json(host: str, port: int, path: str, api_key: str | None = None) -> tuple[int, dict | str]:
    """GET path: (status, JSON body, or text when it is not JSON)."""
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n".encode())
    try:
        data = await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, orjson.loads(body)
    except orjson.JSONDecodeError:
        return status, body.decode(errors="replace")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
