"""Resident memory of every server process (API and engine core, their children), idle and under 32 streams,
for rawserve and llama.cpp's llama-server on the same checkpoint, in one run.

python -m bench.memory [--models tiny,0.6b] [--dtypes float32,bfloat16] [--streams 32] [--ctx 256] [-- FLAGS]
One JSON line per (server, model, dtype), RSS sums beside PSS sums (what a cgroup charges: a page shared by two
processes counts once), and a `floor` line per (model, dtype): what torch and the tokenizer cost before any serving
(the RSS of a bare `import torch` process and of a process holding the tokenizer alone) beside the weights and KV
pool at that dtype. Both servers get the same context capacity: --streams sequences of
--ctx tokens (rawserve: --max-num-seqs/--max-model-len; llama-server: -np/-c streams*ctx). Checkpoints and GGUFs
come from ../shared/peers (`run.sh setup`, $PEERS_ROOT); without them rawserve runs alone on bench/checkpoints'
random checkpoints of the same shapes, and the llama-server line says why it is missing.

python -m bench.memory --abuse [--abuse-max-tokens 1000] [-- FLAGS]: the engine core's RSS through an abuse burst on
the demo model with its default flags (`python -m rawserve`, as issue 33 ran it): one JSON line each for idle, the
burst's peak and the burst's end, then a line per second until it is back within 1.2x of idle (or 30 s pass).

python -m bench.memory --breakdown [--models 0.6b] [--dtypes float32] [--kv-cache-dtypes auto,float16]: the engine
core's peak under --streams greedy streams of --prompt-words + --max-tokens tokens, run in this process (the core's
code, no HTTP), in parts: the process before the engine (python, torch), the weights, the KV pool as touched (and
as reserved), a step's activations (the largest rise of VmHWM over a forward, the KV blocks it zeroes excluded),
the sampler's (the same over a sample), the runner's reused buffers, and allocator slack (what stays resident
between steps beyond all of those: freed heap glibc keeps); `unexplained_mib` is the rest of the peak.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from bench.checkpoints import ensure_qwen3_06b_shape, rev
from bench.procs import free_port, wait_healthy

PEERS_ROOT = pathlib.Path(os.environ.get("PEERS_ROOT", pathlib.Path.home() / ".cache" / "rawserve-peers"))
LLAMA_SERVER = PEERS_ROOT / "llama.cpp" / "build" / "bin" / "llama-server"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
MIB = 1 << 20


def descendants(pid: int) -> list[int]:
    """pid and every process under it (the spawned engine core, the multiprocessing helpers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def status_kib(pid: int, field: str, source: str = "status") -> int:
    """A `field` (kB) of /proc/<pid>/status (VmRSS, VmHWM) or, with source "smaps_rollup", of that (Pss)."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/{source}").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class RssSampler:
    """Samples the summed VmRSS and Pss of a process tree every 20 ms; `peak_kib` and `peak_pss_kib` are the largest
    sums seen (the PSS one is what a container limit meets), `now_kib` one reading."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = self.peak_pss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now_kib(self) -> int:
        return sum(status_kib(p, "VmRSS") for p in descendants(self.pid))

    def now_pss_kib(self) -> int:
        return sum(status_kib(p, "Pss", "smaps_rollup") for p in descendants(self.pid))

    def per_process_mib(self, field: str = "VmRSS") -> dict[str, float]:
        """{pid and command: `field`} of each process: VmRSS now, or VmHWM, its own peak so far."""
        out = {}
        for p in descendants(self.pid):
            try:
                name = pathlib.Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:60]
            except OSError:
                continue
            out[f"{p} {name.strip()}"] = round(status_kib(p, field) / 1024, 1)
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak_kib = max(self.peak_kib, self.now_kib())
            self.peak_pss_kib = max(self.peak_pss_kib, self.now_pss_kib())

    def reset_peak(self) -> None:
        self.peak_kib, self.peak_pss_kib = self.now_kib(), self.now_pss_kib()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def stream_one(port: int, model: str, prompt: str, max_tokens: int, errors: list) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            errors.append(f"{response.status} {response.read()[:200]!r}")
            return
        while response.readline():
            pass
    except OSError as error:
        errors.append(repr(error))


def load(port: int, model: str, streams: int, prompt_words: int, max_tokens: int) -> list[str]:
    """`streams` concurrent streamed completions of distinct prompts, to completion. Returns errors."""
    words = ("time year people way day man thing woman life child world school state family student group "
             "country problem hand part place case week company system program question work government number "
             "night point home water room mother area money story fact month lot right study book eye job word "
             "business issue side kind head house service friend father power hour game line end member law car "
             "city community name president team minute idea kid body information back parent face others level "
             "office door health person art war history party result change morning reason research girl guy "
             "moment air teacher force education").split()
    errors: list[str] = []
    threads = []
    for i in range(streams):
        prompt = " ".join(words[(i * 7 + j * 13) % len(words)] for j in range(prompt_words))
        threads.append(threading.Thread(target=stream_one, args=(port, model, f"{i} {prompt}", max_tokens, errors)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def measure(label: str, cmd: list[str], port: int, model: str, args: argparse.Namespace) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    reader.start()
    sampler = RssSampler(proc.pid)
    out: dict = {"bench": "memory", "server": label}
    try:
        t0 = time.monotonic()
        wait_healthy(proc, port, label, "/ready" if label == "rawserve" else "/health")
        out["startup_s"] = round(time.monotonic() - t0, 1)
        out["startup_peak_mib"] = round(sampler.peak_kib / 1024, 1)
        out["startup_peak_pss_mib"] = round(sampler.peak_pss_kib / 1024, 1)
        try:  # rawserve says its KV pool's bytes; llama-server has no such field
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/v1/models")
            card = json.loads(conn.getresponse().read())["data"][0]
            if card.get("kv_cache_bytes"):
                out["kv_mib"] = round(card["kv_cache_bytes"] / MIB, 1)
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(2)
        out["idle_mib"] = round(sampler.now_kib() / 1024, 1)
        out["idle_pss_mib"] = round(sampler.now_pss_kib() / 1024, 1)
        out["idle_per_process_mib"] = sampler.per_process_mib()
        out["startup_peak_per_process_mib"] = sampler.per_process_mib("VmHWM")
        sampler.reset_peak()
        t0 = time.monotonic()
        errors = load(port, model, args.streams, args.prompt_words, args.max_tokens)
        out["load_s"] = round(time.monotonic() - t0, 1)
        out["load_errors"] = errors[:3]
        out["load_peak_mib"] = round(sampler.peak_kib / 1024, 1)
        out["load_peak_pss_mib"] = round(sampler.peak_pss_kib / 1024, 1)
        time.sleep(2)
        out["idle_after_mib"] = round(sampler.now_kib() / 1024, 1)
        out["idle_after_pss_mib"] = round(sampler.now_pss_kib() / 1024, 1)
        out["idle_after_per_process_mib"] = sampler.per_process_mib()
        out["peak_mib"] = max(out["startup_peak_mib"], out["load_peak_mib"])
        out["peak_pss_mib"] = max(out["startup_peak_pss_mib"], out["load_peak_pss_mib"])
        summary = [line.decode(errors="replace").strip() for line in stderr if b" serving '" in line]
        if summary:
            out["kv_cache"] = summary[-1].partition("KV cache ")[2].partition(", engine in")[0]
    except RuntimeError as error:
        out["error"] = f"{error}: {b''.join(stderr)[-600:].decode(errors='replace')}"
    finally:
        sampler.stop()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return out


def core_pid(server_pid: int) -> int | None:
    """The engine core: the largest process under the server."""
    under = [p for p in descendants(server_pid) if p != server_pid]
    return max(under, key=lambda p: status_kib(p, "VmRSS"), default=None)


def post_json(port: int, body: dict, errors: list, walk_away_after: int | None = None) -> None:
    """A completion; with walk_away_after, streamed and dropped after that many events, as a client that gives up."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": walk_away_after is not None}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            errors.append(f"{response.status} {response.read()[:200]!r}")
        elif walk_away_after is None:
            response.read()
        else:
            seen = 0
            while seen < walk_away_after and (line := response.readline()):
                seen += line.startswith(b"data: {")
        conn.close()
    except OSError as error:
        errors.append(repr(error))


def abuse(args: argparse.Namespace) -> None:
    """The demo model under `python -m rawserve`'s defaults: idle, a burst of many-sequence requests (n=128, long
    max_tokens, some dropped mid-stream) beside distinct prompts, and how soon the core comes back near idle."""
    port = free_port()
    cmd = [sys.executable, "-m", "rawserve", "--port", str(port), "--engine-mode", "process", "--no-log-requests",
           *args.flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    stderr: list[bytes] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    common = {"bench": "memory_abuse", "model": "demo", "flags": args.flags, "rev": rev()}
    try:
        wait_healthy(proc, port, "rawserve", "/ready")
        core = core_pid(proc.pid)
        summary = [line.decode(errors="replace") for line in stderr if b" serving '" in line]
        time.sleep(2)
        idle = status_kib(core, "VmRSS")
        print(json.dumps({**common, "phase": "idle", "core_mib": round(idle / 1024, 1),
                          "kv_cache": summary[-1].partition("KV cache ")[2].partition(", engine in")[0]
                          if summary else None}), flush=True)
        errors: list[str] = []
        words = "once upon a time there was a small model that served many streams".split()
        bodies = [({"prompt": "tell me a story", "n": 128, "max_tokens": args.abuse_max_tokens, "ignore_eos": True,
                    "temperature": 1.0}, None),
                  ({"prompt": "tell me another", "n": 128, "max_tokens": args.abuse_max_tokens, "ignore_eos": True,
                    "temperature": 1.0}, 2048)]
        bodies += [({"prompt": " ".join(words[(i + j) % len(words)] for j in range(args.prompt_words)) + f" {i}",
                     "max_tokens": args.max_tokens, "ignore_eos": True}, 4 if i % 4 == 0 else None)
                   for i in range(args.streams)]
        threads = [threading.Thread(target=post_json, args=(port, body, errors, cut)) for body, cut in bodies]
        peak, t0 = idle, time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, status_kib(core, "VmRSS"))
            time.sleep(0.05)
        end = status_kib(core, "VmRSS")
        print(json.dumps({**common, "phase": "peak", "core_mib": round(peak / 1024, 1),
                          "burst_s": round(time.monotonic() - t0, 1), "errors": errors[:3]}), flush=True)
        print(json.dumps({**common, "phase": "burst_end", "core_mib": round(end / 1024, 1)}), flush=True)
        t0 = time.monotonic()
        while True:
            time.sleep(1)
            now = status_kib(core, "VmRSS")
            settled = now <= 1.2 * idle
            print(json.dumps({**common, "phase": "after", "s": round(time.monotonic() - t0, 1),
                              "core_mib": round(now / 1024, 1), "ratio_to_idle": round(now / idle, 2),
                              "within_1_2x": settled}), flush=True)
            if settled or time.monotonic() - t0 > 30:
                break
    except RuntimeError as error:
        print(json.dumps({**common, "error": f"{error}: {b''.join(stderr)[-600:].decode(errors='replace')}"}))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def breakdown(args: argparse.Namespace) -> None:
    """Each (model, dtype, KV dtype) in a fresh interpreter (breakdown_one): an engine built and dropped in one
    process leaves its heap behind for the next."""
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for kv in args.kv_cache_dtypes.split(","):
                subprocess.run([sys.executable, "-m", "bench.memory", "--breakdown-one", "--models", model,
                                "--dtypes", dtype, "--kv-cache-dtypes", kv, "--streams", str(args.streams),
                                "--ctx", str(args.ctx), "--prompt-words", str(args.prompt_words),
                                "--max-tokens", str(args.max_tokens)], check=False)


def breakdown_one(args: argparse.Namespace) -> None:
    import torch

    from rawserve.engine import memory as mem
    from rawserve.engine.frontend.llm import LLM
    from rawserve.engine.model_runner import weight_bytes
    from rawserve.engine.types import SamplingParams

    model, dtype, kv = args.models, args.dtypes, args.kv_cache_dtypes
    model_dir, _ = checkpoint(model, dtype)
    before = mem.rss_bytes()
    llm = LLM(str(model_dir), device="cpu", dtype=dtype, kv_cache_dtype=kv, max_num_seqs=args.streams,
              max_model_len=args.ctx, enable_prefix_caching=False)
    runner, sampler = llm.core.runner, llm.core.sampler
    loaded = mem.rss_bytes()
    weights = weight_bytes(model_dir, runner.dtype, runner.model_config, runner.device, runner.quant)
    calls: list[tuple[str, int, int, int]] = []  # (what, RSS at its start, its VmHWM, KV bytes zeroed in it)

    def measured(fn, what):
        def wrapper(*a, **kw):
            start, zeroed = mem.rss_bytes(), runner._num_zeroed
            mem.reset_peak_rss()
            out = fn(*a, **kw)
            calls.append((what, start, mem.rss_bytes("VmHWM"), (runner._num_zeroed - zeroed) * runner.block_bytes,
                          zeroed * runner.block_bytes))
            return out
        return wrapper

    runner.execute = measured(runner.execute, "step")
    sampler.sample = measured(sampler.sample, "sampler")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, runner.vocab_size, (args.prompt_words,), generator=g).tolist()
               for _ in range(args.streams)]
    mem.reset_peak_rss()
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    # The call whose VmHWM is the highest holds the peak: resident at its start (the engine as loaded, the KV
    # blocks zeroed so far, the runner's reused buffers, freed heap kept), then its own rise.
    what, start, hwm, kv_growth, kv_before = max(calls, key=lambda c: c[2])
    buffers = sum(t.numel() * t.element_size() for group in (runner._gathered, runner._read) if group
                  for t in group)
    buffers += runner._logits.numel() * 4 if runner._logits is not None else 0
    rise = {k: max((c[2] - c[1] - c[3] for c in calls if c[0] == k), default=0) for k in ("step", "sampler")}
    out = {"bench": "memory_breakdown", "model": model, "dtype": dtype, "kv_cache_dtype": runner.kv_dtype_name,
           "streams": args.streams, "prompt_tokens": args.prompt_words, "max_tokens": args.max_tokens,
           "ctx": args.ctx, "rev": rev(), "peak_mib": round(hwm / MIB, 1), "peak_in": what,
           "before_engine_mib": round(before / MIB, 1), "weights_mib": round(weights / MIB, 1),
           "load_other_mib": round((loaded - before - weights) / MIB, 1),
           "kv_pool_touched_mib": round(runner._num_zeroed * runner.block_bytes / MIB, 1),
           "kv_pool_reserved_mib": round(runner.kv_plan.num_bytes / MIB, 1),
           "step_activations_mib": round(rise["step"] / MIB, 1), "sampler_mib": round(rise["sampler"] / MIB, 1),
           "runner_buffers_mib": round(buffers / MIB, 1),
           "allocator_slack_mib": round(max(0, start - loaded - kv_before - buffers) / MIB, 1)}
    # the peak = the process as loaded + KV zeroed by then + buffers + slack + the peak call's own rise
    out["peak_call_rise_mib"] = round((hwm - start - kv_growth) / MIB, 1)
    print(json.dumps(out), flush=True)


def checkpoint(model: str, dtype: str) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(HF checkpoint directory, GGUF file or None): the peers' pair when set up, else our own checkpoint."""
    peers_dir = PEERS_ROOT / "models" / f"qwen3-{model}-random"
    gguf = PEERS_ROOT / "gguf" / f"qwen3-{model}-random-{GGUF_TYPES[dtype]}.gguf"
    if (peers_dir / "model.safetensors").is_file() and (peers_dir / "tokenizer.json").is_file():
        return peers_dir, gguf if gguf.is_file() else None
    return ensure_qwen3_06b_shape(dtype, shape=model), None


def weight_mib(model_dir: pathlib.Path, dtype: str) -> float:
    """The checkpoint's floating-point weights once at `dtype` (whatever dtype the files hold), from their headers."""
    itemsize = 4 if dtype == "float32" else 2
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
    elements = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        elements += sum((entry["data_offsets"][1] - entry["data_offsets"][0]) // sizes[entry["dtype"]]
                        for name, entry in header.items() if name != "__metadata__" and entry["dtype"] in sizes)
    return round(elements * itemsize / MIB, 1)


_RSS_PROBE = ("import gc, pathlib, sys; {setup}; gc.collect(); "
              "print(next(l.split()[1] for l in pathlib.Path('/proc/self/status').read_text().splitlines() "
              "if l.startswith('VmRSS:')))")


def probe_rss_mib(setup: str) -> float:
    """The RSS of a fresh interpreter once it has run `setup`."""
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE.format(setup=setup)], capture_output=True, text=True,
                         check=True, timeout=300)
    return round(int(out.stdout.split()[-1]) / 1024, 1)


def floor(model_dir: pathlib.Path, weights: float, kv: float | None) -> dict:
    """What the two processes cannot go below: the core's torch and the API's tokenizer, each in a process of its
    own with nothing else, and the weights and KV pool at the served dtype."""
    torch_mib = probe_rss_mib("import torch")
    tokenizer_mib = probe_rss_mib("from rawserve.text.tokenizer import Tokenizer; "
                                  f"t = Tokenizer.from_dir({str(model_dir)!r})")
    out = {"bench": "memory", "server": "floor", "python_mib": probe_rss_mib("pass"), "import_torch_mib": torch_mib,
           "tokenizer_process_mib": tokenizer_mib, "weight_mib": weights}
    if kv is not None:
        out["kv_mib"] = kv
        out["floor_mib"] = round(torch_mib + tokenizer_mib + weights + kv, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,0.6b")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--ctx", type=int, default=256, help="Tokens per stream of context capacity.")
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-peer", action="store_true", help="rawserve alone.")
    parser.add_argument("--abuse", action="store_true", help="The demo model's abuse burst (see above), alone.")
    parser.add_argument("--abuse-max-tokens", type=int, default=1000, help="max_tokens of the n=128 requests.")
    parser.add_argument("--breakdown", action="store_true", help="The core's peak in parts (see above), alone.")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="With --breakdown: each --kv-cache-dtype.")
    parser.add_argument("--breakdown-one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help="Extra rawserve flags (after --).")
    args = parser.parse_args()
    if args.abuse:
        abuse(args)
        return
    if args.breakdown_one:
        breakdown_one(args)
        return
    if args.breakdown:
        breakdown(args)
        return
    threads = str(os.cpu_count() or 1)
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            model_dir, gguf = checkpoint(model, dtype)
            common = {"model": model, "dtype": dtype, "streams": args.streams, "ctx_tokens": args.streams * args.ctx,
                      "weight_mib": weight_mib(model_dir, dtype),
                      "rev": rev()}
            port = free_port()
            cmd = [sys.executable, "-m", "rawserve", "serve", str(model_dir), "--port", str(port), "--dtype", dtype,
                   "--served-model-name", model, "--max-num-seqs", str(args.streams), "--max-model-len",
                   str(args.ctx), "--engine-mode", "process", "--no-log-requests", *args.flags]
            ours = measure("rawserve", cmd, port, model, args)
            # The idle target: the weights once at the served dtype, the KV pool, and 150 MB.
            if "idle_mib" in ours and "kv_mib" in ours:
                ours["idle_target_mib"] = round(common["weight_mib"] + ours["kv_mib"] + 150e6 / MIB, 1)
            print(json.dumps({**common, **ours}), flush=True)
            print(json.dumps({**common, **floor(model_dir, common["weight_mib"], ours.get("kv_mib"))}), flush=True)
            if args.no_peer:
                continue
            if gguf is None or not LLAMA_SERVER.is_file():
                print(json.dumps({**common, "bench": "memory", "server": "llama-server",
                                  "error": f"not set up: run `bash ../shared/peers/run.sh setup` ({LLAMA_SERVER}, "
                                           f"{gguf or 'no GGUF'})"}), flush=True)
                continue
            port = free_port()
            cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--alias", model, "--host", "127.0.0.1", "--port", str(port),
                   "-t", threads, "-tb", threads, "-np", str(args.streams), "-c", str(args.streams * args.ctx),
                   "-kvu", "--no-webui"]
            peer = measure("llama-server", cmd, port, model, args)
            if "peak_mib" in peer and "peak_mib" in ours:
                peer["rawserve_peak_ratio"] = round(ours["peak_mib"] / peer["peak_mib"], 2)
            print(json.dumps({**common, **peer}), flush=True)


if __name__ == "__main__":
    main()
