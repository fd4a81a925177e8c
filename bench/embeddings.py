"""Embeddings/s of a live rawserve server against sentence-transformers' in-process encode and (with --llama-server)
llama.cpp's server on the same checkpoint's GGUF, interleaved in one run: 64 short texts (16 tokens) and 8 long ones
(512 tokens), each set one /v1/embeddings request, on random checkpoints shaped as bge-small (BERT, 33M) and
Qwen3-Embedding-0.6B; and rerank of 1 query x 32 documents against a batch-32 embedding call of the same token count
(bge-small-shaped BertForSequenceClassification). JSON lines on stdout, logs on stderr.

    python -m bench.embeddings [--models bge-small,qwen3-0.6b,rerank] [--repeats 3] [--threads 2] [--small]
        [--llama-server ~/.cache/rawserve-peers/llama.cpp/build/bin/llama-server]

Fair by construction: every engine gets the same texts (fresh random ones each repetition, so no engine answers
from a prefix cache), the same thread count (the core's --num-threads, torch.set_num_threads for
sentence-transformers, -t/-tb for llama-server), one warm-up, and the median of --repeats. The servers are measured
through HTTP, one request carrying the batch. --llama-server needs --llama-python (a Python with gguf and
transformers) to run llama.cpp's convert_hf_to_gguf.py, found beside the binary's source tree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from bench.checkpoints import QWEN3_TOKENIZER, rev
from tests.embedding_checkpoints import WORDS, make_bge_small, make_qwen3_embedding, wordpiece_tokenizer

SHAPES = {
    "bge-small": dict(hidden_size=384, num_layers=12, intermediate_size=1536, num_heads=12),
    "qwen3-0.6b": dict(hidden_size=1024, num_layers=28, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                       head_dim=128),
}
SMALL = {"bge-small": dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4),
         "qwen3-0.6b": dict(hidden_size=128, num_layers=2, intermediate_size=256, num_heads=4, num_kv_heads=2,
                            head_dim=32)}
SETS = {"short": (64, 16), "long": (8, 512)}
# The converter names a tokenizer's pre-tokenizer by hashing its output on a fixed text; a tokenizer built here has
# no known hash, so the bench names the one the published model has (bge-small: bert-bge; Qwen3: qwen2).
GGUF_PRE = {"bge-small": "bert-bge", "qwen3-0.6b": "qwen2", "rerank": "bert-bge"}
CONVERT = """import sys
llama, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, llama)
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def random_texts(tokenizer, count: int, num_tokens: int, seed: int) -> list[str]:
    """`count` random texts of at most num_tokens tokens each (their special tokens included), as many as fit."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(num_tokens)]
        while len(tokenizer.encode(" ".join(words))) > num_tokens:
            words.pop()
        out.append(" ".join(words))
    return out


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=1200) as response:
        return json.loads(response.read())


class Server:
    """The OpenAI server in this process (its core spawned, as `rawserve serve` runs it), on a free port."""

    def __init__(self, model_dir: pathlib.Path, threads: int) -> None:
        from rawserve.api.app import OpenAIServer
        from rawserve.config import EngineConfig, ServerConfig

        self.app = OpenAIServer(EngineConfig(model_dir=str(model_dir), max_num_batched_tokens=8192,
                                             num_threads=threads),
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

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.app.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class LlamaServer:
    """llama.cpp's server on a GGUF, one slot per input of the largest request (unified KV), on a free port."""

    def __init__(self, binary: str, gguf: pathlib.Path, flags: list[str], threads: int, slots: int,
                 log_path: pathlib.Path) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [binary, "-m", str(gguf), *flags, "-t", str(threads), "-tb", str(threads), "-c", "8192", "-b", "8192",
             "-ub", "8192", "-np", str(slots), "--kv-unified", "--host", "127.0.0.1", "--port", str(port)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def to_gguf(args, name: str, model_dir: pathlib.Path, outtype: str) -> pathlib.Path:
    out = model_dir.parent / f"{model_dir.name}-{outtype}.gguf"
    llama_dir = pathlib.Path(args.llama_source)
    log(f"converting {model_dir.name} to {out.name}")
    subprocess.run([args.llama_python, "-c", CONVERT, str(llama_dir), GGUF_PRE[name], str(model_dir),
                    "--outtype", outtype, "--outfile", str(out)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out


def make_bge_reranker_bert(directory: pathlib.Path, **shape) -> pathlib.Path:
    """bge-small-shaped BertForSequenceClassification, 1 label: a cross-encoder llama.cpp's converter takes (its
    XLM-R path wants a SentencePiece model, which a WordPiece-built checkpoint has not)."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = wordpiece_tokenizer(directory)
    config = transformers.BertConfig(
        vocab_size=vocab_size, hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"], intermediate_size=shape["intermediate_size"],
        max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, num_labels=1)
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(directory, safe_serialization=True)
    return directory


def run_interleaved(engines: dict, repeats: int, texts_for) -> dict[str, list[float]]:
    """One warm-up round, then `repeats` rounds; each round's texts are fresh and the same for every engine, and the
    engines' order rotates so none is always first after the others' caches went cold."""
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats + 1):
        texts = texts_for(round_)
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            started = time.perf_counter()
            engines[name](texts)
            if round_:
                times[name].append(time.perf_counter() - started)
    return times


def bench_embed(args, name: str, tmp: pathlib.Path) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from rawserve.text.tokenizer import Tokenizer

    shape = (SMALL if args.small else SHAPES)[name]
    log(f"writing a random {name}-shaped checkpoint")
    if name == "bge-small":
        model_dir = make_bge_small(tmp / name, **shape)
    else:
        model_dir = make_qwen3_embedding(tmp / name, **shape,
                                         tokenizer_dir=QWEN3_TOKENIZER if QWEN3_TOKENIZER.is_dir() else None)
    pooling = "cls" if name == "bge-small" else "last"
    tokenizer = Tokenizer.from_dir(model_dir)
    torch.set_num_threads(args.threads)
    reference = SentenceTransformer(str(model_dir), device="cpu")
    server = Server(model_dir, args.threads)
    llamas: dict[str, LlamaServer] = {}
    try:
        if args.llama_server:
            for outtype in ("f32", "f16"):
                gguf = to_gguf(args, name, model_dir, outtype)
                llamas[f"llama_{outtype}"] = LlamaServer(
                    args.llama_server, gguf, ["--embedding", "--pooling", pooling], args.threads, 64,
                    tmp / f"llama-{name}-{outtype}.log")
        usage: dict[str, int] = {}

        def via(base: str, key: str):
            def call(texts: list[str]) -> None:
                reply = post(base + "/v1/embeddings", {"input": texts, "model": "m"})
                assert len(reply["data"]) == len(texts)
                usage[key] = reply["usage"]["prompt_tokens"]
            return call

        for label in args.sets.split(","):
            count, num_tokens = SETS[label]
            engines = {"sentence_transformers": lambda texts: reference.encode(texts, batch_size=len(texts)),
                       "server": via(server.base, "server")}
            engines.update({key: via(llama.base, key) for key, llama in llamas.items()})
            load_before = load_average()
            times = run_interleaved(engines, args.repeats,
                                    lambda r: random_texts(tokenizer, count, num_tokens, seed=1000 * r + count))
            texts = random_texts(tokenizer, count, num_tokens, seed=999_999)
            got = torch.tensor([d["embedding"] for d in post(server.base + "/v1/embeddings",
                                                             {"input": texts})["data"]])
            want = reference.encode(texts, batch_size=len(texts), convert_to_tensor=True).float()
            median = {key: statistics.median(values) for key, values in times.items()}
            row = {"bench": "embeddings", "model": name, "small": args.small, "set": label, "num_texts": count,
                   "tokens_per_text": num_tokens, "prompt_tokens": usage,
                   **{f"{key}_embeddings_per_s": round(count / s, 2) for key, s in median.items()},
                   "ratio_server_vs_st": round(median["sentence_transformers"] / median["server"], 3),
                   **{f"ratio_server_vs_{key}": round(median[key] / median["server"], 3) for key in llamas},
                   "times_s": {key: [round(v, 4) for v in values] for key, values in times.items()},
                   "max_abs_diff_vs_st": float((got - want).abs().max()), "threads": args.threads,
                   "repeats": args.repeats, "load_average": [load_before, load_average()], "rev": rev()}
            print(json.dumps(row), flush=True)
    finally:
        server.stop()
        for llama in llamas.values():
            llama.stop()


def bench_rerank(args, tmp: pathlib.Path) -> None:
    """Rerank of 1 query x 32 documents against an embedding call of 32 inputs of the same token count, each on a
    bge-small-shaped model (a cross-encoder and an embedder), on rawserve and (with --llama-server) llama.cpp."""
    from rawserve.text.tokenizer import Tokenizer

    shape = (SMALL if args.small else SHAPES)["bge-small"]
    reranker = make_bge_reranker_bert(tmp / "reranker", **shape)
    embedder = make_bge_small(tmp / "embedder", **shape)
    tokenizer = Tokenizer.from_dir(embedder)
    servers = {"server": (Server(reranker, args.threads), Server(embedder, args.threads))}
    try:
        if args.llama_server:
            servers["llama_f32"] = (
                LlamaServer(args.llama_server, to_gguf(args, "rerank", reranker, "f32"), ["--reranking"],
                            args.threads, 32, tmp / "llama-rerank.log"),
                LlamaServer(args.llama_server, to_gguf(args, "bge-small", embedder, "f32"),
                            ["--embedding", "--pooling", "cls"], args.threads, 32, tmp / "llama-embed.log"))
        query_tokens, doc_tokens = 16, 112  # a pair: [CLS] query [SEP] document [SEP], 16 + 112 - 1 = 127 tokens

        def workload(r: int) -> tuple[str, list[str], list[str]]:
            query = random_texts(tokenizer, 1, query_tokens, seed=7000 + r)[0]
            docs = random_texts(tokenizer, 32, doc_tokens, seed=8000 + r)
            return query, docs, [query + " " + doc for doc in docs]

        engines = {}
        for key, (rerank_server, embed_server) in servers.items():
            engines[f"{key}_rerank"] = (lambda w, base=rerank_server.base: post(
                base + "/v1/rerank", {"model": "m", "query": w[0], "documents": w[1]}))
            engines[f"{key}_embed"] = (lambda w, base=embed_server.base: post(
                base + "/v1/embeddings", {"model": "m", "input": w[2]}))
        load_before = load_average()
        times = run_interleaved(engines, args.repeats, workload)
        median = {key: statistics.median(values) for key, values in times.items()}
        print(json.dumps({
            "bench": "rerank", "small": args.small, "num_documents": 32, "pair_tokens": query_tokens + doc_tokens - 1,
            **{f"{key}_s": round(s, 4) for key, s in median.items()},
            **{f"ratio_rerank_vs_embed_{key}": round(median[f"{key}_rerank"] / median[f"{key}_embed"], 3)
               for key in servers},
            **({"ratio_server_vs_llama_f32_rerank": round(median["llama_f32_rerank"] / median["server_rerank"], 3)}
               if "llama_f32" in servers else {}),
            "threads": args.threads, "repeats": args.repeats, "load_average": [load_before, load_average()],
            "rev": rev()}), flush=True)
    finally:
        for pair in servers.values():
            for server in pair:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bge-small,qwen3-0.6b,rerank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", default="short,long", help="which text sets: short (64 x 16 tokens), long (8 x 512)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every engine")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: compare against it")
    parser.add_argument("--llama-source", default=None,
                        help="llama.cpp's source tree (convert_hf_to_gguf.py); default: three levels above the binary")
    parser.add_argument("--llama-python", default=str(pathlib.Path.home() / ".cache/rawserve-peers/venv/bin/python"),
                        help="a Python with gguf and transformers for the converter")
    args = parser.parse_args()
    if args.llama_server and args.llama_source is None:
        args.llama_source = str(pathlib.Path(args.llama_server).resolve().parents[2])
    for name in args.models.split(","):
        if name not in (*SHAPES, "rerank"):
            parser.error(f"--models: unknown {name!r} (known: {', '.join((*SHAPES, 'rerank'))})")
    for label in args.sets.split(","):
        if label not in SETS:
            parser.error(f"--sets: unknown {label!r} (known: {', '.join(SETS)})")
    log(f"load average at start: {load_average()}")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if name == "rerank":
                bench_rerank(args, pathlib.Path(tmp))
            else:
                bench_embed(args, name, pathlib.Path(tmp))


if __name__ == "__main__":
    main()
