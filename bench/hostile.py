"""The hostile run's inputs (issue 33) as a catalog, and a bounded abuse-under-load run against a real server.

Each case is raw bytes a client may send and the statuses it may get; none may be a 5xx, and the engine must
still answer an ordinary request after it. `python -m bench.hostile [--seconds 60] [--concurrency 64]` fires the
catalog once, then soaks the server with bench.soak's mixed traffic with every catalog case in the mix, and
prints JSON lines (one per catalog case that failed, then the result). tests/test_soak.py fires the catalog in the
suite, then runs a short soak that includes it, on the same server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from bench.client import request_bytes

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[str, str], bytes]  # (host, model) -> the bytes sent
    allowed: tuple[int, ...]  # statuses it may get; 0: the server may close without an answer
    says: str = ""  # a phrase the error message must carry (case-insensitive), where the status is 4xx


def _chat(**fields: object) -> Callable[[str, str], bytes]:
    def build(host: str, model: str) -> bytes:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **fields}
        return request_bytes(host, CHAT, _json(body))
    return build


def _post(path: str, body: dict) -> Callable[[str, str], bytes]:
    return lambda host, model: request_bytes(host, path, _json(body))


def _json(body: dict) -> bytes:
    # the standard library's encoder: orjson refuses the integers past 64 bits these cases send
    return json.dumps(body).encode()


def _raw(data: bytes) -> Callable[[str, str], bytes]:
    return lambda host, model: data


def _many_alternatives(num: int) -> str:
    return "^(" + "|".join(f"w{i:05d}" for i in range(num)) + ")$"


def _absolute_form(host: str, model: str) -> bytes:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    return (b"POST http://%b/v1/chat/completions HTTP/1.1\r\nhost: %b\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b") % (host.encode(), host.encode(), len(body), body)


def _chat_head(extra: bytes = b"") -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + extra


_BIAS_EVERY_ID = {str(i): (100 if i % 2 else -100) for i in range(512)}

CASES: tuple[Case, ...] = (
    # 1. sampling values that killed the core
    Case("temperature_1e-300", _chat(temperature=1e-300), (200, 400)),
    Case("temperature_1e-300_top_logprobs", _chat(temperature=1e-300, logprobs=True, top_logprobs=5), (200, 400)),
    Case("temperature_1e-39", _chat(temperature=1e-39), (200, 400)),
    Case("temperature_1e-45", _chat(temperature=1e-45), (200, 400)),
    Case("repetition_penalty_1e-300", _chat(repetition_penalty=1e-300), (400,), "repetition_penalty"),
    Case("temperature_1e18", _chat(temperature=1e18), (400,), "temperature"),
    Case("temperature_3", _chat(temperature=3), (400,), "temperature"),
    Case("seed_-1", _chat(seed=-1), (400,), "out of range"),
    Case("seed_2**64", _chat(seed=2**64), (400,), "out of range"),
    Case("top_k_2**64", _chat(top_k=2**64), (400,), "out of range"),
    Case("logit_bias_every_id", _chat(logit_bias=_BIAS_EVERY_ID, temperature=1.0), (200, 400)),
    Case("min_p_1_top_p_tiny", _chat(min_p=1.0, top_p=1e-300, temperature=1.0), (200, 400)),
    Case("presence_penalty_2_frequency_-2", _chat(presence_penalty=2, frequency_penalty=-2, temperature=1e-30),
         (200, 400)),
    # 2. adapter loads probing the file system (closed unless the operator opted in)
    Case("lora_etc_shadow", _post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/shadow"}),
         (400, 404)),
    Case("lora_dev_zero", _post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/dev/zero"}), (400, 404)),
    Case("lora_root", _post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/root"}), (400, 404)),
    # 3. a grammar built to take the compile worker
    Case("guided_regex_20000_alternatives", _chat(guided_regex=_many_alternatives(20000)), (200, 400)),
    Case("json_schema_20000_alternatives", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": _many_alternatives(20000)}}}), (400,)),
    # 5. HTTP corners (RFC 9112)
    Case("absolute_form_target", _absolute_form, (200,)),
    Case("chunk_size_over_the_body_cap", _raw(_chat_head(b"transfer-encoding: chunked\r\n\r\n") +
                                               b"fffffffffff\r\n{"), (413,)),
    Case("obs_fold_header", _raw(_chat_head(b"x-folded: a\r\n b\r\ncontent-length: 2\r\n\r\n{}")), (400,)),
    Case("body_not_utf8", _raw(_chat_head(b"content-length: 14\r\nconnection: close\r\n\r\n") +
                               b'{"model": "\xff"}'), (400,), "utf-8"),
    # 6. OpenAI's input rules
    Case("user_content_null", _post(CHAT, {"messages": [{"role": "user", "content": None}]}), (400,)),
    Case("user_content_empty_list", _post(CHAT, {"messages": [{"role": "user", "content": []}]}), (400,)),
)


# ----- sending one case ------------------------------------------------------------------------------------

async def exchange(host: str, port: int, data: bytes, timeout_s: float = 30.0) -> tuple[int, dict | None]:
    """Send bytes, read to the end of the answer: (status, the JSON body or None); status 0 if none came."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    try:
        writer.write(data)
        answer = await asyncio.wait_for(reader.read(-1), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 "):
        return 0, None
    if b"transfer-encoding: chunked" in head.lower():
        body = _unchunk(body)
    try:
        return int(head.split(b" ", 2)[1]), orjson.loads(body)
    except (ValueError, orjson.JSONDecodeError):
        return int(head.split(b" ", 2)[1]), None


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


def problem(case: Case, status: int, body: dict | None) -> str | None:
    """What is wrong with a case's answer, or None."""
    if status not in case.allowed:
        return f"status {status}, allowed {case.allowed}"
    if 400 <= status < 500:
        error = (body or {}).get("error")
        if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            return f"not OpenAI's error shape: {body!r}"[:300]
        if case.says and case.says.lower() not in str(error["message"]).lower():
            return f"message {error['message']!r} does not say {case.says!r}"
    return None


async def alive(host: str, port: int, model: str) -> bool:
    """The engine still answers an ordinary request."""
    status, body = await exchange(host, port, request_bytes(host, CHAT, {
        "model": model, "messages": [{"role": "user", "content": "are you there?"}], "max_tokens": 2}))
    return status == 200 and bool(body and body.get("choices"))


async def run_catalog(host: str, port: int, model: str) -> list[dict]:
    """Each case once, each followed by an ordinary request; the failures (an empty list when all held)."""
    failures = []
    for case in CASES:
        started = time.monotonic()
        status, body = await exchange(host, port, case.build(host, model))
        what = problem(case, status, body)
        if what is None and not await alive(host, port, model):
            what = "the engine no longer answers after it"
        if what is not None:
            failures.append({"case": case.name, "problem": what, "seconds": round(time.monotonic() - started, 2)})
    return failures


# ----- the bounded abuse run -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model-dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from bench.soak import run

    result = run(args.seconds, args.concurrency, args.model_dir, args.seed, catalog_first=True)
    for failure in result.get("catalog_failures", ()):
        print(json.dumps({"bench": "hostile", **failure}), flush=True)
    result["bench"] = "hostile"
    print(json.dumps(result), flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
