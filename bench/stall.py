"""How long one hostile request stalls everyone else's token streams.

    python -m bench.stall [--hostile-mb 6] [--engine-mode process]

Serves the demo model with `python -m rawserve`, keeps one long streaming completion going, and
reads its events on a raw socket, timing the gap between consecutive events. Then it sends, one
at a time, requests that make the server do a lot of work on its event loop's side: a multi-MB
text prompt (refused for its length after tokenizing), a multi-MB /tokenize, /detokenize of
millions of ids, and structured output whose grammar is new (a 300-property JSON schema, a regex with a
9,000-step repeat): they compile in the server's process and build their first masks in the core.
Prints one JSON line per case: the largest gap between the stream's events while
that request was being answered, against the stream's own p99 gap when nothing else happens.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

from bench.http import free_port, git_rev


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def post(port: int, path: str, body: bytes, timeout: float = 120.0) -> tuple[int, bytes, float]:
    """-> (status, response body, seconds to the whole answer)."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        data = bytearray()
        while chunk := sock.recv(1 << 20):
            data += chunk
    head, _, payload = bytes(data).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload, time.perf_counter() - started


class StreamWatch(threading.Thread):
    """Keeps one streaming completion going (a new one when one ends) and records when each event
    arrived; gaps are only counted within one stream."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.arrivals: list[tuple[float, int]] = []  # (time, stream number)
        self.stop = False

    def run(self) -> None:
        body = json.dumps({"prompt": "Once upon a time", "ignore_eos": True, "stream": True}).encode()
        number = 0
        while not self.stop:
            number += 1
            with socket.create_connection(("127.0.0.1", self.port)) as sock:
                sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
                while not self.stop and (chunk := sock.recv(1 << 16)):
                    if b"data: {" in chunk:
                        self.arrivals.append((time.perf_counter(), number))

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive events of one stream, for every gap that overlaps [start, end]."""
        arrivals = list(self.arrivals)
        return [b - a for (a, sa), (b, sb) in zip(arrivals, arrivals[1:]) if sa == sb and b >= start and a <= end]


def big_schema(salt: str) -> dict:
    """A wide, nested schema no earlier run has compiled (the salt changes its property names)."""
    props = {}
    for i in range(300):
        kind = i % 4
        props[f"p{salt}_{i}"] = ({"type": "string", "maxLength": 20} if kind == 0 else
                                 {"type": "integer", "minimum": -i, "maximum": 1000 + i} if kind == 1 else
                                 {"enum": ["red", "green", f"v{i}"]} if kind == 2 else
                                 {"type": "object", "properties": {"a": {"type": "boolean"},
                                                                   "b": {"type": "array", "items": {"type": "number"}}},
                                  "required": ["a"]})
    return {"type": "object", "properties": props, "required": list(props)[:10]}


def small_schema(salt: int, i: int) -> dict:
    """A 12-property object, different for every (salt, i)."""
    props = {f"k{salt}_{i}_{j}": {"type": "string", "maxLength": 8} if j % 2 else
             {"type": "integer", "minimum": 0, "maximum": 10 * i + j} for j in range(12)}
    return {"type": "object", "properties": props, "required": list(props)[:1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hostile-mb", type=float, default=6.0, help="Size of each hostile request body.")
    parser.add_argument("--engine-mode", default="process", choices=("process", "thread"))
    args = parser.parse_args()

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rawserve", "--port", str(port), "--engine-mode", args.engine_mode,
                             "--max-body-bytes", str(int(args.hostile_mb * 2**20) + 65536)],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if post(port, "/tokenize", b'{"prompt": "warm up"}', 5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        size = int(args.hostile_mb * 2**20)
        sentence = "Once upon a time, a dragon drank tea. "
        text = sentence * (size // len(sentence))
        # Real ids of the server's own tokenizer, repeated.
        sample = json.loads(post(port, "/tokenize", json.dumps({"prompt": sentence * 200,
                                                                "add_special_tokens": False}).encode())[1])["tokens"]
        ids = (sample * (size // (len(json.dumps(sample)) + 1) + 1))[: size // 6]
        cases = {
            "completion_text_prompt": ("/v1/completions", {"model": "rawserve-demo", "prompt": text, "max_tokens": 1}),
            "tokenize_text": ("/tokenize", {"prompt": text}),
            "detokenize_ids": ("/detokenize", {"tokens": ids}),
            "guided_new_300_property_schema": ("/v1/completions", {
                "model": "rawserve-demo", "prompt": "JSON:", "max_tokens": 8, "guided_json": big_schema(f"{port}")}),
            "guided_new_9000_repeat_regex": ("/v1/completions", {
                "model": "rawserve-demo", "prompt": "Letters:", "max_tokens": 8,
                "guided_regex": f"[a-z]{{0,9000}}x{port}"}),
        }
        # Start the grammar compile worker (spawned on the first guided request), as a server that serves
        # structured output has it running; the guided cases then measure compiling, not spawning.
        post(port, "/v1/completions", json.dumps({"model": "rawserve-demo", "prompt": "x", "max_tokens": 2,
                                                  "guided_regex": "[ab]{2}"}).encode())
        watch = StreamWatch(port)
        watch.start()
        time.sleep(2.0)  # the stream settles into its pace
        calm_start = time.perf_counter()
        time.sleep(2.0)
        calm = sorted(watch.gaps(calm_start, time.perf_counter()))
        calm_p99 = calm[int(0.99 * (len(calm) - 1))]
        rev = git_rev()
        # 50 requests at once, each with a JSON schema no one compiled before: compiles queue in the worker,
        # and the core builds 50 grammars' first masks inside its steps, beside the watched stream.
        cases["guided_50_new_schemas_at_once"] = ("/v1/chat/completions", [{
            "model": "rawserve-demo", "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": small_schema(port, i)}}}
            for i in range(50)])
        for name, (path, payload) in cases.items():
            bodies = [json.dumps(p).encode() for p in (payload if isinstance(payload, list) else [payload])]
            start = time.perf_counter()
            answers: list[tuple[int, bytes, float]] = []
            senders = [threading.Thread(target=lambda b=b: answers.append(post(port, path, b))) for b in bodies]
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join()
            end = time.perf_counter()
            time.sleep(0.5)  # let the event after the request arrive
            gaps = sorted(watch.gaps(start, end))
            print(json.dumps({
                "bench": "stall", "case": name, "num_requests": len(bodies),
                "body_mb": round(sum(map(len, bodies)) / 2**20, 2), "status": sorted({a[0] for a in answers}),
                "request_s": round(max(a[2] for a in answers), 3), "max_stream_gap_ms": round(gaps[-1] * 1e3, 1),
                "p99_stream_gap_ms": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 1),
                "calm_p99_gap_ms": round(calm_p99 * 1e3, 2), "engine_mode": args.engine_mode, "rev": rev,
            }), flush=True)
        watch.stop = True
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
