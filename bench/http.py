"""HTTP stack throughput: rawserve's server against uvicorn serving the same raw ASGI app.

    python -m bench.http [--duration-s 2] [--warmup-s 0.5] [--rounds 3] [--concurrency 1,64,256] [--events 100]
                         [--servers rawserve,uvicorn,floor,floor-h11] [--client epoll|asyncio]

Each server runs in its own subprocess; the load generator (keep-alive, one request in flight per
connection; an epoll loop by default) runs here. Prints one JSON object per result line on stdout:
per server, endpoint and concurrency, then a rawserve/uvicorn ratio line. Logs go to stderr.
uvicorn is a bench-only extra.

`floor` is no HTTP server at all: one asyncio streams task per connection that answers any bytes
ending a request head with canned bytes, streaming the same token source. It is the ceiling for
any server on this event loop, so `uvicorn / floor` bounds the ratio any asyncio server could reach.
`floor-h11` is the same plus an h11 parse of each request head: the ceiling for any server that
parses with h11, as rawserve's design has it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import time

JSON_PAYLOAD = {"object": "list", "data": [{"id": "tiny-model", "object": "model", "owned_by": "rawserve"}]}
EVENT = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "model": "tiny-model",
         "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}]}


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- the servers (run in subprocesses) -------------------------------------------------------

async def token_source(num_events: int, yield_between_events: bool):
    """What both servers stream: the same async generator, as an engine's output stream would be."""
    for _ in range(num_events):
        if yield_between_events:
            await asyncio.sleep(0)  # a token source hands over through the event loop
        yield EVENT


def serve_rawserve(port: int, num_events: int, yield_between_events: bool) -> None:
    from rawserve.config import ServerConfig
    from rawserve.http import HTTPServer, JSONResponse, Router, SSEResponse

    async def json_endpoint(request):
        return JSONResponse(JSON_PAYLOAD)

    async def sse_endpoint(request):
        return SSEResponse(token_source(num_events, yield_between_events))

    async def main() -> int:
        router = Router()
        router.add("GET", "/json", json_endpoint)
        router.add("GET", "/sse", sse_endpoint)
        server = HTTPServer(ServerConfig(port=port, max_connections=4096, keep_alive_s=60.0), router)
        return await server.serve_until_shutdown()

    sys.exit(asyncio.run(main()))


def serve_uvicorn(port: int, num_events: int, yield_between_events: bool) -> None:
    import orjson
    import uvicorn

    json_body = orjson.dumps(JSON_PAYLOAD)
    json_head = {"type": "http.response.start", "status": 200,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(json_body)).encode())]}
    sse_head = {"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]}

    async def app(scope, receive, send):  # a raw ASGI app: no framework on either side
        path = scope["path"]
        if path == "/json":
            await send(json_head)
            await send({"type": "http.response.body", "body": json_body})
        elif path == "/sse":
            await send(sse_head)
            async for event in token_source(num_events, yield_between_events):
                await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n",
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off",
                http="h11", loop="asyncio", timeout_keep_alive=60, backlog=4096)


def serve_floor(port: int, num_events: int, yield_between_events: bool, parse_with_h11: bool = False) -> None:
    import h11
    import orjson

    json_body = orjson.dumps(JSON_PAYLOAD)
    json_response = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        len(json_body), json_body)
    sse_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = writer.transport
        transport.max_size = 65536  # as rawserve sets it (see rawserve/http/server.py)
        while data := await reader.read(65536):
            if parse_with_h11:  # the one cost the design fixes for every request: h11 parses it
                parser = h11.Connection(h11.SERVER)
                parser.receive_data(data)
                parser.next_event()
            if not data.startswith(b"GET /sse "):
                transport.write(json_response)
                continue
            transport.write(sse_head)
            async for event in token_source(num_events, yield_between_events):
                payload = orjson.dumps(event)
                transport.write(b"%x\r\ndata: %b\n\n\r\n" % (len(payload) + 8, payload))
            transport.write(b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % 14)
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(connection, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    asyncio.run(main())


# --- the load generator ----------------------------------------------------------------------

def response_complete(buf: bytearray, is_sse: bool, run: "LoadRun", seen: int) -> bool:
    """Whether `buf` now holds one whole response; SSE events are counted as they arrive (not
    when their stream ends), so that a window holding a few waves of long streams is not
    quantized to whole streams. Completion is found by the terminal chunk (SSE) or Content-Length."""
    if is_sse:
        run.record_events(buf.count(b"data: {", max(0, seen - 6)))
        return buf.endswith(b"\r\n0\r\n\r\n")
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return False
    start = buf.find(b"content-length:", 0, end)  # both servers send lower-case names
    if start < 0:
        start = bytes(buf[:end]).lower().find(b"content-length:")
    start += 15
    stop = buf.find(b"\r\n", start, end)
    return len(buf) >= end + 4 + int(buf[start:stop if stop >= 0 else end])


class LoadClient(asyncio.Protocol):
    """The asyncio load generator (--client asyncio): one keep-alive connection sending the same
    request back to back. It costs about 30 µs of client CPU per request, which at one connection
    is as much as a server's own time and flattens the ratio; kept to compare against."""

    def __init__(self, request: bytes, is_sse: bool, run: "LoadRun") -> None:
        self.request = request
        self.is_sse = is_sse
        self.run = run
        self.buffer = bytearray()
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self) -> None:
        self.buffer.clear()
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        seen = len(buf)
        buf += data
        if not response_complete(buf, self.is_sse, self.run, seen):
            return
        now = time.perf_counter()
        self.run.record(now, now - self.sent_at, buf.startswith(b"HTTP/1.1 200"))
        if now < self.run.stop_at:
            self.send()
        else:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class LoadRun:
    def __init__(self, warmup_until: float, stop_at: float) -> None:
        self.warmup_until = warmup_until
        self.stop_at = stop_at
        self.latencies: list[float] = []
        self.num_events = 0
        self.num_warmup = 0
        self.num_errors = 0

    def record(self, now: float, latency_s: float, ok: bool) -> None:
        if not ok:
            self.num_errors += 1
        if now < self.warmup_until:
            self.num_warmup += 1
        elif now <= self.stop_at:
            self.latencies.append(latency_s)

    def record_events(self, num_events: int) -> None:
        if num_events and self.warmup_until <= time.perf_counter() <= self.stop_at:
            self.num_events += num_events


def _request_bytes(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n".encode()


async def load_asyncio(port: int, path: str, concurrency: int, warmup_s: float, duration_s: float) -> LoadRun:
    loop = asyncio.get_running_loop()
    request = _request_bytes(port, path)
    run = LoadRun(0.0, 0.0)
    clients = []
    for _ in range(concurrency):
        _, client = await loop.create_connection(lambda: LoadClient(request, path == "/sse", run), "127.0.0.1", port)
        clients.append(client)
    now = time.perf_counter()
    run.warmup_until = now + warmup_s
    run.stop_at = now + warmup_s + duration_s
    for client in clients:
        client.send()
    await asyncio.wait([c.closed for c in clients], timeout=warmup_s + duration_s + 30)
    for client in clients:
        client.transport.close()
    return run


def load_epoll(port: int, path: str, concurrency: int, warmup_s: float, duration_s: float) -> LoadRun:
    """The default load generator: one thread, level-triggered epoll over non-blocking sockets,
    reads into one preallocated buffer. About 4 µs of client CPU per request, so that what is
    measured is the servers, as a C generator (wrk, h2load) would have it."""
    request = _request_bytes(port, path)
    is_sse = path == "/sse"
    run = LoadRun(0.0, 0.0)
    poller = select.epoll()
    socks: dict[int, socket.socket] = {}
    buffers: dict[int, bytearray] = {}
    sent_at: dict[int, float] = {}
    try:
        for _ in range(concurrency):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            fd = sock.fileno()
            socks[fd], buffers[fd] = sock, bytearray()
            poller.register(fd, select.EPOLLIN)
        scratch = bytearray(1 << 18)
        view = memoryview(scratch)
        now = time.perf_counter()
        run.warmup_until = now + warmup_s
        run.stop_at = stop_at = now + warmup_s + duration_s
        give_up_at = stop_at + 30
        for fd, sock in socks.items():
            sent_at[fd] = time.perf_counter()
            sock.send(request)
        while socks and time.perf_counter() < give_up_at:
            for fd, _ in poller.poll(1.0):
                sock = socks[fd]
                try:
                    n = sock.recv_into(scratch)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    n = 0
                if not n:
                    run.num_errors += 1  # a server closed a keep-alive connection mid-run
                    poller.unregister(fd)
                    del socks[fd]
                    sock.close()
                    continue
                buf = buffers[fd]
                seen = len(buf)
                buf += view[:n]
                if not response_complete(buf, is_sse, run, seen):
                    continue
                now = time.perf_counter()
                run.record(now, now - sent_at[fd], buf.startswith(b"HTTP/1.1 200"))
                buf.clear()
                if now < stop_at:
                    sent_at[fd] = now
                    sock.send(request)
                else:
                    poller.unregister(fd)
                    del socks[fd]
                    sock.close()
    finally:
        for sock in socks.values():
            sock.close()
        poller.close()
    return run


def load(port: int, path: str, concurrency: int, warmup_s: float, duration_s: float,
         client: str = "epoll") -> LoadRun:
    if client == "asyncio":
        return asyncio.run(load_asyncio(port, path, concurrency, warmup_s, duration_s))
    return load_epoll(port, path, concurrency, warmup_s, duration_s)


# --- orchestration ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(name: str, args: argparse.Namespace) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.http", "--serve", name, "--port", str(port), "--events", str(args.events)]
    if not args.yield_between_events:
        cmd.append("--no-yield-between-events")
    proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} server exited with {proc.returncode}")
            time.sleep(0.05)
    raise RuntimeError(f"{name} server did not start")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_impl(name: str) -> str:
    if name == "uvicorn":
        import uvicorn  # only to name its version; it runs in its subprocess

        return f"uvicorn {uvicorn.__version__} --http h11 --loop asyncio (httptools, uvloop not installed)"
    if name == "floor":
        return "no HTTP: canned bytes per request head, asyncio streams (the ceiling on this loop)"
    if name == "floor-h11":
        return "floor plus an h11 parse per request (the ceiling for an h11-parsing server)"
    return "rawserve.http (h11 parsing, hand-written responses, asyncio streams)"


def paired_median(ours: list[float], theirs: list[float]) -> float | None:
    ratios = sorted(a / b for a, b in zip(ours, theirs) if b)
    if not ratios:
        return None
    mid = len(ratios) // 2
    return round(ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2, 3)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Point:
    """One (server, endpoint, concurrency) point, accumulated over rounds."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.rates: list[float] = []
        self.num_events = self.num_warmup = self.num_errors = self.num_all = 0
        self.server_cpu_s = self.client_cpu_s = self.wall_s = 0.0

    def add_round(self, proc: subprocess.Popen, port: int, endpoint: str, concurrency: int,
                  args: argparse.Namespace) -> None:
        server_cpu0, client_cpu0, wall0 = cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
        run = load(port, "/" + endpoint, concurrency, args.warmup_s, args.duration_s, args.client)
        self.server_cpu_s += cpu_seconds(proc.pid) - server_cpu0
        self.client_cpu_s += time.process_time() - client_cpu0
        self.wall_s += time.perf_counter() - wall0
        self.latencies += run.latencies
        self.num_events += run.num_events
        self.num_warmup += run.num_warmup
        self.num_errors += run.num_errors
        self.num_all += run.num_warmup + len(run.latencies)
        units = run.num_events if endpoint == "sse" else len(run.latencies)
        self.rates.append(round(units / args.duration_s, 1))

    def result(self, name: str, endpoint: str, concurrency: int, args: argparse.Namespace, rev: str) -> dict:
        measured_s = args.duration_s * args.rounds
        result = {
            "bench": "http", "server": name, "server_impl": server_impl(name), "endpoint": endpoint,
            "concurrency": concurrency,
            "client": args.client, "rounds": args.rounds, "duration_s": measured_s, "warmup_s": args.warmup_s * args.rounds,
            "warmup_requests": self.num_warmup, "requests": len(self.latencies), "errors": self.num_errors,
            "req_s": round(len(self.latencies) / measured_s, 1),
            "p50_ms": round(percentile(self.latencies, 0.50) * 1e3, 3),
            "p99_ms": round(percentile(self.latencies, 0.99) * 1e3, 3),
            # Requests (warmup included) per second of the server's own CPU: robust to a noisy
            # box and to a load generator that cannot saturate the server.
            "req_per_server_cpu_s": round(self.num_all / self.server_cpu_s, 1) if self.server_cpu_s else None,
            "server_cpu_util": round(self.server_cpu_s / self.wall_s, 2),
            "client_cpu_util": round(self.client_cpu_s / self.wall_s, 2),
            "rev": rev,
        }
        if endpoint == "sse":
            result["events_per_stream"] = args.events
            result["events_s"] = round(self.num_events / measured_s, 1)
            result["events_s_per_round"] = self.rates
            result["yield_between_events"] = args.yield_between_events
        else:
            result["req_s_per_round"] = self.rates
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=2.0, help="Measured time per round.")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="Unmeasured time before each round.")
    parser.add_argument("--rounds", type=int, default=3,
                        help="Rounds per point, alternating which server goes first (evens out noise).")
    parser.add_argument("--concurrency", default="1,64,256", help="Comma-separated connection counts.")
    parser.add_argument("--endpoints", default="json,sse", help="json, sse or both.")
    parser.add_argument("--servers", default="rawserve,uvicorn,floor,floor-h11",
                        help="Comma-separated: rawserve, uvicorn, floor, floor-h11 (see above).")
    parser.add_argument("--events", type=int, default=100, help="Events per SSE stream.")
    parser.add_argument("--client", choices=("epoll", "asyncio"), default="epoll",
                        help="Load generator: a lean epoll loop (default) or asyncio protocols (about 30 µs "
                             "of client CPU per request, which flattens the ratio at one connection).")
    parser.add_argument("--no-yield-between-events", dest="yield_between_events", action="store_false",
                        help="Let the SSE source yield events without passing through the event loop.")
    parser.add_argument("--serve", choices=("rawserve", "uvicorn", "floor", "floor-h11"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve == "rawserve":
        serve_rawserve(args.port, args.events, args.yield_between_events)
        return
    if args.serve == "uvicorn":
        serve_uvicorn(args.port, args.events, args.yield_between_events)
        return
    if args.serve in ("floor", "floor-h11"):
        serve_floor(args.port, args.events, args.yield_between_events, parse_with_h11=args.serve == "floor-h11")
        return

    rev = git_rev()
    names = [n for n in args.servers.split(",") if n]
    servers = {name: start_server(name, args) for name in names}
    try:
        for endpoint in args.endpoints.split(","):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                points = {name: Point() for name in names}
                for round_ in range(args.rounds):  # side by side, alternating who goes first
                    for name in (names if round_ % 2 == 0 else names[::-1]):
                        proc, port = servers[name]
                        log(f"{name} {endpoint} c={concurrency} round {round_ + 1}/{args.rounds}")
                        points[name].add_round(proc, port, endpoint, concurrency, args)
                results = {name: points[name].result(name, endpoint, concurrency, args, rev) for name in names}
                for name in names:
                    print(json.dumps(results[name]), flush=True)
                if "rawserve" in results and "uvicorn" in results:
                    ours, theirs = results["rawserve"], results["uvicorn"]
                    key = "events_s" if endpoint == "sse" else "req_s"
                    print(json.dumps({
                        "bench": "http", "compare": "rawserve/uvicorn", "endpoint": endpoint,
                        "concurrency": concurrency, "metric": key,
                        "throughput_ratio": round(ours[key] / theirs[key], 3) if theirs[key] else None,
                        # Rounds run side by side, so each round's pair shares that moment's noise
                        # from other tenants; the median of the paired ratios shrugs off a bad round.
                        "median_round_ratio": paired_median(points["rawserve"].rates, points["uvicorn"].rates),
                        "p99_ratio": round(ours["p99_ms"] / theirs["p99_ms"], 3) if theirs["p99_ms"] else None,
                        "cpu_efficiency_ratio": round(ours["req_per_server_cpu_s"] / theirs["req_per_server_cpu_s"], 3)
                        if ours["req_per_server_cpu_s"] and theirs["req_per_server_cpu_s"] else None,
                        "rawserve_p99_ms": ours["p99_ms"], "uvicorn_p99_ms": theirs["p99_ms"],
                        # The most any asyncio server could reach here, and how much of it we do.
                        "ceiling_ratio": round(results["floor"][key] / theirs[key], 3)
                        if "floor" in results and theirs[key] else None,
                        "rawserve_of_floor": round(ours[key] / results["floor"][key], 3)
                        if "floor" in results and results["floor"][key] else None,
                        "ceiling_ratio_h11": round(results["floor-h11"][key] / theirs[key], 3)
                        if "floor-h11" in results and theirs[key] else None,
                        "rev": rev,
                    }), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
