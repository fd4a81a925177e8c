"""A small server for the signal tests, run as `python -m tests.http.serve_script DRAIN_TIMEOUT_S`.

Prints its port, then `draining` when a drain begins; exits with serve_until_shutdown's status.
"""
from __future__ import annotations

import asyncio
import sys

from rawserve.config import ServerConfig
from rawserve.http import HTTPServer, JSONResponse, Request, Router


async def fast(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True})


async def slow(request: Request) -> JSONResponse:
    await asyncio.sleep(float(request.query.get("s", "0.5")))
    return JSONResponse({"slept": True})


async def main(drain_timeout_s: float) -> int:
    router = Router()
    router.add("GET", "/fast", fast)
    router.add("GET", "/slow", slow)
    server = HTTPServer(ServerConfig(port=0, drain_timeout_s=drain_timeout_s), router)
    server.on_drain(lambda: print("draining", flush=True))
    await server.start()
    print(server.port, flush=True)
    return await server.serve_until_shutdown()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(float(sys.argv[1]))))
