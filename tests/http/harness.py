"""Test harness for the HTTP stack: a real server on 127.0.0.1 and a raw-socket client.

Responses are parsed by a client-side h11 (an independent parser), so every test also checks
that our hand-written response bytes are valid HTTP/1.1.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import h11
import orjson

from rawserve.config import ServerConfig
from rawserve.http import HTTPServer, Router

TIMEOUT_S = 3.0


def make_config(**overrides: Any) -> ServerConfig:
    """Small limits and timeouts, so behaviour shows in tens of milliseconds."""
    values: dict[str, Any] = dict(host="127.0.0.1", port=0, keep_alive_s=2.0, header_timeout_s=2.0,
                                  body_timeout_s=2.0, drain_timeout_s=2.0, sse_ping_interval_s=0)
    values.update(overrides)
    return ServerConfig(**values)


@contextlib.asynccontextmanager
async def serve(router: Router, **overrides: Any) -> AsyncIterator[HTTPServer]:
    server = HTTPServer(make_config(**overrides), router)
    await server.start()
    try:
        yield server
    finally:
        await server.shutdown()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    informational: list[int] = field(default_factory=list)

    def json(self) -> Any:
        return orjson.loads(self.body)


class RawClient:
    """Bytes in, bytes out over a real socket; one response parsed at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.leftover = b""

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def request(self, method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] = (),
                      timeout: float = TIMEOUT_S) -> Reply:
        await self.send(build_request(method, path, body, headers))
        return await self.read_reply(method, timeout)

    async def read_reply(self, method: str = "GET", timeout: float = TIMEOUT_S) -> Reply:
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method=method, target="/", headers=[("Host", "test")]))
        parser.send(h11.EndOfMessage())
        if self.leftover:
            parser.receive_data(self.leftover)
        reply = Reply(0, {}, b"")
        body = bytearray()
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(self.reader.read(65536), timeout)
                parser.receive_data(data)
            elif isinstance(event, h11.InformationalResponse):
                reply.informational.append(event.status_code)
            elif isinstance(event, h11.Response):
                reply.status = event.status_code
                for name, value in event.headers:
                    key = name.decode()
                    reply.headers[key] = (reply.headers[key] + ", " if key in reply.headers else "") + value.decode()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                reply.body = bytes(body)
                self.leftover = parser.trailing_data[0]
                return reply
            else:
                raise AssertionError(f"unexpected event {event!r}")

    async def read_raw(self, nbytes: int = 65536, timeout: float = TIMEOUT_S) -> bytes:
        return await asyncio.wait_for(self.reader.read(nbytes), timeout)

    async def read_until_closed(self, timeout: float = TIMEOUT_S) -> bytes:
        """Everything until the server closes; fails the test if it does not close in time."""
        out = bytearray(self.leftover)
        self.leftover = b""

        async def drain() -> None:
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    return
                if not data:
                    return
                out.extend(data)
        await asyncio.wait_for(drain(), timeout)
        return bytes(out)

    async def is_closed(self, timeout: float = TIMEOUT_S) -> bool:
        """True when the server closes the connection (EOF or reset) within `timeout`."""
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except asyncio.TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return data == b""

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


def build_request(method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] = ()) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test"]
    names = {name.lower() for name, _ in headers}
    lines += [f"{name}: {value}" for name, value in headers]
    if body and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@contextlib.asynccontextmanager
async def client(port: int) -> AsyncIterator[RawClient]:
    conn = await RawClient.connect(port)
    try:
        yield conn
    finally:
        await conn.close()
