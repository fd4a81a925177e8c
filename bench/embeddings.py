"""Embeddings/s of a live rawserve server against sentence-transformers' in-process encode, in the same run: 64
short texts (16 tokens) and 8 long ones (512 tokens), each set as one /v1/embeddings request, on random checkpoints
shaped as bge-small (BERT, 33M) and Qwen3-Embedding-0.6B. JSON lines on stdout, logs on stderr.

    python -m bench.embeddings [--models bge-small,qwen3-0.6b] [--repeats 3] [--small]

--small shrinks both models (a smoke run on a busy CPU). llama.cpp's server is not compared here (no GGUF writer).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import tempfile
import threading
import time
import urllib.request

from bench.checkpoints import rev
from tests.embedding_checkpoints import WORDS, make_bge_small, make_qwen3_embedding

SHAPES = {
    "bge-small": dict(hidden_size=384, num_layers=12, intermediate_size=1536, num_heads=12),
    "qwen3-0.6b": dict(hidden_size=1024, num_layers=28, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                       head_dim=128),
}
SMALL = {"bge-small": dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4),
         "qwen3-0.6b": dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2,
                            head_dim=32)}


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def texts_of(tokenizer, count: int, num_tokens: int, salt: int) -> list[str]:
    """`count` distinct texts of exactly num_tokens tokens each under `tokenizer` (its special tokens included)."""
    out = []
    for k in range(count):
        words = [WORDS[(k * 7 + i + salt) % len(WORDS)] for i in range(num_tokens)]
        while len(tokenizer.encode(" ".join(words))) > num_tokens:
            words.pop()
        out.append(" ".join(words))
    return out


class Server:
    """The OpenAI server in this process (its core spawned, as `rawserve serve` runs it), on a free port."""

    def __init__(self, model_dir: pathlib.Path) -> None:
        from rawserve.api.app import OpenAIServer
        from rawserve.config import EngineConfig, ServerConfig

        self.app = OpenAIServer(EngineConfig(model_dir=str(model_dir), max_num_batched_tokens=8192),
                                ServerConfig(port=0, served_model_name="m", log_requests=False))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.app.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not started.wait(600):
            raise RuntimeError("the server did not start")
        self.base = f"http://127.0.0.1:{self.app.port}"

    def embed(self, texts: list[str]) -> dict:
        request = urllib.request.Request(self.base + "/v1/embeddings", data=json.dumps({"input": texts}).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.app.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def timed(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls (after one warm-up call, not counted)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def bench_model(name: str, small: bool, repeats: int) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from rawserve.text.tokenizer import Tokenizer

    shape = (SMALL if small else SHAPES)[name]
    with tempfile.TemporaryDirectory() as tmp:
        log(f"writing a random {name}-shaped checkpoint")
        model_dir = (make_bge_small if name == "bge-small" else make_qwen3_embedding)(pathlib.Path(tmp) / name, **shape)
        tokenizer = Tokenizer.from_dir(model_dir)
        sets = {"short": texts_of(tokenizer, 64, 16, 0), "long": texts_of(tokenizer, 8, 512, 3)}
        reference = SentenceTransformer(str(model_dir), device="cpu")
        server = Server(model_dir)
        try:
            for label, texts in sets.items():
                num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
                st_s = timed(lambda: reference.encode(texts, batch_size=len(texts)), repeats)
                server_s = timed(lambda: server.embed(texts), repeats)
                got = torch.tensor([d["embedding"] for d in server.embed(texts)["data"]])
                want = reference.encode(texts, batch_size=len(texts), convert_to_tensor=True).float()
                print(json.dumps({
                    "bench": "embeddings", "model": name, "small": small, "set": label, "num_texts": len(texts),
                    "num_tokens": num_tokens, "server_embeddings_per_s": round(len(texts) / server_s, 2),
                    "sentence_transformers_embeddings_per_s": round(len(texts) / st_s, 2),
                    "ratio_server_vs_st": round(st_s / server_s, 3),
                    "max_abs_diff": float((got - want).abs().max()), "threads": torch.get_num_threads(),
                    "repeats": repeats, "rev": rev()}), flush=True)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bge-small,qwen3-0.6b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke run")
    args = parser.parse_args()
    for name in args.models.split(","):
        if name not in SHAPES:
            parser.error(f"--models: unknown {name!r} (known: {', '.join(SHAPES)})")
        bench_model(name, args.small, args.repeats)


if __name__ == "__main__":
    main()
