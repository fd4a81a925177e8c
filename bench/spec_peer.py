"""Speculative decoding side by side with llama.cpp's server: one stream, the same checkpoint (bf16), the same
prompt and output lengths, each side with and without speculation at the same synthetic acceptance length L.

python -m bench.spec_peer [--llama-server PATH] [--model-dir DIR] [--gguf FILE] [--draft-dir DIR]
                          [--draft-gguf FILE] [--k 4] [--L 3] [--input-len 128] [--output-len 128] [--rounds 3]
                          [--threads 2] [--no-draft-synthetic]
Servers started once and kept up: rawserve plain, rawserve with {"method": "synthetic", "num_speculative_tokens":
k, "acceptance_length": L}, rawserve with the draft model and that acceptance ({"model": DRAFT,
"num_speculative_tokens": k, "acceptance_length": L}: llama.cpp's setting exactly), llama-server plain,
llama-server with `--spec-type draft-simple -md DRAFT --spec-draft-n-max k --spec-synth-len L` (DRAFT: a 2-layer
draft of the target's shape and vocabulary, random weights, built and converted once when missing). Each round
sends one request to each, alternating rawserve and llama, so the box's load drift falls on both sides alike;
every request is a fresh prompt (no prefix hit), temperature 0, ignore_eos, max_tokens exact (checked against
usage). One JSON line per request, then one with medians per server and the ratios.

Both sides mean the same L: llama.cpp's --spec-synth-len is the mean tokens per verified step, the target's own
included (common/speculative.cpp solves p with p + p^2 + ... + p^n_max = L - 1 and accepts draft i with p given
draft i - 1 was), which is rawserve's acceptance_length exactly (proposers._rate_for_mean); k is n_max on both.
rawserve's "synthetic" method runs no draft model (it repeats the last tokens), so its figure is the verifier's
cost alone; llama.cpp's includes a 2-layer draft's k forwards (its 152k-row head is most of it), as does
rawserve's draft-model row, the like-for-like one.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import time

import orjson

from bench.client import request_bytes
from bench.procs import free_port, wait_healthy
from bench.serve import start_server, stop_server

PEERS = pathlib.Path(os.environ.get("PEERS_ROOT", pathlib.Path.home() / ".cache" / "rawserve-peers"))
TARGET_VS_LLAMA = 1.2  # the issue's: at L = 3, batch-1 tok/s >= 1.2x llama.cpp's at the same L


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def ensure_draft(model_dir: pathlib.Path, draft_dir: pathlib.Path, draft_gguf: pathlib.Path) -> None:
    """A 2-layer random draft of the target's (Qwen3-0.6B) shape and tokenizer in HF form, and its bf16 GGUF
    (converted with the peers' venv and llama.cpp's converter)."""
    from bench.checkpoints import QWEN3_06B, QWEN3_BOS, QWEN3_EOS, QWEN3_GENERATION
    from rawserve.demo_model import write_qwen3_checkpoint

    if not (draft_dir / "model.safetensors").exists():
        log(f"writing the 2-layer draft {draft_dir}")
        write_qwen3_checkpoint(draft_dir, dataclasses.replace(QWEN3_06B, num_hidden_layers=2), seed=7,
                               dtype="bfloat16", bos_token_id=QWEN3_BOS, eos_token_id=QWEN3_EOS,
                               generation_config=QWEN3_GENERATION)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            if (model_dir / name).exists():
                shutil.copyfile(model_dir / name, draft_dir / name)
    if not draft_gguf.exists():
        log(f"converting {draft_dir} to {draft_gguf}")
        subprocess.run([str(PEERS / "venv" / "bin" / "python"), str(PEERS / "llama.cpp" / "convert_hf_to_gguf.py"),
                        str(draft_dir), "--outtype", "bf16", "--outfile", str(draft_gguf)], check=True,
                       stdout=subprocess.DEVNULL)


def start_llama(binary: str, gguf: pathlib.Path, threads: int, context: int, spec: list[str]) -> tuple:
    port = free_port()
    command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-tb", str(threads), "-np", "1", "-c", str(context), "--no-webui", "--alias", "m", *spec]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(proc, port, f"llama-server ({' '.join(command)})", timeout_s=300)
    except RuntimeError:
        stop_server(proc)
        raise
    return proc, port


async def one_stream(port: int, prompt: list[int], output_len: int) -> dict:
    """One streamed /v1/completions request: TTFT (first event with text), e2e, completion tokens (usage)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 22)
    ttft = None
    usage = None
    try:
        writer.write(request_bytes("127.0.0.1", "/v1/completions", body))
        head = await reader.readuntil(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        if b" 200 " not in status_line:
            raise RuntimeError(f"{status_line!r}: {await reader.read(4096)!r}")
        buffer = b""
        done = False
        while not done:
            chunk = await reader.read(65536)
            if not chunk:
                break
            buffer += chunk
            for line in buffer.split(b"\n")[:-1]:
                line = line.strip()
                done = done or line == b"data: [DONE]"
                if not line.startswith(b"data: ") or done:
                    continue
                event = orjson.loads(line[6:])
                if ttft is None and any(c.get("text") for c in event.get("choices") or ()):
                    ttft = time.perf_counter() - started
                usage = event.get("usage") or usage
            buffer = buffer.rsplit(b"\n", 1)[-1]
    finally:
        writer.close()
    e2e = time.perf_counter() - started
    tokens = (usage or {}).get("completion_tokens")
    if tokens != output_len:
        raise RuntimeError(f"expected {output_len} completion tokens, got {tokens}")
    return {"tokens": tokens, "ttft_ms": round(1000 * ttft, 1), "e2e_s": round(e2e, 3),
            "tok_s": round(tokens / e2e, 2), "tpot_ms": round(1000 * (e2e - ttft) / (tokens - 1), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=str(PEERS / "llama.cpp" / "build" / "bin" / "llama-server"))
    parser.add_argument("--model-dir", default=str(PEERS / "models" / "qwen3-0.6b-random"))
    parser.add_argument("--gguf", default=str(PEERS / "gguf" / "qwen3-0.6b-random-bf16.gguf"))
    parser.add_argument("--draft-dir", default=str(PEERS / "models" / "qwen3-0.6b-draft2"))
    parser.add_argument("--draft-gguf", default=str(PEERS / "gguf" / "qwen3-0.6b-draft2-bf16.gguf"))
    parser.add_argument("--no-draft-synthetic", action="store_true", help="leave out rawserve's draft-model row")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--L", type=float, default=3.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama's -t/-tb and rawserve's --num-threads")
    parser.add_argument("--rawserve-flags", default="", help="extra flags for both rawserve servers")
    args = parser.parse_args()
    model_dir = pathlib.Path(args.model_dir)
    draft_dir, draft = pathlib.Path(args.draft_dir), pathlib.Path(args.draft_gguf)
    ensure_draft(model_dir, draft_dir, draft)
    context = args.input_len + args.output_len + 2 * args.k + 16
    raw_flags = ["--served-model-name", "m", "--dtype", "bfloat16", "--num-threads", str(args.threads),
                 "--max-model-len", str(context), *args.rawserve_flags.split()]
    synthetic = json.dumps({"method": "synthetic", "num_speculative_tokens": args.k, "acceptance_length": args.L,
                            "min_acceptance": 0})
    servers: dict[str, tuple] = {}
    try:
        servers["rawserve"] = start_server(raw_flags, str(model_dir))
        servers["rawserve_spec"] = start_server([*raw_flags, "--speculative-config", synthetic], str(model_dir))
        if not args.no_draft_synthetic:
            drafted = json.dumps({"model": str(draft_dir), "num_speculative_tokens": args.k,
                                  "acceptance_length": args.L, "min_acceptance": 0})
            servers["rawserve_draft_spec"] = start_server([*raw_flags, "--speculative-config", drafted],
                                                          str(model_dir))
        servers["llama"] = start_llama(args.llama_server, pathlib.Path(args.gguf), args.threads, context, [])
        servers["llama_spec"] = start_llama(args.llama_server, pathlib.Path(args.gguf), args.threads, context, [
            "-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.k),
            "--spec-synth-len", str(args.L), "-td", str(args.threads), "-tbd", str(args.threads)])
        load0 = os.getloadavg()[0]
        rng = random.Random(0)
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        # Warm-up: each server's first request pays one-time costs (allocation, kernel selection)
        for name, (_, port) in servers.items():
            asyncio.run(one_stream(port, [rng.randrange(1000, 100000) for _ in range(args.input_len)], 16))
        order = ["rawserve", "llama", "rawserve_spec", "llama_spec", "rawserve_draft_spec"]
        order = [name for name in order if name in servers]
        for round_index in range(args.rounds):
            prompt = [rng.randrange(1000, 100000) for _ in range(args.input_len)]
            for name in (order if round_index % 2 == 0 else order[::-1]):
                run = asyncio.run(one_stream(servers[name][1], prompt, args.output_len))
                runs[name].append(run)
                print(json.dumps({"server": name, "round": round_index, "k": args.k, "L": args.L, **run,
                                  "load_avg_1m": os.getloadavg()[0]}), flush=True)
        med = {name: {key: statistics.median(r[key] for r in group) for key in ("tok_s", "tpot_ms", "ttft_ms")}
               for name, group in runs.items()}
        ratio = lambda a, b: round(med[a]["tok_s"] / med[b]["tok_s"], 2)  # noqa: E731
        summary = {"metric": "spec_peer", "k": args.k, "L": args.L, "input_len": args.input_len,
                   "output_len": args.output_len, "threads": args.threads, "rounds": args.rounds, "medians": med,
                   "rawserve_spec_vs_plain": ratio("rawserve_spec", "rawserve"),
                   "llama_spec_vs_plain": ratio("llama_spec", "llama"),
                   "rawserve_spec_vs_llama_spec": ratio("rawserve_spec", "llama_spec"),
                   "rawserve_plain_vs_llama_plain": ratio("rawserve", "llama"),
                   **({"rawserve_draft_spec_vs_plain": ratio("rawserve_draft_spec", "rawserve"),
                       "rawserve_draft_spec_vs_llama_spec": ratio("rawserve_draft_spec", "llama_spec")}
                      if "rawserve_draft_spec" in runs else {}),
                   "target_vs_llama": TARGET_VS_LLAMA,
                   "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0]}
        # The like-for-like row (both sides pay a 2-layer draft) decides where it ran
        headline = "rawserve_draft_spec_vs_llama_spec" if "rawserve_draft_spec" in runs else \
            "rawserve_spec_vs_llama_spec"
        summary.update(target_row=headline, target_vs_llama_ok=summary[headline] >= TARGET_VS_LLAMA)
        print(json.dumps(summary), flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


if __name__ == "__main__":
    main()
